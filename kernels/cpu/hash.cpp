// hash_queries and hamming_kmeans on the CPU (see bert_cluster/reference.py for the rules reproduced).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "../checks.h"
#include "parallel.h"
#include "vec.h"

namespace bert_cluster {
namespace {

// GCC vector extensions: lowered to the widest registers of each BC_MULTIVERSION clone.
typedef uint64_t u64x8 __attribute__((vector_size(64)));
typedef int64_t i64x8 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

// Hashes of `count` queries (rows of q, dk floats each): bit b is [q . w_b + o_b > 0]. planes_t is
// (dk, 64): the planes transposed and zero-padded to 64, so the 64 projections of a query accumulate in
// four 16-lane vectors, with no (N, B) projection matrix in memory. The summation order differs from a
// GEMM's, so a projection within a few ulps of 0 may round to the other side than in the reference
// (the tests draw their inputs away from that).
BC_MULTIVERSION
void hash_rows(const float* __restrict q, const float* __restrict planes_t, const float* __restrict offsets,
               int64_t count, int64_t dk, int64_t bits, int64_t* __restrict out) {
  const f32x16 o0 = load16(offsets), o1 = load16(offsets + 16);
  const f32x16 o2 = load16(offsets + 32), o3 = load16(offsets + 48);
  float projections[64];
  int64_t i = 0;
  // Two queries at a time: eight independent FMA chains instead of four (the loop is latency-bound), each
  // query's sums in the same order as below, so its bits do not depend on the pairing.
  for (; i + 2 <= count; i += 2) {
    const float* qi = q + i * dk;
    const float* qj = qi + dk;
    f32x16 a0 = {}, a1 = {}, a2 = {}, a3 = {}, b0 = {}, b1 = {}, b2 = {}, b3 = {};
    for (int64_t d = 0; d < dk; ++d) {
      const float* w = planes_t + d * 64;
      const f32x16 w0 = load16(w), w1 = load16(w + 16), w2 = load16(w + 32), w3 = load16(w + 48);
      const float x = qi[d], y = qj[d];
      a0 += x * w0;
      a1 += x * w1;
      a2 += x * w2;
      a3 += x * w3;
      b0 += y * w0;
      b1 += y * w1;
      b2 += y * w2;
      b3 += y * w3;
    }
    const f32x16 sums[2][4] = {{a0 + o0, a1 + o1, a2 + o2, a3 + o3}, {b0 + o0, b1 + o1, b2 + o2, b3 + o3}};
    for (int j = 0; j < 2; ++j) {
      std::memcpy(projections, sums[j], sizeof(projections));
      uint64_t h = 0;
      for (int64_t b = 0; b < bits; ++b) h |= static_cast<uint64_t>(projections[b] > 0.f) << b;
      out[i + j] = static_cast<int64_t>(h);
    }
  }
  for (; i < count; ++i) {
    const float* qi = q + i * dk;
    f32x16 a0 = {}, a1 = {}, a2 = {}, a3 = {};
    for (int64_t d = 0; d < dk; ++d) {
      const float* w = planes_t + d * 64;
      const float x = qi[d];
      a0 += x * load16(w);
      a1 += x * load16(w + 16);
      a2 += x * load16(w + 32);
      a3 += x * load16(w + 48);
    }
    a0 += o0;
    a1 += o1;
    a2 += o2;
    a3 += o3;
    std::memcpy(projections, &a0, sizeof(a0));
    std::memcpy(projections + 16, &a1, sizeof(a1));
    std::memcpy(projections + 32, &a2, sizeof(a2));
    std::memcpy(projections + 48, &a3, sizeof(a3));
    uint64_t h = 0;
    for (int64_t b = 0; b < bits; ++b) h |= static_cast<uint64_t>(projections[b] > 0.f) << b;
    out[i] = static_cast<int64_t>(h);
  }
}

// Bits set in each lane, by shifts and adds only (no popcnt or 64-bit multiply needed).
__attribute__((always_inline)) inline u64x8 popcount8(u64x8 x) {
  x = x - ((x >> 1) & 0x5555555555555555ULL);
  x = (x & 0x3333333333333333ULL) + ((x >> 2) & 0x3333333333333333ULL);
  x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0FULL;
  x += x >> 8;
  x += x >> 16;
  x += x >> 32;
  return x & 0x7FULL;
}

// Assignment: nearest present centroid in Hamming distance, ties to the lowest index; padding gets -1.
// Eight queries at a time, one centroid at a time: no data-dependent branches. `Pop` counts the bits of
// each lane (shifts and adds, or AVX-512 VPOPCNTQ where the CPU has it).
template <typename Pop>
__attribute__((always_inline)) inline void assign_body(const uint64_t* __restrict hashes, const bool* __restrict valid,
                                                       int64_t n, const uint64_t* __restrict cent,
                                                       const char* __restrict present, int64_t clusters, uint64_t mask,
                                                       int64_t* __restrict assign, Pop pop) {
  for (int64_t i0 = 0; i0 < n; i0 += 8) {
    const int64_t len = std::min<int64_t>(8, n - i0);
    u64x8 h = {};
    std::memcpy(&h, hashes + i0, len * sizeof(uint64_t));
    u64x8 best_distance = h * 0 + 1000;
    i64x8 best = (i64x8)(h * 0) - 1;
    for (int64_t c = 0; c < clusters; ++c) {
      if (!present[c]) continue;  // an empty initial slot never wins
      const u64x8 d = pop((h ^ cent[c]) & mask);
      const i64x8 closer = (i64x8)(d < best_distance);  // strict: the lowest index wins ties
      best_distance = closer ? d : best_distance;
      best = closer ? (best * 0 + c) : best;
    }
    for (int64_t j = 0; j < len; ++j) assign[i0 + j] = valid[i0 + j] ? best[j] : -1;
  }
}

struct SwarPopcount {
  __attribute__((always_inline)) u64x8 operator()(u64x8 x) const { return popcount8(x); }
};

BC_MULTIVERSION
void assign_all(const uint64_t* __restrict hashes, const bool* __restrict valid, int64_t n,
                const uint64_t* __restrict cent, const char* __restrict present, int64_t clusters, uint64_t mask,
                int64_t* __restrict assign) {
  assign_body(hashes, valid, n, cent, present, clusters, mask, assign, SwarPopcount{});
}

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && __GNUC__ >= 12
#define BC_HAVE_VPOPCNT 1
#define BC_VPOPCNT_TARGET __attribute__((target("arch=x86-64-v4,avx512vpopcntdq")))
// assign_all with AVX-512 VPOPCNTQ (the same loop: a target-specific popcount cannot be inlined into the
// generic template body, so the body is repeated here).
BC_VPOPCNT_TARGET
void assign_all_vpopcnt(const uint64_t* __restrict hashes, const bool* __restrict valid, int64_t n,
                        const uint64_t* __restrict cent, const char* __restrict present, int64_t clusters,
                        uint64_t mask, int64_t* __restrict assign) {
  for (int64_t i0 = 0; i0 < n; i0 += 8) {
    const int64_t len = std::min<int64_t>(8, n - i0);
    u64x8 h = {};
    std::memcpy(&h, hashes + i0, len * sizeof(uint64_t));
    u64x8 best_distance = h * 0 + 1000;
    i64x8 best = (i64x8)(h * 0) - 1;
    for (int64_t c = 0; c < clusters; ++c) {
      if (!present[c]) continue;
      const u64x8 d = (u64x8)_mm512_popcnt_epi64((__m512i)((h ^ cent[c]) & mask));
      const i64x8 closer = (i64x8)(d < best_distance);
      best_distance = closer ? d : best_distance;
      best = closer ? (best * 0 + c) : best;
    }
    for (int64_t j = 0; j < len; ++j) assign[i0 + j] = valid[i0 + j] ? best[j] : -1;
  }
}
#endif

using AssignFn = void (*)(const uint64_t*, const bool*, int64_t, const uint64_t*, const char*, int64_t, uint64_t,
                          int64_t*);

// The assignment loop for this CPU (chosen once).
AssignFn pick_assign() {
#ifdef BC_HAVE_VPOPCNT
  __builtin_cpu_init();
  if (__builtin_cpu_supports("x86-64-v4") && __builtin_cpu_supports("avx512vpopcntdq")) return assign_all_vpopcnt;
#endif
  return assign_all;
}

// Per-cluster member counts and per-bit counts of ones: 64 uint32 counters per cluster, updated as four
// 16-lane vectors (lanes 0-31 from the low word, 32-63 from the high word).
BC_MULTIVERSION
void count_bits(const uint64_t* __restrict hashes, const int64_t* __restrict assign, int64_t n,
                uint32_t* __restrict ones, int64_t* __restrict members) {
  const u32x16 shift = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  for (int64_t i = 0; i < n; ++i) {
    const int64_t c = assign[i];
    if (c < 0) continue;
    members[c] += 1;
    const uint32_t words[2] = {static_cast<uint32_t>(hashes[i]), static_cast<uint32_t>(hashes[i] >> 32)};
    uint32_t* count = ones + c * 64;
    for (int k = 0; k < 4; ++k) {
      const u32x16 bits = ((shift * 0 + words[k / 2]) >> (shift + 16 * (k % 2))) & 1u;
      u32x16 v;
      std::memcpy(&v, count + 16 * k, sizeof(v));
      v += bits;
      std::memcpy(count + 16 * k, &v, sizeof(v));
    }
  }
}

// Lloyd's K-means in Hamming space for one (row, head); see reference.hamming_kmeans for every rule.
void kmeans_one(const int64_t* __restrict hashes_in, const bool* __restrict valid, int64_t n, int64_t clusters,
                int64_t iterations, int64_t bits, int64_t* __restrict assign, int64_t* __restrict centroids) {
  const uint64_t mask = (1ULL << bits) - 1ULL;  // bits <= 63
  const uint64_t* hashes = reinterpret_cast<const uint64_t*>(hashes_in);

  // Initial centroids: the distinct hashes of the valid queries in order of first occurrence, found in
  // one pass with an open-addressing set of the hashes seen (no sort). Hashes are < 2^63, so ~0 is free.
  int shift = 64;
  while ((int64_t{1} << (64 - shift)) < 2 * n) --shift;  // capacity 2^(64 - shift) >= 2n
  const uint64_t cap_mask = (uint64_t{1} << (64 - shift)) - 1;
  constexpr uint64_t kFree = ~uint64_t{0};
  std::vector<uint64_t> seen(cap_mask + 1, kFree);
  std::vector<int64_t> first;
  for (int64_t i = 0; i < n; ++i) {
    if (!valid[i]) continue;
    const uint64_t h = hashes[i];
    uint64_t slot = shift < 64 ? (h * 0x9E3779B97F4A7C15ULL) >> shift : 0;
    while (seen[slot] != kFree && seen[slot] != h) slot = (slot + 1) & cap_mask;
    if (seen[slot] == kFree) {
      seen[slot] = h;
      first.push_back(i);
    }
  }
  const int64_t distinct = static_cast<int64_t>(first.size());

  std::vector<uint64_t> cent(clusters);
  std::vector<char> present(clusters);
  for (int64_t s = 0; s < clusters; ++s) {
    const bool is_present = s < distinct || distinct > clusters;
    const int64_t pick = distinct > clusters ? (s * distinct) / clusters : s;
    present[s] = is_present;
    cent[s] = is_present ? hashes[first[pick]] : 0ULL;
  }

  static const AssignFn assign_all = pick_assign();
  std::vector<uint32_t> ones(clusters * 64);
  std::vector<int64_t> members(clusters);
  for (int64_t it = 0; it < iterations; ++it) {
    assign_all(hashes, valid, n, cent.data(), present.data(), clusters, mask, assign);
    std::fill(ones.begin(), ones.end(), 0u);
    std::fill(members.begin(), members.end(), 0);
    count_bits(hashes, assign, n, ones.data(), members.data());
    // Majority vote per bit; a tied vote (including an empty cluster: 0 == 0) keeps the old bit.
    bool changed = false;
    for (int64_t c = 0; c < clusters; ++c) {
      const uint32_t* count = ones.data() + c * 64;
      uint64_t updated = 0;
      for (int64_t b = 0; b < bits; ++b) {
        const int64_t twice = 2 * static_cast<int64_t>(count[b]);
        const uint64_t old_bit = (cent[c] >> b) & 1ULL;
        const uint64_t bit = twice > members[c] ? 1ULL : (twice < members[c] ? 0ULL : old_bit);
        updated |= bit << b;
      }
      changed |= updated != cent[c];
      cent[c] = updated;
    }
    // A fixed point: the remaining rounds would reassign and re-vote to exactly the same values.
    if (!changed) break;
  }
  assign_all(hashes, valid, n, cent.data(), present.data(), clusters, mask, assign);
  for (int64_t c = 0; c < clusters; ++c) centroids[c] = static_cast<int64_t>(cent[c]);
}

}  // namespace

at::Tensor hash_queries_cpu(const at::Tensor& queries, const at::Tensor& planes, const at::Tensor& offsets) {
  check_hash_args(queries, planes, offsets);
  const at::Tensor q = queries.to(at::kFloat).contiguous();
  const int64_t bits = planes.size(0), dk = queries.size(3);
  const at::Tensor planes_t = at::zeros({dk, 64}, q.options());
  planes_t.narrow(1, 0, bits).copy_(planes.to(at::kFloat).t());
  const at::Tensor off = at::zeros({64}, q.options());
  off.narrow(0, 0, bits).copy_(offsets.to(at::kFloat));
  at::Tensor out = at::empty(queries.sizes().slice(0, 3), queries.options().dtype(at::kLong));
  const int64_t count = out.numel();
  const float* qp = q.data_ptr<float>();
  const float* pt = planes_t.data_ptr<float>();
  const float* op = off.data_ptr<float>();
  int64_t* h = out.data_ptr<int64_t>();
  parallel_for(0, count, grain_for(dk * 64), [&](int64_t begin, int64_t end) {
    hash_rows(qp + begin * dk, pt, op, end - begin, dk, bits, h + begin);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> hamming_kmeans_cpu(const at::Tensor& hashes, const at::Tensor& valid,
                                                      int64_t clusters, int64_t iterations, int64_t bits) {
  check_kmeans_args(hashes, valid, clusters, iterations, bits);
  const at::Tensor h = hashes.contiguous();
  const at::Tensor v = valid.contiguous();
  const int64_t rows = h.size(0), heads = h.size(1), n = h.size(2);
  at::Tensor assignments = at::empty({rows, heads, n}, h.options());
  at::Tensor centroids = at::empty({rows, heads, clusters}, h.options());
  const int64_t* hp = h.data_ptr<int64_t>();
  const bool* vp = v.data_ptr<bool>();
  int64_t* ap = assignments.data_ptr<int64_t>();
  int64_t* cp = centroids.data_ptr<int64_t>();
  // Cost per head: ~n * clusters Hamming distances per round, each worth ~32 simple steps.
  parallel_for(0, rows * heads, grain_for(n * clusters * iterations * 32), [&](int64_t begin, int64_t end) {
    for (int64_t rh = begin; rh < end; ++rh) {
      const int64_t r = rh / heads;
      kmeans_one(hp + rh * n, vp + r * n, n, clusters, iterations, bits, ap + rh * n, cp + rh * clusters);
    }
  });
  return {assignments, centroids};
}

TORCH_LIBRARY_IMPL(bert_cluster, CPU, m) {
  m.impl("hash_queries", &hash_queries_cpu);
  m.impl("hamming_kmeans", &hamming_kmeans_cpu);
}

}  // namespace bert_cluster
