// hash_queries and hamming_kmeans on the CPU (see bert_cluster/reference.py for the rules reproduced).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

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
#include "lanes.h"
#include "ops.h"
#include "parallel.h"
#include "steps.h"
#include "vec.h"

namespace bert_cluster {
namespace {

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
  // As many queries as keep their accumulators in registers (32 AVX-512 registers, 16 below): at 64 bits,
  // 6 queries with AVX-512 and 1 with AVX2 (one query: 8 registers), measured 64 -> 53 and 305 -> 123 ns
  // per query against 3 queries each.
  constexpr int kAccumulators = kNativeBytes == 64 ? 24 : 8, per_query = NB * (64 / kNativeBytes);
  constexpr int QB = std::clamp(kAccumulators / per_query, 1, 8);
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
void hash_range(const HashJob& job, int64_t begin, int64_t end) {
  Floats buf(8 * std::max<int64_t>(job.dk, 1));  // QB <= 8 widened rows
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

// Assignment: nearest present centroid in Hamming distance, ties to the lowest index; padding gets -1.
// Each query keeps one key, distance in the high word and centroid index in the low word, so that a min
// keeps the nearest and, among equals, the lowest index (no compares or blends). After the first round only
// the centroids that moved are scanned: a query's keys to the others are unchanged, and its old best key
// was their minimum. min(old best, the moved centroids' keys) is therefore its new best, unless its own
// centroid moved away from it (its key grew), when it may have a better one elsewhere: such a query is
// scanned against every centroid again. The result is the full scan's, bit for bit (12 heads of 4,096
// random queries, C = 25: from the second round on, 0.5 to 16 of the 25 centroids move per round and 3-35%
// of the queries need the full scan; K-means 2.9 -> 2.2 ms on one thread, 0.40 -> 0.35 ms at 512).
constexpr uint64_t kNoKey = ~0ULL;  // above every key: no present centroid -> -1
constexpr int kScanVectors = 4;     // 32 queries per scan

// 32 queries h against the centroids list[0..count): best = min(best, key); own = the key of the lane's
// own centroid (the low word of its old best key, `old`), where that centroid is in the list. `Pop` counts
// the bits of each lane.
template <typename Pop>
__attribute__((always_inline)) inline void scan_body(const u64x8* __restrict h, const u64x8* __restrict old,
                                                     const uint64_t* __restrict cent, const int32_t* __restrict list,
                                                     int64_t count, u64x8* __restrict best, u64x8* __restrict own,
                                                     Pop pop) {
  u64x8 b[kScanVectors], o[kScanVectors], mine[kScanVectors];
  for (int v = 0; v < kScanVectors; ++v) {
    b[v] = best[v];
    o[v] = own[v];
    mine[v] = old[v] & 0xFFFFFFFFULL;
  }
  for (int64_t i = 0; i < count; ++i) {
    const uint64_t c = static_cast<uint64_t>(list[i]), centroid = cent[c];
    for (int v = 0; v < kScanVectors; ++v) {
      const u64x8 key = (pop(h[v] ^ centroid) << 32) | c;
      b[v] = select(key < b[v], key, b[v]);
      o[v] = select(mine[v] == c, key, o[v]);
    }
  }
  for (int v = 0; v < kScanVectors; ++v) {
    best[v] = b[v];
    own[v] = o[v];
  }
}

// What a block of 32 queries leaves to its caller: the lanes (bit j: query i0 + j) that changed cluster,
// with their previous clusters, and those whose own centroid moved away, which need every centroid.
struct BlockOut {
  uint32_t changed = 0, again = 0;
  int64_t previous[8 * kScanVectors] = {};
};

// One round's assignment of queries i0 .. i0 + len (len <= 32) against the centroids list[0..count); a
// `full` round starts from no key (the list is every present centroid), the others from each query's
// best key in `keys`. Writes their new keys and clusters, except for the lanes of out.again.
using BlockFn = void (*)(const uint64_t* hashes, const bool* valid, int64_t i0, int64_t len, uint64_t mask,
                         const uint64_t* cent, const int32_t* list, int64_t count, bool full, uint64_t* keys,
                         int64_t* assign, BlockOut& out);

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

struct PortablePopcount {
  __attribute__((always_inline)) u64x8 operator()(u64x8 x) const {
#if BC_NATIVE_BYTES == 32 && defined(__AVX2__)
    // AVX2 has no vector popcount: each byte's bits from a 16-entry table of nibbles (two byte shuffles),
    // summed per 64-bit lane by a sum of absolute differences; half the instructions of the shifts and
    // adds, the same counts.
    const __m256i table = _mm256_setr_epi8(0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4, 0, 1, 1, 2, 1, 2, 2, 3,
                                           1, 2, 2, 3, 2, 3, 3, 4);
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int k = 0; k < u64x8::kParts; ++k) {
      const __m256i v = reinterpret_cast<__m256i>(x.p[k]);
      const __m256i bytes = _mm256_add_epi8(_mm256_shuffle_epi8(table, _mm256_and_si256(v, low)),
                                            _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), low)));
      x.p[k] = reinterpret_cast<u64x8::Part>(_mm256_sad_epu8(bytes, _mm256_setzero_si256()));
    }
    return x;
#else
    return popcount8(x);
#endif
  }
};

// A scanned block's bookkeeping: each query's best key (best(j)) and cluster written, except for those
// whose own centroid's key (own(j)) grew past their previous best (old(j)), which need every centroid.
template <typename Best, typename Own, typename Old>
BC_INLINE void settle_block(const bool* valid, int64_t i0, int64_t len, bool full, Best best, Own own, Old old,
                            uint64_t* keys, int64_t* assign, BlockOut& out) {
  out.changed = out.again = 0;
  for (int64_t j = 0; j < len; ++j) {
    const int64_t i = i0 + j;
    const uint64_t key = best(j);
    out.previous[j] = assign[i];
    if (!full && own(j) > old(j)) {
      out.again |= 1u << j;
      continue;
    }
    const int64_t cluster = valid[i] && key != kNoKey ? static_cast<int64_t>(key & 0xFFFFFFFFULL) : -1;
    out.changed |= static_cast<uint32_t>(cluster != assign[i]) << j;
    assign[i] = cluster;
    keys[i] = key;
  }
}

void block_portable(const uint64_t* hashes, const bool* valid, int64_t i0, int64_t len, uint64_t mask,
                    const uint64_t* cent, const int32_t* list, int64_t count, bool full, uint64_t* keys,
                    int64_t* assign, BlockOut& out) {
  u64x8 h[kScanVectors] = {}, old[kScanVectors], best[kScanVectors], own[kScanVectors];
  for (int v = 0; v < kScanVectors; ++v) old[v] = h[v] * 0 + kNoKey;
  std::memcpy(h, hashes + i0, len * sizeof(uint64_t));
  if (!full) std::memcpy(old, keys + i0, len * sizeof(uint64_t));
  for (int v = 0; v < kScanVectors; ++v) {
    h[v] &= mask;
    best[v] = own[v] = old[v];
  }
  scan_body(h, old, cent, list, count, best, own, PortablePopcount{});
  settle_block(
      valid, i0, len, full, [&](int64_t j) { return best[j / 8][j % 8]; },
      [&](int64_t j) { return own[j / 8][j % 8]; }, [&](int64_t j) { return old[j / 8][j % 8]; }, keys, assign,
      out);
}

#if BC_NATIVE_BYTES == 32 && defined(__AVX2__)
#define BC_HAVE_NARROW_BLOCK 1
// Clusters that block_narrow takes: a key narrowed to 32 bits is distance << 24 | cluster.
constexpr int64_t kNarrowClusters = int64_t{1} << 24;
constexpr uint64_t kNarrowNone = 0xFFFFFFFFULL;  // kNoKey narrowed: above every narrow key

BC_INLINE uint64_t narrow_key(uint64_t key) {
  return key == kNoKey ? kNarrowNone : (key >> 32) << 24 | (key & 0xFFFFFFULL);
}
BC_INLINE uint64_t wide_key(uint64_t key) { return key == kNarrowNone ? kNoKey : (key >> 24) << 32 | (key & 0xFFFFFFULL); }

// block_portable with AVX2, for up to 2^24 clusters: the same keys, found with keys narrowed to the
// low 32 bits of each 64-bit lane, whose minimum is one instruction (AVX2 has no unsigned 64-bit compare:
// two sign flips, a compare and a blend), and 8 queries per pass over the centroids, whose state then
// stays in the 16 registers (32 queries at once kept it on the stack).
void block_narrow(const uint64_t* hashes, const bool* valid, int64_t i0, int64_t len, uint64_t mask,
                  const uint64_t* cent, const int32_t* list, int64_t count, bool full, uint64_t* keys, int64_t* assign,
                  BlockOut& out) {
  constexpr int kLanes = 8 * kScanVectors;
  alignas(32) uint64_t h[kLanes] = {}, old[kLanes], best[kLanes], own[kLanes];
  std::fill(old, old + kLanes, kNoKey);
  std::memcpy(h, hashes + i0, len * sizeof(uint64_t));
  if (!full) std::memcpy(old, keys + i0, len * sizeof(uint64_t));
  for (int j = 0; j < kLanes; ++j) best[j] = narrow_key(old[j]);
  const __m256i table = _mm256_setr_epi8(0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4, 0, 1, 1, 2, 1, 2, 2, 3, 1,
                                         2, 2, 3, 2, 3, 3, 4);
  const __m256i nibble = _mm256_set1_epi8(0x0F), zero = _mm256_setzero_si256();
  const __m256i bits = _mm256_set1_epi64x(static_cast<int64_t>(mask)), low = _mm256_set1_epi64x(0xFFFFFFFFLL);
  for (int64_t p = 0; p < len; p += 8) {
    __m256i x[2], b[2], o[2], mine[2];
    for (int v = 0; v < 2; ++v) {
      x[v] = _mm256_and_si256(_mm256_load_si256(reinterpret_cast<const __m256i*>(h + p + 4 * v)), bits);
      b[v] = o[v] = _mm256_load_si256(reinterpret_cast<const __m256i*>(best + p + 4 * v));
      mine[v] = _mm256_and_si256(_mm256_load_si256(reinterpret_cast<const __m256i*>(old + p + 4 * v)), low);
    }
    for (int64_t i = 0; i < count; ++i) {
      const int64_t c = list[i];
      const __m256i centroid = _mm256_set1_epi64x(static_cast<int64_t>(cent[c])), index = _mm256_set1_epi64x(c);
      for (int v = 0; v < 2; ++v) {
        const __m256i y = _mm256_xor_si256(x[v], centroid);
        const __m256i ones = _mm256_add_epi8(_mm256_shuffle_epi8(table, _mm256_and_si256(y, nibble)),
                                             _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(y, 4), nibble)));
        const __m256i key = _mm256_or_si256(_mm256_slli_epi64(_mm256_sad_epu8(ones, zero), 24), index);
        b[v] = _mm256_min_epu32(b[v], key);  // the high words are 0 on both sides
        o[v] = _mm256_blendv_epi8(o[v], key, _mm256_cmpeq_epi32(mine[v], index));
      }
    }
    for (int v = 0; v < 2; ++v) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(best + p + 4 * v), b[v]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(own + p + 4 * v), o[v]);
    }
  }
  settle_block(
      valid, i0, len, full, [&](int64_t j) { return wide_key(best[j]); }, [&](int64_t j) { return wide_key(own[j]); },
      [&](int64_t j) { return old[j]; }, keys, assign, out);
}
#endif

#if defined(BC_HAVE_AVX512) && defined(__GNUC__) && !defined(__clang__)
#define BC_HAVE_VPOPCNT 1
#if defined(__AVX512VPOPCNTDQ__)  // -march=native builds on such a CPU
#define BC_VPOPCNT_TARGET
#else  // x86-64-v4 lacks VPOPCNTQ (Ice Lake and Zen 4 have it, Skylake-X not): checked at run time
#define BC_VPOPCNT_TARGET __attribute__((target("avx512vpopcntdq")))
#endif
// block_portable with AVX-512: VPOPCNTQ, masked loads for a partial block, and the bookkeeping of 8
// queries in a few mask instructions instead of a loop (the intrinsics do not inline into scan_body, so
// the scan is written out here).
BC_VPOPCNT_TARGET
void block_vpopcnt(const uint64_t* hashes, const bool* valid, int64_t i0, int64_t len, uint64_t mask,
                   const uint64_t* cent, const int32_t* list, int64_t count, bool full, uint64_t* keys,
                   int64_t* assign, BlockOut& out) {
  const __m512i none = _mm512_set1_epi64(-1), low = _mm512_set1_epi64(0xFFFFFFFFLL);
  const __m512i bits = _mm512_set1_epi64(static_cast<int64_t>(mask));
  __m512i h[kScanVectors], old[kScanVectors], best[kScanVectors], own[kScanVectors], mine[kScanVectors];
  __mmask8 lanes[kScanVectors];
  for (int v = 0; v < kScanVectors; ++v) {
    const int64_t in = std::clamp<int64_t>(len - 8 * v, 0, 8);
    lanes[v] = static_cast<__mmask8>((1u << in) - 1u);
    h[v] = _mm512_and_si512(_mm512_maskz_loadu_epi64(lanes[v], hashes + i0 + 8 * v), bits);
    old[v] = full ? none : _mm512_mask_loadu_epi64(none, lanes[v], keys + i0 + 8 * v);
    best[v] = own[v] = old[v];
    mine[v] = _mm512_and_si512(old[v], low);
  }
  // Shift and min as vector arithmetic: the intrinsics start from an undefined register, which GCC 12
  // reports as maybe uninitialized.
#define BC_SCAN_CENTROIDS(TRACK_OWN)                                                                          \
  for (int64_t i = 0; i < count; ++i) {                                                                       \
    const int64_t c = list[i];                                                                                \
    const __m512i centroid = _mm512_set1_epi64(static_cast<int64_t>(cent[c])), index = _mm512_set1_epi64(c); \
    for (int v = 0; v < kScanVectors; ++v) {                                                                  \
      const u64x8 distance = (u64x8)_mm512_popcnt_epi64(_mm512_xor_si512(h[v], centroid));                    \
      const __m512i key = (__m512i)((distance << 32) | (u64x8)index);                                         \
      best[v] = (__m512i)((u64x8)key < (u64x8)best[v] ? (u64x8)key : (u64x8)best[v]);                         \
      if (TRACK_OWN) own[v] = _mm512_mask_mov_epi64(own[v], _mm512_cmpeq_epi64_mask(mine[v], index), key);    \
    }                                                                                                         \
  }
  // A full round settles every query whatever its own centroid's key, so its scan does not track that key:
  // two of seven instructions per vector (the compare and the masked move).
  if (full) {
    BC_SCAN_CENTROIDS(false)
  } else {
    BC_SCAN_CENTROIDS(true)
  }
#undef BC_SCAN_CENTROIDS
  out.changed = out.again = 0;
  for (int v = 0; v < kScanVectors; ++v) {
    const int64_t at = i0 + 8 * v;
    const __mmask8 again = full ? 0 : _mm512_mask_cmpgt_epu64_mask(lanes[v], own[v], old[v]);
    const __m128i flags = _mm_maskz_loadu_epi8(lanes[v], valid + at);
    const __mmask8 ok =
        static_cast<__mmask8>(_mm_test_epi8_mask(flags, flags)) & _mm512_cmpneq_epi64_mask(best[v], none);
    const __m512i cluster = _mm512_mask_mov_epi64(none, ok, _mm512_and_si512(best[v], low));
    const __m512i previous = _mm512_maskz_loadu_epi64(lanes[v], assign + at);
    const __mmask8 settle = lanes[v] & ~again;
    _mm512_mask_storeu_epi64(assign + at, settle, cluster);
    _mm512_mask_storeu_epi64(keys + at, settle, best[v]);
    _mm512_storeu_si512(out.previous + 8 * v, previous);
    out.changed |= static_cast<uint32_t>(_mm512_mask_cmpneq_epi64_mask(settle, cluster, previous)) << (8 * v);
    out.again |= static_cast<uint32_t>(again) << (8 * v);
  }
}
#endif

// The block function for this CPU and number of clusters.
BlockFn pick_block(int64_t clusters) {
#ifdef BC_HAVE_VPOPCNT
  static const bool vpopcnt = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vpopcntdq") != 0;
  }();
  if (vpopcnt) return block_vpopcnt;
#endif
#ifdef BC_HAVE_NARROW_BLOCK
  if (clusters <= kNarrowClusters) return block_narrow;
#endif
  (void)clusters;
  return block_portable;
}

// Per-cluster member counts and per-bit counts of ones (64 uint32 per cluster). Each hash is spread to 64
// bytes (byte b = bit b: one in-lane byte shuffle and a test), added to 8-bit counters of its cluster, and
// a cluster's 8-bit counters are flushed into the 32-bit ones before they can overflow (every 255 members).

#if BC_NATIVE_BYTES < 64
alignas(64) constexpr uint64_t kByteShifts[8] = {0, 8, 16, 24, 32, 40, 48, 56};
#endif

void count_bits(const uint64_t* __restrict hashes, const int64_t* __restrict assign, int64_t n, int64_t clusters,
                uint32_t* __restrict ones, int64_t* __restrict members, uint8_t* __restrict small,
                int32_t* __restrict pending) {
  alignas(64) static const uint8_t kBit[64] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128,
                                               1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128,
                                               1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128,
                                               1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
  const u8x64 bit = load_vec<u8x64>(kBit);
  auto flush = [&](int64_t c) {
    for (int q = 0; q < 4; ++q) {
      const u8x16 part = load_vec<u8x16>(small + c * 64 + 16 * q);
      u32x16 total = load_vec<u32x16>(ones + c * 64 + 16 * q);
      total += convert<u32x16>(part);
      store_vec(ones + c * 64 + 16 * q, total);
    }
    std::memset(small + c * 64, 0, 64);
    pending[c] = 0;
  };
  for (int64_t i = 0; i < n; ++i) {
    const int64_t c = assign[i];
    if (c < 0) continue;
    members[c] += 1;
    // byte b takes byte b / 8 of the hash
#if BC_NATIVE_BYTES == 64
    u64x8 h = {};
    h += hashes[i];
    u8x64 bytes = bitcast<u8x64>(h);  // all copies of the hash sit in every 16-byte lane: one in-lane shuffle
    bytes = __builtin_shufflevector(bytes, bytes, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 18, 18, 18, 18,
                                    18, 18, 18, 18, 19, 19, 19, 19, 19, 19, 19, 19, 36, 36, 36, 36, 36, 36, 36, 36,
                                    37, 37, 37, 37, 37, 37, 37, 37, 54, 54, 54, 54, 54, 54, 54, 54, 55, 55, 55, 55,
                                    55, 55, 55, 55);
#else
    const u64x8 shifts = load_vec<u64x8>(kByteShifts);
    const u8x64 bytes = bitcast<u8x64>(((u64x8{} + hashes[i]) >> shifts & 0xFFULL) * 0x0101010101010101ULL);
#endif
    u8x64 count = load_vec<u8x64>(small + c * 64);
    count -= bitcast<u8x64>((bytes & bit) != 0);
    store_vec(small + c * 64, count);
    if (++pending[c] == 255) flush(c);
  }
  for (int64_t c = 0; c < clusters; ++c)
    if (pending[c] > 0) flush(c);
}

// Moves query hash `h` from cluster `from` to cluster `to` in the bit counts (-1: none), as count_bits
// would count the new partition: the counts are integers, so updating those of the queries that moved
// gives exactly the recount (which after the first rounds touches a few queries instead of all).
void move_bits(uint64_t h, int64_t from, int64_t to, uint32_t* __restrict ones, int64_t* __restrict members) {
  u32x16 lane;
  for (int j = 0; j < 16; ++j) lane[j] = static_cast<uint32_t>(j);
  for (int w = 0; w < 4; ++w) {
    const u32x16 word = u32x16{} + static_cast<uint32_t>(h >> (16 * w));
    const u32x16 bits = (word >> lane) & 1u;
    if (from >= 0) {
      u32x16 total = load_vec<u32x16>(ones + from * 64 + 16 * w);
      total -= bits;
      store_vec(ones + from * 64 + 16 * w, total);
    }
    if (to >= 0) {
      u32x16 total = load_vec<u32x16>(ones + to * 64 + 16 * w);
      total += bits;
      store_vec(ones + to * 64 + 16 * w, total);
    }
  }
  if (from >= 0) members[from] -= 1;
  if (to >= 0) members[to] += 1;
}

// New centroid bits: 2 * ones > members -> 1, < -> 0, equal (a tie, or an empty cluster) -> the old bit.
// Returns how many centroids changed, listed in `moved`.
int64_t majority_update(const uint32_t* __restrict ones, const int64_t* __restrict members, int64_t clusters,
                        uint64_t mask, uint64_t* __restrict cent, int32_t* __restrict moved) {
  int64_t count = 0;
  for (int64_t c = 0; c < clusters; ++c) {
    const int32_t m = static_cast<int32_t>(members[c]);
    uint64_t above = 0, below = 0;
    for (int w = 0; w < 4; ++w) {
      const i32x16 twice = load_vec<i32x16>(ones + c * 64 + 16 * w) * 2;
      above |= static_cast<uint64_t>(lane_bits((i32x16)(twice > m))) << (16 * w);
      below |= static_cast<uint64_t>(lane_bits((i32x16)(twice < m))) << (16 * w);
    }
    const uint64_t updated = (above | (cent[c] & ~below)) & mask;
    moved[count] = static_cast<int32_t>(c);
    count += updated != cent[c];
    cent[c] = updated;
  }
  return count;
}

// One round's assignment. keys: each query's best key, updated in place. A full round (the first, or one
// after most centroids moved) scans the `present` centroids; the others scan the `moved` ones, and then
// every centroid for the queries whose own centroid moved away, gathered 32 at a time (a few percent of
// the queries: by vectors of 8 it would be a third of them). With `ones`, the bit counts follow every valid
// query that changed cluster (move_bits). pending: n slots.
void assign_round(BlockFn block, const uint64_t* __restrict hashes, const bool* __restrict valid, int64_t n,
                  uint64_t mask, const uint64_t* __restrict cent, const int32_t* present, int64_t present_count,
                  const int32_t* moved, int64_t moved_count, bool full, uint64_t* __restrict keys,
                  int64_t* __restrict assign, uint32_t* ones, int64_t* members, int64_t* __restrict pending) {
  constexpr int64_t kBlock = 8 * kScanVectors;
  BlockOut out;
  auto move = [&](int64_t i, int64_t from, int64_t to) { move_bits(hashes[i] & mask, from, to, ones, members); };
  int64_t waiting = 0;
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t len = std::min<int64_t>(kBlock, n - i0);
    block(hashes, valid, i0, len, mask, cent, full ? present : moved, full ? present_count : moved_count, full, keys,
          assign, out);
    for (uint32_t lanes = out.again; lanes != 0; lanes &= lanes - 1) pending[waiting++] = i0 + __builtin_ctz(lanes);
    if (ones == nullptr) continue;
    for (uint32_t lanes = out.changed; lanes != 0; lanes &= lanes - 1) {
      const int64_t i = i0 + __builtin_ctz(lanes);
      move(i, out.previous[i - i0], assign[i]);
    }
  }
  // The queries whose own centroid moved away, 32 at a time against every centroid.
  uint64_t h[kBlock], k[kBlock];
  int64_t a[kBlock];
  bool ok[kBlock];
  for (int64_t p0 = 0; p0 < waiting; p0 += kBlock) {
    const int64_t len = std::min<int64_t>(kBlock, waiting - p0);
    for (int64_t j = 0; j < len; ++j) {
      const int64_t i = pending[p0 + j];
      h[j] = hashes[i];
      ok[j] = valid[i];
      a[j] = assign[i];
    }
    block(h, ok, 0, len, mask, cent, present, present_count, true, k, a, out);
    for (int64_t j = 0; j < len; ++j) {
      const int64_t i = pending[p0 + j];
      if (ones != nullptr && (out.changed >> j & 1u)) move(i, assign[i], a[j]);
      assign[i] = a[j];
      keys[i] = k[j];
    }
  }
}

// kmeans_one's buffers, kept per thread: allocating and zero-filling eleven of them for every head was
// about 3% of a call at 128 tokens. Each is filled, cleared or written before it is read.
struct KmeansScratch {
  std::vector<uint64_t> seen, cent, keys;
  std::vector<int64_t> first, members, waiting;
  std::vector<int32_t> present, moved, pending;
  std::vector<uint32_t> ones;
  std::vector<uint8_t> small;
  KmeansScratch(int64_t n, int64_t clusters, int64_t capacity)
      : seen(capacity),
        cent(clusters),
        keys(n),
        members(clusters),
        waiting(n),
        moved(clusters),
        pending(clusters),
        ones(clusters * 64),
        small(clusters * 64) {
    first.reserve(n);
    present.reserve(clusters);
  }
};

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
  KmeansScratch& sc = thread_scratch<KmeansScratch>(n, clusters, static_cast<int64_t>(cap_mask + 1));
  std::vector<uint64_t>& seen = sc.seen;
  std::fill(seen.begin(), seen.end(), kFree);
  std::vector<int64_t>& first = sc.first;
  first.clear();
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

  std::vector<uint64_t>& cent = sc.cent;
  std::vector<int32_t>& present = sc.present;  // the present centroids
  std::vector<int32_t>& moved = sc.moved;      // those the last vote changed
  present.clear();
  for (int64_t s = 0; s < clusters; ++s) {
    const bool is_present = s < distinct || distinct > clusters;
    const int64_t pick = distinct > clusters ? (s * distinct) / clusters : s;
    if (is_present) present.push_back(static_cast<int32_t>(s));
    cent[s] = is_present ? hashes[first[pick]] : 0ULL;
  }
  const int64_t present_count = static_cast<int64_t>(present.size());

  const BlockFn block = pick_block(clusters);
  std::vector<uint32_t>& ones = sc.ones;
  std::vector<uint8_t>& small = sc.small;
  std::vector<int32_t>& pending = sc.pending;
  std::fill(small.begin(), small.end(), uint8_t{0});
  std::fill(pending.begin(), pending.end(), 0);
  std::vector<int64_t>& members = sc.members;
  std::vector<uint64_t>& keys = sc.keys;
  std::vector<int64_t>& waiting = sc.waiting;  // queries a round scans again
  int64_t moved_count = 0;
  auto round = [&](bool first) {
    // A round costs about moved_count scans of every query (each a little dearer than a full round's),
    // plus the full scans of the queries whose centroid moved away: past half the centroids, a full round.
    const bool full = first || 2 * moved_count > present_count;
    assign_round(block, hashes, valid, n, mask, cent.data(), present.data(), present_count, moved.data(), moved_count,
                 full, keys.data(), assign, first ? nullptr : ones.data(), members.data(), waiting.data());
  };
  bool settled = false;  // `assign` is already the assignment to the final centroids
  for (int64_t it = 0; it < iterations; ++it) {
    round(it == 0);
    if (it == 0) {
      std::fill(ones.begin(), ones.end(), 0u);
      std::fill(members.begin(), members.end(), 0);
      count_bits(hashes, assign, n, clusters, ones.data(), members.data(), small.data(), pending.data());
    }
    // Majority vote per bit; a tied vote (including an empty cluster: 0 == 0) keeps the old bit.
    moved_count = majority_update(ones.data(), members.data(), clusters, mask, cent.data(), moved.data());
    // A fixed point: the remaining rounds would reassign and re-vote to exactly the same values, and the
    // final assignment would repeat this round's.
    if (moved_count == 0) {
      settled = true;
      break;
    }
  }
  if (!settled) round(iterations == 0);
  for (int64_t c = 0; c < clusters; ++c) centroids[c] = static_cast<int64_t>(cent[c]);
}

}  // namespace

PaddedPlanes padded_planes(const at::Tensor& planes, const at::Tensor& offsets, int64_t dk) {
  const int64_t bits = planes.size(0);
  const at::Tensor p = planes.contiguous(), o = offsets.contiguous();
  const InputType type = input_type(p);
  PaddedPlanes out{Floats(std::max<int64_t>(dk, 1) * 64, 0.f), Floats(64, 0.f)};
  Floats row(std::max<int64_t>(dk, 1));
  const char* src = static_cast<const char*>(p.data_ptr());
  for (int64_t b = 0; b < bits; ++b) {
    widen_row(type, src + b * dk * p.element_size(), row.data(), dk);
    for (int64_t d = 0; d < dk; ++d) out.planes_t[d * 64 + b] = row[d];
  }
  widen_row(input_type(o), o.data_ptr(), out.offsets.data(), bits);
  return out;
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
  const PaddedPlanes padded = padded_planes(planes, offsets, dk);
  at::Tensor out = empty_tensor(queries.sizes().slice(0, 3), queries.options().dtype(at::kLong));
  const int64_t count = out.numel();
  if (count == 0) return out;
  HashJob job{Rows::of(q), input_type(q), padded.planes_t.data(), padded.offsets.data(), queries.size(1),
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
  at::Tensor assignments = empty_tensor({rows, heads, n}, h.options());
  at::Tensor centroids = empty_tensor({rows, heads, clusters}, h.options());
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

}  // namespace bert_cluster
