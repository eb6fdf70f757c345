// The kernels of lanes.h (see there); one entry point per kernel, templates inside.
#include "lanes.h"

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "vec.h"

#ifdef BC_HAVE_AVX512
#include <immintrin.h>
#endif

namespace bert_cluster {
namespace {


// Scores of KB keys (rows of `k`, `kstride` floats apart) against LV * 16 lanes (qt: dk x kLaneCount,
// lane-major): s[i][lane] = scaling * sum_d k[i][d] * qt[d][lane].
template <int LV, int KB>
BC_INLINE void score_keys(const float* __restrict qt, const float* __restrict k, int64_t kstride, int64_t dk,
                          float scaling, float* __restrict s) {
  f32x16 acc[KB][LV];
  for (int i = 0; i < KB; ++i)
    for (int v = 0; v < LV; ++v) acc[i][v] = f32x16{};
  for (int64_t d = 0; d < dk; ++d) {
    f32x16 q[LV];
    for (int v = 0; v < LV; ++v) q[v] = load16(qt + d * kLaneCount + 16 * v);
    for (int i = 0; i < KB; ++i) {
      const float x = k[i * kstride + d];
      for (int v = 0; v < LV; ++v) acc[i][v] += x * q[v];
    }
  }
  for (int i = 0; i < KB; ++i)
    for (int v = 0; v < LV; ++v) store16(s + i * kLaneCount + 16 * v, acc[i][v] * scaling);
}

// Start fetching rows [t, t + count) of the prefetch's keys and values.
BC_INLINE void prefetch_rows(const TilePrefetch& pf, int64_t t, int64_t count) {
  for (int64_t i = t; i < t + count; ++i) {
    const char* key = pf.keys + i * pf.key_step;
    const char* value = pf.values + i * pf.value_step;
    for (int64_t b = 0; b < pf.key_bytes; b += 64) __builtin_prefetch(key + b);
    for (int64_t b = 0; b < pf.value_bytes; b += 64) __builtin_prefetch(value + b);
  }
}

template <int LV>
BC_INLINE void score_rows(const float* __restrict qt, const float* __restrict k, int64_t kstride, int64_t rows,
                          int64_t dk, float scaling, float* __restrict s, const TilePrefetch* prefetch) {
  // Keys per pass, so that the KB x LV accumulators stay in registers (32 with AVX-512; 16 with AVX2, where
  // each takes 2).
  constexpr int KB = kNativeBytes == 64 ? (LV == 1 ? 8 : 6) : (LV == 1 ? 4 : 2);
  int64_t t = 0;
  for (; t + KB <= rows; t += KB) {
    // A few rows' prefetches per block, between its multiply-adds: issued 256 at a time (every 32 keys),
    // they waited for free miss buffers, and their stalls were 13% of centroid attention at 4,096 tokens.
    if (prefetch != nullptr) prefetch_rows(*prefetch, t, KB);
    score_keys<LV, KB>(qt, k + t * kstride, kstride, dk, scaling, s + t * kLaneCount);
  }
  if (prefetch != nullptr && t < rows) prefetch_rows(*prefetch, t, rows - t);
  for (; t < rows; ++t) score_keys<LV, 1>(qt, k + t * kstride, kstride, dk, scaling, s + t * kLaneCount);
}

// acc[c][0..16 NV) += sum_t p[t][c] * v[t][0..16 NV) for CB lanes c (p rows kLaneCount apart, v rows
// vstride floats apart, acc rows astride floats apart).
template <int CB, int NV>
BC_INLINE void accumulate_lanes(const float* __restrict p, const float* __restrict v, int64_t vstride, int64_t rows,
                                float* __restrict acc, int64_t astride) {
  f32x16 a[CB][NV];
  for (int c = 0; c < CB; ++c)
    for (int n = 0; n < NV; ++n) a[c][n] = load16(acc + c * astride + 16 * n);
  for (int64_t t = 0; t < rows; ++t) {
    f32x16 x[NV];
    for (int n = 0; n < NV; ++n) x[n] = load16(v + t * vstride + 16 * n);
    for (int c = 0; c < CB; ++c) {
      const float w = p[t * kLaneCount + c];
      for (int n = 0; n < NV; ++n) a[c][n] += w * x[n];
    }
  }
  for (int c = 0; c < CB; ++c)
    for (int n = 0; n < NV; ++n) store16(acc + c * astride + 16 * n, a[c][n]);
}

template <int CB>
BC_INLINE void accumulate_chunks(const float* __restrict p, const float* __restrict v, int64_t vstride, int64_t rows,
                                 float* __restrict acc, int64_t astride, int64_t dvp) {
  constexpr int NV = kNativeBytes == 64 ? 4 : 2;  // 16-float chunks per pass (CB x NV accumulators)
  int64_t d = 0;
  for (; d + 16 * NV <= dvp; d += 16 * NV) accumulate_lanes<CB, NV>(p, v + d, vstride, rows, acc + d, astride);
  switch ((dvp - d) / 16) {
    case 3: accumulate_lanes<CB, 3>(p, v + d, vstride, rows, acc + d, astride); break;
    case 2: accumulate_lanes<CB, 2>(p, v + d, vstride, rows, acc + d, astride); break;
    case 1: accumulate_lanes<CB, 1>(p, v + d, vstride, rows, acc + d, astride); break;
    default: break;
  }
}

// Every lane in [0, lanes): acc rows grow by p^T v, five lanes per pass over the tile's values (two below
// AVX-512, whose 16 registers hold fewer accumulators). Each sum runs over the tile's rows in order, however
// the lanes and chunks are blocked.
BC_INLINE void accumulate_block(const float* __restrict p, const float* __restrict v, int64_t vstride, int64_t rows,
                                 int64_t lanes, float* __restrict acc, int64_t dvp) {
  constexpr int CB = kNativeBytes == 64 ? 5 : 2;
  int64_t c = 0;
  for (; c + CB <= lanes; c += CB) accumulate_chunks<CB>(p + c, v, vstride, rows, acc + c * dvp, dvp, dvp);
  switch (lanes - c) {
    case 4: accumulate_chunks<4>(p + c, v, vstride, rows, acc + c * dvp, dvp, dvp); break;
    case 3: accumulate_chunks<3>(p + c, v, vstride, rows, acc + c * dvp, dvp, dvp); break;
    case 2: accumulate_chunks<2>(p + c, v, vstride, rows, acc + c * dvp, dvp, dvp); break;
    case 1: accumulate_chunks<1>(p + c, v, vstride, rows, acc + c * dvp, dvp, dvp); break;
    default: break;
  }
}

// Value rows per block: every lane pass over a block finds its rows (and the block's weights) in L1. A
// whole 256-row tile of 64-dim values is 64 KiB, past a 32-48 KiB L1, and each of its 5 (AVX-512) or 13
// (AVX2) lane passes at C = 25 read it again from L2. Each accumulator still sums the rows in order, so
// the blocks do not change the bits. centroid_attention, 12 heads x 64, C = 25, k = 32, one thread, AVX2
// (Zen 3): 1.15 -> 1.00 ms at 512 tokens, 7.66 -> 6.42 at 4,096 (16 and 64 rows: within 2% of 32).
constexpr int64_t kValueBlock = 32;

BC_INLINE void accumulate_all(const float* __restrict p, const float* __restrict v, int64_t vstride, int64_t rows,
                               int64_t lanes, float* __restrict acc, int64_t dvp) {
  for (int64_t t0 = 0; t0 < rows; t0 += kValueBlock)
    accumulate_block(p + t0 * kLaneCount, v + t0 * vstride, vstride, std::min(kValueBlock, rows - t0), lanes, acc,
                     dvp);
}

// Online softmax step for one tile: s (rows x 32 scores, -inf where masked) becomes p = e^(s - M); the
// running max M, sum Z and accumulated rows acc (lanes x dvp) are rescaled when M grows.
template <int LV>
BC_INLINE void softmax_lanes(float* __restrict s, int64_t rows, int64_t lanes, float* __restrict m, float* __restrict z,
                            float* __restrict acc, int64_t dvp) {
  f32x16 mx[LV];
  for (int v = 0; v < LV; ++v) mx[v] = f32x16{} + kNegInf;
  for (int64_t t = 0; t < rows; ++t)
    for (int v = 0; v < LV; ++v) {
      const f32x16 x = load16(s + t * kLaneCount + 16 * v);
      mx[v] = select(x > mx[v], x, mx[v]);
    }
  f32x16 mv[LV];
  for (int v = 0; v < LV; ++v) {
    for (int j = 0; j < 16; ++j) {
      const int c = 16 * v + j;
      const float updated = std::max(m[c], mx[v][j]);
      if (c < lanes && updated > m[c]) {  // a larger max: rescale what was accumulated so far
        const float alpha = m[c] == kNegInf ? 0.f : fast_exp(m[c] - updated);
        z[c] *= alpha;
        for (int64_t d = 0; d < dvp; ++d) acc[c * dvp + d] *= alpha;
        m[c] = updated;
      }
      mv[v][j] = m[c];
    }
  }
  f32x16 sum[LV];
  for (int v = 0; v < LV; ++v) sum[v] = f32x16{};
  const f32x16 neg_inf = f32x16{} + kNegInf;
  for (int64_t t = 0; t < rows; ++t)
    for (int v = 0; v < LV; ++v) {
      float* p = s + t * kLaneCount + 16 * v;
      const f32x16 x = load16(p);
      const f32x16 e = select(x == neg_inf, f32x16{}, fast_exp16(x - mv[v]));
      sum[v] += e;
      store16(p, e);
    }
  for (int v = 0; v < LV; ++v)
    for (int j = 0; j < 16; ++j) z[16 * v + j] += sum[v][j];
}

// Distinct composite keys ranked by counting (branch-free, 8 keys per compare, n * n / 8 compares): the `keep`
// largest of x[0..n), descending, into out[0..keep).
constexpr int64_t kRankMax = 256;

BC_INLINE void rank_largest(const uint64_t* __restrict x, int64_t n, int64_t keep, uint64_t* __restrict out) {
  constexpr int kBlocks = 4;  // 32 keys ranked per pass over x
  for (int64_t b0 = 0; b0 < n; b0 += 8 * kBlocks) {
    u64x8 v[kBlocks];
    i64x8 above[kBlocks];
    for (int b = 0; b < kBlocks; ++b) {
      const int64_t first = b0 + 8 * b;
      v[b] = u64x8{};  // padding keys are 0: below every real key (whose low word is ~index >= 1)
      if (first < n) std::memcpy(&v[b], x + first, std::min<int64_t>(8, n - first) * sizeof(uint64_t));
      above[b] = i64x8{};
    }
    for (int64_t i = 0; i < n; ++i) {
      const u64x8 key = u64x8{} + x[i];
      for (int b = 0; b < kBlocks; ++b) above[b] -= (key > v[b]);
    }
    for (int b = 0; b < kBlocks; ++b)
      for (int j = 0; j < 8; ++j) {
        const int64_t i = b0 + 8 * b + j, rank = above[b][j];
        if (i < n && rank < keep) out[rank] = x[i];
      }
  }
}

#ifdef BC_HAVE_AVX512
// A bitonic sorting network over 32 keys in four registers (key i: lane i % 8 of register i / 8), which
// sorts descending with 12 in-register and 3 cross-register compare-exchange stages, instead of ranking
// the keys by counting (n * n / 8 compares): a whole call at 128 tokens, one thread, 0.730 -> 0.695 ms.
constexpr int kNetworkKeys = 32;

// Lanes that keep the larger key of their pair in a stage (pairs i, i ^ j; blocks of kk sorted descending
// where i & kk is 0, ascending elsewhere), for register r.
constexpr __mmask8 larger_lanes(int kk, int j, int r) {
  int mask = 0;
  for (int lane = 0; lane < 8; ++lane) {
    const bool lower = (lane & j) == 0, descending = ((8 * r + lane) & kk) == 0;
    if (lower == descending) mask |= 1 << lane;
  }
  return static_cast<__mmask8>(mask);
}

// (The zero-masked forms, for GCC 12: see widen_half.)
BC_INLINE __m512i max_keys(__m512i a, __m512i b) { return _mm512_maskz_max_epu64(0xFF, a, b); }
BC_INLINE __m512i min_keys(__m512i a, __m512i b) { return _mm512_maskz_min_epu64(0xFF, a, b); }

template <int J>
BC_INLINE __m512i pair_lanes(__m512i v) {  // lane i gets lane i ^ J
  if constexpr (J == 1) return _mm512_maskz_shuffle_epi32(0xFFFF, v, static_cast<_MM_PERM_ENUM>(0x4E));
  if constexpr (J == 2) return _mm512_maskz_permutex_epi64(0xFF, v, 0x4E);
  return _mm512_maskz_shuffle_i64x2(0xFF, v, v, 0x4E);
}

template <int KK, int J>
BC_INLINE void network_stage(__m512i (&v)[4]) {
  if constexpr (J >= 8) {
    for (int r = 0; r < 4; ++r) {
      if (r & (J / 8)) continue;
      const int s = r | (J / 8);
      const __m512i larger = max_keys(v[r], v[s]), smaller = min_keys(v[r], v[s]);
      const bool descending = ((8 * r) & KK) == 0;
      v[r] = descending ? larger : smaller;
      v[s] = descending ? smaller : larger;
    }
  } else {
    for (int r = 0; r < 4; ++r) {
      const __m512i other = pair_lanes<J>(v[r]);
      v[r] = _mm512_mask_blend_epi64(larger_lanes(KK, J, r), min_keys(v[r], other), max_keys(v[r], other));
    }
  }
}

template <int KK, int J>
BC_INLINE void network_merge(__m512i (&v)[4]) {
  network_stage<KK, J>(v);
  if constexpr (J > 1) network_merge<KK, J / 2>(v);
}

template <int KK>
BC_INLINE void network_sort(__m512i (&v)[4]) {
  if constexpr (KK > 2) network_sort<KK / 2>(v);
  network_merge<KK, KK / 2>(v);
}

// x[0..n) (n <= 32) sorted descending in place; padding keys are 0, below every real key.
BC_INLINE void network_sort_descending(uint64_t* __restrict x, int64_t n) {
  __m512i v[4];
  __mmask8 mask[4];
  for (int r = 0; r < 4; ++r) {
    const int64_t lanes = std::clamp<int64_t>(n - 8 * r, 0, 8);
    mask[r] = static_cast<__mmask8>((1u << lanes) - 1);
    v[r] = _mm512_maskz_loadu_epi64(mask[r], x + 8 * r);
  }
  network_sort<kNetworkKeys>(v);
  for (int r = 0; r < 4; ++r) _mm512_mask_storeu_epi64(x + 8 * r, mask[r], v[r]);
}
#endif

// Sort n distinct composite keys descending: with AVX-512 up to 32 keys by a sorting network, by rank
// counting up to kRankMax keys (tmp: n slots), else std::sort.
BC_INLINE void sort_descending(uint64_t* __restrict x, int64_t n, uint64_t* __restrict tmp) {
  if (n <= 1) return;
#ifdef BC_HAVE_AVX512
  if (n <= kNetworkKeys) return network_sort_descending(x, n);
#endif
  if (n > kRankMax) {
    std::sort(x, x + n, [](uint64_t a, uint64_t b) { return a > b; });
    return;
  }
  rank_largest(x, n, n, tmp);
  std::memcpy(x, tmp, n * sizeof(uint64_t));
}

// One quickselect round: the keys of w[0..m) other than the pivot w[p] into o[0..m), those above it at the
// front and the others at the back, leaving o[lo] free; returns lo. (The order within each side is not
// kept: the caller needs only the sets.)
BC_INLINE int64_t partition_above(const uint64_t* __restrict w, int64_t m, int64_t p, uint64_t* __restrict o) {
  const uint64_t pivot = w[p];
  int64_t lo = 0, hi = m - 1;
#ifdef BC_HAVE_AVX512
  // 8 keys per step, each side appended by one compress and a masked store (the scalar loop below takes
  // about a dozen instructions per key, and was about 40% of the top-k's appends and selection at 128
  // keys, by `perf`).
  const __m512i pv = _mm512_set1_epi64(static_cast<int64_t>(pivot));
  for (int64_t i = 0; i < m; i += 8) {
    __mmask8 valid = i + 8 <= m ? static_cast<__mmask8>(0xFF) : static_cast<__mmask8>((1u << (m - i)) - 1);
    if (p >= i && p < i + 8) valid = static_cast<__mmask8>(valid & ~(1u << (p - i)));
    const __m512i keys = _mm512_maskz_loadu_epi64(valid, w + i);
    const __mmask8 above = _mm512_mask_cmpgt_epu64_mask(valid, keys, pv);
    const __mmask8 below = static_cast<__mmask8>(valid & ~above);
    const int na = __builtin_popcount(above), nb = __builtin_popcount(below);
    _mm512_mask_storeu_epi64(o + lo, static_cast<__mmask8>((1u << na) - 1), _mm512_maskz_compress_epi64(above, keys));
    _mm512_mask_storeu_epi64(o + hi - nb + 1, static_cast<__mmask8>((1u << nb) - 1),
                             _mm512_maskz_compress_epi64(below, keys));
    lo += na;
    hi -= nb;
  }
#else
  auto place = [&](uint64_t key) {
    const int64_t above = key > pivot;
    o[lo] = key;
    o[hi] = key;
    lo += above;
    hi -= 1 - above;
  };
  for (int64_t i = 0; i < p; ++i) place(w[i]);
  for (int64_t i = p + 1; i < m; ++i) place(w[i]);
#endif
  return lo;  // == hi
}

// The k largest of x[0..n) (distinct keys, 1 <= k <= n) into x[0..k), unordered; returns the k-th largest.
// tmp: n slots. A quickselect whose partition has no data-dependent branch (std::nth_element mispredicts
// about every other key on scores, which dominated the top-k): each round moves the keys above a
// median-of-3 pivot to the front of the other buffer and the rest to its back, leaving the pivot's slot
// between them. Keys known to be among the k largest stay at x[0..done). Small sets are finished by rank
// counting; a run of bad pivots falls back to std::nth_element.
BC_INLINE uint64_t keep_largest(uint64_t* __restrict x, int64_t n, int64_t k, uint64_t* __restrict tmp) {
  constexpr int64_t kSmall = 16;
  uint64_t* src = x;  // the keys still undecided: src[done .. done + m)
  uint64_t* dst = tmp;
  int64_t done = 0, m = n, need = k;
  for (int round = 0; m > kSmall; ++round) {
    uint64_t* w = src + done;
    if (round > 64) {  // never on real data; keeps the worst case O(n log n)
      if (src != x) std::memcpy(x + done, w, m * sizeof(uint64_t));
      w = x + done;
      std::nth_element(w, w + (need - 1), w + m, [](uint64_t a, uint64_t b) { return a > b; });
      return w[need - 1];
    }
    const uint64_t a = w[m / 4], b = w[m / 2], c = w[3 * m / 4];
    const int64_t p = (a < b) == (b < c) ? m / 2 : ((b < a) == (a < c) ? m / 4 : 3 * m / 4);
    const uint64_t pivot = w[p];
    uint64_t* o = dst + done;
    const int64_t lo = partition_above(w, m, p, o);
    o[lo] = pivot;  // the one slot left between the two sides
    std::swap(src, dst);
    if (lo >= need) {  // the k-th is above the pivot
      m = lo;
      continue;
    }
    if (src != x) std::memcpy(x + done, o, (lo + 1) * sizeof(uint64_t));  // the keys above, and the pivot
    done += lo + 1;
    need -= lo + 1;
    if (need == 0) return pivot;
    m -= lo + 1;
  }
#ifdef BC_HAVE_AVX512
  static_assert(kSmall <= kNetworkKeys);
  uint64_t best[kNetworkKeys];  // the network addresses (masked) all 32 slots
  std::memcpy(best, src + done, m * sizeof(uint64_t));
  network_sort_descending(best, m);
#else
  uint64_t best[kSmall];
  rank_largest(src + done, m, need, best);
#endif
  std::memcpy(x + done, best, need * sizeof(uint64_t));
  return best[need - 1];
}

// Per lane: the number of scores above thr[lane].
template <int LV>
BC_INLINE void count_above(const float* __restrict s, int64_t rows, const float* __restrict thr,
                           int64_t* __restrict count) {
  f32x16 g[LV];
  i32x16 n[LV];
  for (int v = 0; v < LV; ++v) {
    g[v] = load16(thr + 16 * v);
    n[v] = i32x16{};
  }
  for (int64_t t = 0; t < rows; ++t)
    for (int v = 0; v < LV; ++v) n[v] -= (load16(s + t * kLaneCount + 16 * v) > g[v]);
  for (int v = 0; v < LV; ++v)
    for (int j = 0; j < 16; ++j) count[16 * v + j] = n[v][j];
}

// Per lane, a score that k distinct keys of the tile reach (so that a key below it is not among the k best),
// used on a task's first tile, which would otherwise put every key into the buffers. The rows split into
// G = ceil(k / 4) groups; each group's 4 largest scores are kept by an insertion network (7 max/min per row),
// and the bound is the smallest of the groups' 4th largest: every group holds 4 distinct keys at or above
// it, so 4G >= k keys do. (For independent scores the smallest of k groups' maxima, the bound before,
// admits about 38% of a 256-key tile at k = 32, this one about 17%, by their order statistics.)
template <int LV>
BC_INLINE void kth_lower_bound(const float* __restrict s, int64_t rows, int64_t k, float* __restrict bound) {
  constexpr int kTop = 4;
  const int64_t groups = (k + kTop - 1) / kTop;
  const int64_t g = rows / groups;  // >= 8: called with rows >= 2k
  f32x16 low[LV];
  for (int v = 0; v < LV; ++v) low[v] = f32x16{} - kNegInf;
  for (int64_t group = 0; group < groups; ++group) {
    f32x16 top[LV][kTop];
    for (int v = 0; v < LV; ++v)
      for (int j = 0; j < kTop; ++j) top[v][j] = f32x16{} + kNegInf;
    for (int64_t t = group * g; t < (group + 1) * g; ++t)
      for (int v = 0; v < LV; ++v) {
        f32x16 x = load16(s + t * kLaneCount + 16 * v);
        for (int j = 0; j < kTop - 1; ++j) {
          const f32x16 larger = select(x > top[v][j], x, top[v][j]);
          x = select(x > top[v][j], top[v][j], x);
          top[v][j] = larger;
        }
        top[v][kTop - 1] = select(x > top[v][kTop - 1], x, top[v][kTop - 1]);
      }
    for (int v = 0; v < LV; ++v) low[v] = select(top[v][kTop - 1] < low[v], top[v][kTop - 1], low[v]);
  }
  for (int v = 0; v < LV; ++v) store16(bound + 16 * v, low[v]);
}

// The thresholds a tile's keys must beat, per lane (thr; unused lanes: none enters). A task's first tile
// of at least 2k rows gets its own lower bound (kth_lower_bound). Returns whether this is the first tile.
template <int LV>
BC_INLINE bool topk_thresholds(LaneTopK& top, const float* __restrict s, int64_t rows, float* __restrict thr) {
  for (int c = 0; c < kLaneCount; ++c) thr[c] = c < top.lanes ? top.thr[c] : -kNegInf;
  const bool first_tile = !top.started;
  top.started = true;
  if (first_tile && rows >= 2 * top.k) {
    float bound[kLaneCount];
    kth_lower_bound<LV>(s, rows, top.k, bound);
    for (int c = 0; c < top.lanes; ++c) thr[c] = std::nextafter(bound[c], kNegInf);  // x > thr: x >= bound
  }
  return first_tile;
}

// The k best of lane c's buffer, and its threshold raised to the k-th best's score.
BC_INLINE void topk_compact(LaneTopK& top, int64_t c) {
  top.thr[c] = LaneTopK::score_of(keep_largest(top.list(c), top.count[c], top.k, top.sort_tmp.data()));
  top.count[c] = top.k;
}

// After the first tile: a threshold for the next tiles at once.
BC_INLINE void topk_first_compact(LaneTopK& top) {
  for (int c = 0; c < top.lanes; ++c)
    if (top.count[c] > top.k) topk_compact(top, c);
}

template <int LV>
BC_INLINE void topk_lanes(LaneTopK& top, const float* __restrict s, int64_t rows, int64_t j0) {
  const int64_t lanes = top.lanes;
  float thr[kLaneCount];
  const bool first_tile = topk_thresholds<LV>(top, s, rows, thr);
  int64_t cnt[kLaneCount];
  count_above<LV>(s, rows, thr, cnt);
  bool any = false;
  for (int c = 0; c < lanes; ++c) {
    if (cnt[c] == 0) continue;
    any = true;
    if (top.count[c] + cnt[c] > top.capacity) {  // only when count > k, since cnt <= rows = capacity - k
      topk_compact(top, c);
      thr[c] = top.thr[c];
    }
  }
  if (!any) return;
  f32x16 g[LV];
  for (int v = 0; v < LV; ++v) g[v] = load16(thr + 16 * v);
  for (int64_t t = 0; t < rows; ++t) {
    const float* row = s + t * kLaneCount;
    uint32_t bits = LV == 1 ? lane_bits((i32x16)(load16(row) > g[0]))
                            : lane_bits2((i32x16)(load16(row) > g[0]), (i32x16)(load16(row + 16) > g[LV - 1]));
    while (bits) {
      const int c = __builtin_ctz(bits);
      bits &= bits - 1;
      // Fits by the counts above (a raised threshold only takes fewer); the bound guards a miscount.
      if (top.count[c] < top.capacity)
        top.list(c)[top.count[c]++] = LaneTopK::composite(s[t * kLaneCount + c], j0 + t);
    }
  }
  if (first_tile) topk_first_compact(top);
}

#ifdef BC_HAVE_AVX512
// 32-bit lanes 8 h .. 8 h + 7 of x, zero-extended to 64 bits. (The zero-masked forms: the plain ones start
// from an undefined register, which GCC 12 reports as maybe uninitialized.)
BC_INLINE __m512i widen_half(__m512i x, int h) {
  const __m256i part =
      h == 0 ? _mm512_maskz_extracti64x4_epi64(0xF, x, 0) : _mm512_maskz_extracti64x4_epi64(0xF, x, 1);
  return _mm512_maskz_cvtepu32_epi64(0xFF, part);
}

// topk_lanes with AVX-512: the tile is transposed 16 keys x 16 lanes at a time, and each lane's keys above
// its threshold are built as composites and appended 8 per compress instruction (the portable loop appends
// one key per step, after a branch on every row that mispredicts). A lane whose buffer would overflow is
// compacted first. The buffers end up holding other keys than topk_lanes' in between, but every key that
// leaves one is known to be outside the k best, so the k best are the same.
template <int LV>
void topk_lanes_compress(LaneTopK& top, const float* __restrict s, int64_t rows, int64_t j0) {
  const int64_t lanes = top.lanes;
  float thr[kLaneCount];
  const bool first_tile = topk_thresholds<LV>(top, s, rows, thr);
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i sign = _mm512_set1_epi32(static_cast<int32_t>(0x80000000u));
  for (int64_t t0 = 0; t0 < rows; t0 += 16) {
    const int64_t len = std::min<int64_t>(16, rows - t0);
    // The low words of keys t0 .. t0 + 15: ~index (LaneTopK::composite)
    const __m512i low = _mm512_sub_epi32(_mm512_set1_epi32(static_cast<int32_t>(0xFFFFFFFFu - (j0 + t0))), iota);
    const __m512i low_a = widen_half(low, 0), low_b = widen_half(low, 1);
    for (int v = 0; v < LV; ++v) {
      f32x16 column[16];  // after the transpose: column[j] = lane 16 v + j's scores of the 16 keys
      for (int64_t i = 0; i < 16; ++i)
        column[i] = i < len ? load16(s + (t0 + i) * kLaneCount + 16 * v) : f32x16{} + kNegInf;
      transpose16(column);
      for (int j = 0; j < 16 && 16 * v + j < lanes; ++j) {
        const int64_t c = 16 * v + j;
        const __m512 x = (__m512)column[j];
        __mmask16 above = _mm512_cmp_ps_mask(x, _mm512_set1_ps(thr[c]), _CMP_GT_OQ);
        if (above == 0) continue;
        if (top.count[c] + __builtin_popcount(above) > top.capacity) {
          topk_compact(top, c);
          thr[c] = top.thr[c];
          above = _mm512_cmp_ps_mask(x, _mm512_set1_ps(thr[c]), _CMP_GT_OQ);
          if (above == 0) continue;
        }
        // high words: the order key of the score (-0 as +0), sign bit flipped
        const __m512i high = _mm512_xor_si512((__m512i)order_key16(column[j] + 0.0f), sign);
        const __m512i key_a = _mm512_or_si512(_mm512_maskz_slli_epi64(0xFF, widen_half(high, 0), 32), low_a);
        const __m512i key_b = _mm512_or_si512(_mm512_maskz_slli_epi64(0xFF, widen_half(high, 1), 32), low_b);
        uint64_t* dst = top.list(c) + top.count[c];  // 16 free slots past the list: stride = capacity + 16
        const __mmask8 first = static_cast<__mmask8>(above), second = static_cast<__mmask8>(above >> 8);
        _mm512_storeu_si512(dst, _mm512_maskz_compress_epi64(first, key_a));
        _mm512_storeu_si512(dst + __builtin_popcount(first), _mm512_maskz_compress_epi64(second, key_b));
        top.count[c] += __builtin_popcount(above);
      }
    }
  }
  if (first_tile) topk_first_compact(top);
}
#endif

template <int LV>
BC_INLINE void mask_lanes(float* __restrict s, int64_t rows, const int32_t* __restrict first,
                          const int32_t* __restrict last) {
  const f32x16 neg_inf = f32x16{} + kNegInf;
  for (int64_t t = 0; t < rows; ++t)
    for (int v = 0; v < LV; ++v) {
      float* p = s + t * kLaneCount + 16 * v;
      const i32x16 keep = first_lanes(last[t] + 1 - 16 * v) & ~first_lanes(first[t] - 16 * v);
      store16(p, select(keep, load16(p), neg_inf));
    }
}

template <typename T>
BC_INLINE void widen_rows(const Rows& src, int64_t r, int64_t h, int64_t j0, int64_t rows, int64_t d, int64_t width,
                          float* buf) {
  for (int64_t t = 0; t < rows; ++t) {
    widen(src.at<T>(r, h, j0 + t), buf + t * width, d);
    std::fill(buf + t * width + d, buf + (t + 1) * width, 0.f);
  }
}

}  // namespace

void widen_row(InputType type, const void* src, float* dst, int64_t n) {
  switch (type) {
    case InputType::kFloat32: std::memcpy(dst, src, n * sizeof(float)); break;
    case InputType::kBFloat16: widen(static_cast<const c10::BFloat16*>(src), dst, n); break;
    case InputType::kFloat16: widen(static_cast<const c10::Half*>(src), dst, n); break;
  }
}

const float* float_rows(const Rows& src, InputType type, int64_t r, int64_t h, int64_t j0, int64_t rows, int64_t d,
                        int64_t width, bool in_place_ok, float* buf, int64_t* stride) {
  *stride = width;
  switch (type) {
    case InputType::kFloat32:
      if (in_place_ok) {
        *stride = src.s2;
        return src.at<float>(r, h, j0);
      }
      widen_rows<float>(src, r, h, j0, rows, d, width, buf);
      break;
    case InputType::kBFloat16: widen_rows<c10::BFloat16>(src, r, h, j0, rows, d, width, buf); break;
    case InputType::kFloat16: widen_rows<c10::Half>(src, r, h, j0, rows, d, width, buf); break;
  }
  return buf;
}

const float* value_rows(const Rows& src, InputType type, int64_t r, int64_t h, int64_t j0, int64_t rows, int64_t dv,
                        const bool* valid, float* buf, int64_t* stride) {
  bool padded = false;
  for (int64_t t = 0; t < rows; ++t) padded |= !valid[j0 + t];
  const int64_t width = pad16(dv);
  const float* out = float_rows(src, type, r, h, j0, rows, dv, width, dv % 16 == 0 && !padded, buf, stride);
  if (padded)  // a padded key's weight is 0, but 0 * nan = nan: its value must not enter the sum at all
    for (int64_t t = 0; t < rows; ++t)
      if (!valid[j0 + t]) std::fill(buf + t * width, buf + (t + 1) * width, 0.f);
  return out;
}

void score_tile(const float* qt, const float* k, int64_t kstride, int64_t rows, int64_t dk, float scaling,
                int lane_vectors, float* s, const TilePrefetch* prefetch) {
  if (lane_vectors == 1) {
    score_rows<1>(qt, k, kstride, rows, dk, scaling, s, prefetch);
  } else {
    score_rows<2>(qt, k, kstride, rows, dk, scaling, s, prefetch);
  }
}

void mask_tile(float* s, int64_t rows, const int32_t* first, const int32_t* last, int lane_vectors) {
  if (lane_vectors == 1) {
    mask_lanes<1>(s, rows, first, last);
  } else {
    mask_lanes<2>(s, rows, first, last);
  }
}

void softmax_tile(float* s, int64_t rows, int64_t lanes, int lane_vectors, float* m, float* z, float* acc,
                  int64_t dvp) {
  if (lane_vectors == 1) {
    softmax_lanes<1>(s, rows, lanes, m, z, acc, dvp);
  } else {
    softmax_lanes<2>(s, rows, lanes, m, z, acc, dvp);
  }
}

void accumulate_tile(const float* p, const float* v, int64_t vstride, int64_t rows, int64_t lanes, float* acc,
                     int64_t dvp) {
  accumulate_all(p, v, vstride, rows, lanes, acc, dvp);
}

void weighted_rows(const float* w, const float* const* rows, int64_t count, int64_t dv, float* out) {
  int64_t d = 0;
  for (; d + 64 <= dv; d += 64) {
    f32x16 a0 = load16(out + d), a1 = load16(out + d + 16), a2 = load16(out + d + 32), a3 = load16(out + d + 48);
    for (int64_t j = 0; j < count; ++j) {
      const float* x = rows[j] + d;
      a0 += w[j] * load16(x);
      a1 += w[j] * load16(x + 16);
      a2 += w[j] * load16(x + 32);
      a3 += w[j] * load16(x + 48);
    }
    store16(out + d, a0);
    store16(out + d + 16, a1);
    store16(out + d + 32, a2);
    store16(out + d + 48, a3);
  }
  for (; d + 16 <= dv; d += 16) {
    f32x16 a = load16(out + d);
    for (int64_t j = 0; j < count; ++j) a += w[j] * load16(rows[j] + d);
    store16(out + d, a);
  }
  for (; d < dv; ++d)
    for (int64_t j = 0; j < count; ++j) out[d] += w[j] * rows[j][d];
}

void exp_shifted(const float* x, int64_t n, float shift, float scale, float* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) store16(out + i, fast_exp16(load16(x + i) - shift) * scale);
  for (; i < n; ++i) out[i] = fast_exp(x[i] - shift) * scale;
}

// kt (dk x kvp) = rows[0..kv) (dk floats each) transposed, zero-padded to kvp = pad16(kv) columns, in
// 16 x 16 register blocks.
void transpose_rows(const float* const* rows, int64_t kv, int64_t dk, float* __restrict kt) {
  const int64_t kvp = pad16(kv);
  float part[16];
  for (int64_t jb = 0; jb < kvp; jb += 16) {
    for (int64_t db = 0; db < dk; db += 16) {
      const int64_t width = std::min<int64_t>(16, dk - db);
      f32x16 block[16];
      for (int64_t jj = 0; jj < 16; ++jj) {
        if (jb + jj >= kv) {
          block[jj] = f32x16{};
        } else if (width == 16) {
          block[jj] = load16(rows[jb + jj] + db);
        } else {
          std::fill(part, part + 16, 0.f);
          std::copy(rows[jb + jj] + db, rows[jb + jj] + db + width, part);
          block[jj] = load16(part);
        }
      }
      transpose16(block);
      for (int64_t dd = 0; dd < width; ++dd) store16(kt + (db + dd) * kvp + jb, block[dd]);
    }
  }
}

void topk_tile(LaneTopK& top, const float* s, int64_t rows, int64_t j0, int lane_vectors) {
#ifdef BC_HAVE_AVX512
  if (has_avx512()) {
    if (lane_vectors == 1) {
      topk_lanes_compress<1>(top, s, rows, j0);
    } else {
      topk_lanes_compress<2>(top, s, rows, j0);
    }
    return;
  }
#endif
  if (lane_vectors == 1) {
    topk_lanes<1>(top, s, rows, j0);
  } else {
    topk_lanes<2>(top, s, rows, j0);
  }
}

void topk_finish(LaneTopK& top) {
  for (int64_t c = 0; c < top.lanes; ++c) {
    uint64_t* x = top.list(c);
    if (top.count[c] > top.k) {
      keep_largest(x, top.count[c], top.k, top.sort_tmp.data());
      top.count[c] = top.k;
    }
    sort_descending(x, top.count[c], top.sort_tmp.data());
  }
}

}  // namespace bert_cluster
