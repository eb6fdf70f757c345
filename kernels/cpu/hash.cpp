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
#include "common.h"
#include "parallel.h"
#include "steps.h"
#include "vec.h"

namespace bert_cluster {
namespace {

// GCC vector extensions: lowered to the widest registers of each BC_MULTIVERSION clone.
typedef uint64_t u64x8 __attribute__((vector_size(64)));
typedef int64_t i64x8 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

// Hashes of `count` query rows (`stride` elements apart, dk values each): bit b is [q . w_b + o_b > 0].
// planes_t is (dk, 64): the planes transposed and zero-padded to 64, so the projections of a query
// accumulate in NB 16-lane vectors (NB = ceil(B / 16)), with no (N, B) projection matrix in memory; the
// signs are packed with vector compares. QB queries at a time share each plane load (independent FMA
// chains); each query's sums run in the same order whatever its neighbours, so its bits never depend on
// the blocking. The order differs from a GEMM's, so a projection within a few ulps of 0 may round to the
// other side than in the reference (the tests draw their inputs away from that).
template <int NB, int QB>
BC_INLINE void hash_block(const float* const* q, const float* __restrict planes_t, const f32x16* off, int64_t dk,
                          uint64_t mask, int64_t* __restrict out) {
  f32x16 acc[QB][NB];
  for (int i = 0; i < QB; ++i)
    for (int b = 0; b < NB; ++b) acc[i][b] = f32x16{};
  for (int64_t d = 0; d < dk; ++d) {
    f32x16 w[NB];
    for (int b = 0; b < NB; ++b) w[b] = load16(planes_t + d * 64 + 16 * b);
    for (int i = 0; i < QB; ++i) {
      const float x = q[i][d];
      for (int b = 0; b < NB; ++b) acc[i][b] += x * w[b];
    }
  }
  const f32x16 zero = {};
  for (int i = 0; i < QB; ++i) {
    uint64_t h = 0;
    for (int b = 0; b < NB; ++b) h |= static_cast<uint64_t>(lane_bits((i32x16)(acc[i][b] + off[b] > zero))) << (16 * b);
    out[i] = static_cast<int64_t>(h & mask);
  }
}

template <int NB, typename T>
BC_INLINE void hash_rows_nb(const T* q, int64_t stride, const float* __restrict planes_t,
                            const float* __restrict offsets, int64_t count, int64_t dk, int64_t bits,
                            int64_t* __restrict out, float* __restrict buf) {
  constexpr int QB = NB <= 2 ? 4 : 3;
  f32x16 off[NB];
  for (int b = 0; b < NB; ++b) off[b] = load16(offsets + 16 * b);
  const uint64_t mask = bits >= 64 ? ~uint64_t{0} : (uint64_t{1} << bits) - 1;
  const float* rows[QB];
  int64_t i = 0;
  for (; i + QB <= count; i += QB) {
    for (int j = 0; j < QB; ++j) {
      if constexpr (std::is_same_v<T, float>) {
        rows[j] = q + (i + j) * stride;
      } else {
        widen(q + (i + j) * stride, buf + j * dk, dk);
        rows[j] = buf + j * dk;
      }
    }
    hash_block<NB, QB>(rows, planes_t, off, dk, mask, out + i);
  }
  for (; i < count; ++i) {
    if constexpr (std::is_same_v<T, float>) {
      rows[0] = q + i * stride;
    } else {
      widen(q + i * stride, buf, dk);
      rows[0] = buf;
    }
    hash_block<NB, 1>(rows, planes_t, off, dk, mask, out + i);
  }
}

template <typename T>
BC_INLINE void hash_rows_t(const T* q, int64_t stride, const float* planes_t, const float* offsets, int64_t count,
                           int64_t dk, int64_t bits, int64_t* out, float* buf) {
  switch ((bits + 15) / 16) {
    case 1: hash_rows_nb<1>(q, stride, planes_t, offsets, count, dk, bits, out, buf); break;
    case 2: hash_rows_nb<2>(q, stride, planes_t, offsets, count, dk, bits, out, buf); break;
    case 3: hash_rows_nb<3>(q, stride, planes_t, offsets, count, dk, bits, out, buf); break;
    default: hash_rows_nb<4>(q, stride, planes_t, offsets, count, dk, bits, out, buf); break;
  }
}

// Rows [begin, end) of the flattened (R * H * N) queries, cut at (row, head) boundaries.
BC_MULTIVERSION
void hash_range(const HashJob& job, int64_t begin, int64_t end) {
  std::vector<float> buf(4 * std::max<int64_t>(job.dk, 1));
  for (int64_t x = begin; x < end;) {
    const int64_t rh = x / job.n, i = x % job.n, r = rh / job.heads, h = rh % job.heads;
    const int64_t count = std::min(end, (rh + 1) * job.n) - x;
    switch (job.type) {
      case InputType::kFloat32:
        hash_rows_t(job.q.at<float>(r, h, i), job.q.s2, job.planes_t, job.offsets, count, job.dk, job.bits,
                    job.out + x, buf.data());
        break;
      case InputType::kBFloat16:
        hash_rows_t(job.q.at<c10::BFloat16>(r, h, i), job.q.s2, job.planes_t, job.offsets, count, job.dk,
                    job.bits, job.out + x, buf.data());
        break;
      case InputType::kFloat16:
        hash_rows_t(job.q.at<c10::Half>(r, h, i), job.q.s2, job.planes_t, job.offsets, count, job.dk, job.bits,
                    job.out + x, buf.data());
        break;
    }
    x += count;
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
// 32 queries (four vectors of 8) against one centroid at a time, with one key per query: distance in the
// high word, centroid index in the low word, so that a min keeps the nearest and, among equals, the lowest
// index (no compares or blends). `Pop` counts the bits of each lane (shifts and adds, or AVX-512 VPOPCNTQ
// where the CPU has it).
template <typename Pop>
__attribute__((always_inline)) inline void assign_body(const uint64_t* __restrict hashes, const bool* __restrict valid,
                                                       int64_t n, const uint64_t* __restrict cent,
                                                       const char* __restrict present, int64_t clusters, uint64_t mask,
                                                       int64_t* __restrict assign, Pop pop) {
  constexpr int kVectors = 4;
  constexpr int64_t kBlock = 8 * kVectors;
  constexpr uint64_t kNone = ~0ULL;  // above every key: no present centroid -> -1 below
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t len = std::min<int64_t>(kBlock, n - i0);
    u64x8 h[kVectors] = {}, best[kVectors];
    std::memcpy(h, hashes + i0, len * sizeof(uint64_t));
    for (int v = 0; v < kVectors; ++v) {
      h[v] &= mask;
      best[v] = h[v] * 0 + kNone;
    }
    for (int64_t c = 0; c < clusters; ++c) {
      if (!present[c]) continue;  // an empty initial slot never wins
      const uint64_t centroid = cent[c] & mask;
      for (int v = 0; v < kVectors; ++v) {
        const u64x8 key = (pop(h[v] ^ centroid) << 32) | static_cast<uint64_t>(c);
        best[v] = key < best[v] ? key : best[v];
      }
    }
    for (int64_t j = 0; j < len; ++j) {
      const uint64_t key = best[j / 8][j % 8];
      assign[i0 + j] = valid[i0 + j] && key != kNone ? static_cast<int64_t>(key & 0xFFFFFFFFULL) : -1;
    }
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

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && __GNUC__ >= 12 && \
    (!defined(BERT_CLUSTER_NO_MULTIVERSION) || defined(__AVX512VPOPCNTDQ__))
#define BC_HAVE_VPOPCNT 1
#if defined(BERT_CLUSTER_NO_MULTIVERSION)  // -march=native builds: the function takes the command line's ISA
#define BC_VPOPCNT_TARGET
#else
#define BC_VPOPCNT_TARGET __attribute__((target("arch=x86-64-v4,avx512vpopcntdq")))
#endif
// assign_all with AVX-512 VPOPCNTQ (the same loop: a target-specific popcount cannot be inlined into the
// generic template body, so the body is repeated here).
BC_VPOPCNT_TARGET
void assign_all_vpopcnt(const uint64_t* __restrict hashes, const bool* __restrict valid, int64_t n,
                        const uint64_t* __restrict cent, const char* __restrict present, int64_t clusters,
                        uint64_t mask, int64_t* __restrict assign) {
  constexpr int kVectors = 4;
  constexpr int64_t kBlock = 8 * kVectors;
  constexpr uint64_t kNone = ~0ULL;
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t len = std::min<int64_t>(kBlock, n - i0);
    u64x8 h[kVectors] = {}, best[kVectors];
    std::memcpy(h, hashes + i0, len * sizeof(uint64_t));
    for (int v = 0; v < kVectors; ++v) {
      h[v] &= mask;
      best[v] = h[v] * 0 + kNone;
    }
    for (int64_t c = 0; c < clusters; ++c) {
      if (!present[c]) continue;
      const uint64_t centroid = cent[c] & mask;
      for (int v = 0; v < kVectors; ++v) {
        const u64x8 key = ((u64x8)_mm512_popcnt_epi64((__m512i)(h[v] ^ centroid)) << 32) | static_cast<uint64_t>(c);
        best[v] = key < best[v] ? key : best[v];
      }
    }
    for (int64_t j = 0; j < len; ++j) {
      const uint64_t key = best[j / 8][j % 8];
      assign[i0 + j] = valid[i0 + j] && key != kNone ? static_cast<int64_t>(key & 0xFFFFFFFFULL) : -1;
    }
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

// Per-cluster member counts and per-bit counts of ones (64 uint32 per cluster). Each hash is spread to 64
// bytes (byte b = bit b: one in-lane byte shuffle and a test), added to 8-bit counters of its cluster, and
// a cluster's 8-bit counters are flushed into the 32-bit ones before they can overflow (every 255 members).
typedef uint8_t u8x64 __attribute__((vector_size(64)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));

BC_MULTIVERSION
void count_bits(const uint64_t* __restrict hashes, const int64_t* __restrict assign, int64_t n, int64_t clusters,
                uint32_t* __restrict ones, int64_t* __restrict members, uint8_t* __restrict small,
                int32_t* __restrict pending) {
  const u8x64 bit = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128,
                     1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128,
                     1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
  auto flush = [&](int64_t c) {
    for (int q = 0; q < 4; ++q) {
      u8x16 part;
      std::memcpy(&part, small + c * 64 + 16 * q, sizeof(part));
      u32x16 wide = __builtin_convertvector(part, u32x16), total;
      std::memcpy(&total, ones + c * 64 + 16 * q, sizeof(total));
      total += wide;
      std::memcpy(ones + c * 64 + 16 * q, &total, sizeof(total));
    }
    std::memset(small + c * 64, 0, 64);
    pending[c] = 0;
  };
  for (int64_t i = 0; i < n; ++i) {
    const int64_t c = assign[i];
    if (c < 0) continue;
    members[c] += 1;
    u64x8 h = {};
    h += hashes[i];
    u8x64 bytes;
    std::memcpy(&bytes, &h, sizeof(bytes));
    // byte b takes byte b / 8 of the hash (all copies of the hash sit in every 16-byte lane)
    bytes = __builtin_shufflevector(bytes, bytes, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 18, 18, 18, 18,
                                    18, 18, 18, 18, 19, 19, 19, 19, 19, 19, 19, 19, 36, 36, 36, 36, 36, 36, 36, 36,
                                    37, 37, 37, 37, 37, 37, 37, 37, 54, 54, 54, 54, 54, 54, 54, 54, 55, 55, 55, 55,
                                    55, 55, 55, 55);
    u8x64 count;
    std::memcpy(&count, small + c * 64, sizeof(count));
    count -= (u8x64)((bytes & bit) != 0);
    std::memcpy(small + c * 64, &count, sizeof(count));
    if (++pending[c] == 255) flush(c);
  }
  for (int64_t c = 0; c < clusters; ++c)
    if (pending[c] > 0) flush(c);
}

// Moves query hash `h` from cluster `from` to cluster `to` in the bit counts (-1: none), as count_bits
// would count the new partition: the counts are integers, so updating those of the queries that moved
// gives exactly the recount (which after the first rounds touches a few queries instead of all).
BC_MULTIVERSION
void move_bits(uint64_t h, int64_t from, int64_t to, uint32_t* __restrict ones, int64_t* __restrict members) {
  u32x16 lane;
  for (int j = 0; j < 16; ++j) lane[j] = static_cast<uint32_t>(j);
  for (int w = 0; w < 4; ++w) {
    const u32x16 word = u32x16{} + static_cast<uint32_t>(h >> (16 * w));
    const u32x16 bits = (word >> lane) & 1u;
    if (from >= 0) {
      u32x16 total;
      std::memcpy(&total, ones + from * 64 + 16 * w, sizeof(total));
      total -= bits;
      std::memcpy(ones + from * 64 + 16 * w, &total, sizeof(total));
    }
    if (to >= 0) {
      u32x16 total;
      std::memcpy(&total, ones + to * 64 + 16 * w, sizeof(total));
      total += bits;
      std::memcpy(ones + to * 64 + 16 * w, &total, sizeof(total));
    }
  }
  if (from >= 0) members[from] -= 1;
  if (to >= 0) members[to] += 1;
}

// New centroid bits: 2 * ones > members -> 1, < -> 0, equal (a tie, or an empty cluster) -> the old bit.
// Returns whether any centroid changed.
BC_MULTIVERSION
bool majority_update(const uint32_t* __restrict ones, const int64_t* __restrict members, int64_t clusters,
                     uint64_t mask, uint64_t* __restrict cent) {
  bool changed = false;
  for (int64_t c = 0; c < clusters; ++c) {
    const int32_t m = static_cast<int32_t>(members[c]);
    uint64_t above = 0, below = 0;
    for (int w = 0; w < 4; ++w) {
      i32x16 twice;
      std::memcpy(&twice, ones + c * 64 + 16 * w, sizeof(twice));
      twice = twice * 2;
      above |= static_cast<uint64_t>(lane_bits((i32x16)(twice > m))) << (16 * w);
      below |= static_cast<uint64_t>(lane_bits((i32x16)(twice < m))) << (16 * w);
    }
    const uint64_t updated = (above | (cent[c] & ~below)) & mask;
    changed |= updated != cent[c];
    cent[c] = updated;
  }
  return changed;
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
    TORCH_CHECK_VALUE(hashes_in[i] >= 0 && (bits == 63 || hashes_in[i] < (int64_t{1} << bits)),
                      "hashes must be in 0..2^bits - 1 (as hash_queries returns), got ", hashes_in[i]);
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
  std::vector<uint8_t> small(clusters * 64);
  std::vector<int32_t> pending(clusters);
  std::vector<int64_t> members(clusters);
  std::vector<int64_t> previous;  // the last round's assignment, to update the counts by the queries that moved
  bool settled = false;  // `assign` is already the assignment to the final centroids
  for (int64_t it = 0; it < iterations; ++it) {
    assign_all(hashes, valid, n, cent.data(), present.data(), clusters, mask, assign);
    if (it == 0) {
      std::fill(ones.begin(), ones.end(), 0u);
      std::fill(members.begin(), members.end(), 0);
      count_bits(hashes, assign, n, clusters, ones.data(), members.data(), small.data(), pending.data());
      if (iterations > 1) previous.assign(assign, assign + n);
    } else {
      for (int64_t i = 0; i < n; ++i)
        if (assign[i] != previous[i]) {
          move_bits(hashes[i] & mask, previous[i], assign[i], ones.data(), members.data());
          previous[i] = assign[i];
        }
    }
    // Majority vote per bit; a tied vote (including an empty cluster: 0 == 0) keeps the old bit.
    const bool changed = majority_update(ones.data(), members.data(), clusters, mask, cent.data());
    // A fixed point: the remaining rounds would reassign and re-vote to exactly the same values, and the
    // final assignment would repeat this round's.
    if (!changed) {
      settled = true;
      break;
    }
  }
  if (!settled) assign_all(hashes, valid, n, cent.data(), present.data(), clusters, mask, assign);
  for (int64_t c = 0; c < clusters; ++c) centroids[c] = static_cast<int64_t>(cent[c]);
}

}  // namespace

std::pair<at::Tensor, at::Tensor> padded_planes(const at::Tensor& planes, const at::Tensor& offsets, int64_t dk) {
  const int64_t bits = planes.size(0);
  const auto f32 = planes.options().dtype(at::kFloat);
  at::Tensor planes_t = at::zeros({std::max<int64_t>(dk, 1), 64}, f32);
  planes_t.narrow(0, 0, dk).narrow(1, 0, bits).copy_(planes.t());
  at::Tensor off = at::zeros({64}, f32);
  off.narrow(0, 0, bits).copy_(offsets);
  return {planes_t, off};
}

void hash_rows(const HashJob& job, int64_t begin, int64_t end) { hash_range(job, begin, end); }

void hamming_kmeans_head(const int64_t* hashes, const bool* valid, int64_t n, int64_t clusters, int64_t iterations,
                         int64_t bits, int64_t* assign, int64_t* centroids) {
  kmeans_one(hashes, valid, n, clusters, iterations, bits, assign, centroids);
}

at::Tensor hash_queries_cpu(const at::Tensor& queries, const at::Tensor& planes, const at::Tensor& offsets) {
  check_hash_args(queries, planes, offsets);
  const at::Tensor q = last_dim_contiguous(queries);
  const int64_t bits = planes.size(0), dk = queries.size(3);
  const auto [planes_t, off] = padded_planes(planes, offsets, dk);
  at::Tensor out = at::empty(queries.sizes().slice(0, 3), queries.options().dtype(at::kLong));
  const int64_t count = out.numel();
  if (count == 0) return out;
  HashJob job{Rows::of(q), input_type(q), planes_t.data_ptr<float>(), off.data_ptr<float>(), queries.size(1),
              queries.size(2), dk, bits, out.data_ptr<int64_t>()};
  const int64_t vectors = (bits + 15) / 16;
  parallel_for(0, count, grain_for(std::max<int64_t>(dk, 1) * vectors * 16),
               [&](int64_t begin, int64_t end) { hash_range(job, begin, end); });
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
