// group_queries, centroid_attention, topk_refine and broadcast_clusters on the CPU. Softmax and
// accumulation in float32 (fp16/bf16 widened in registers, tile by tile); see bert_cluster/reference.py
// for the rules reproduced.
//
// centroid_attention: one task per (row, head, 32 clusters): the clusters are the vector lanes (lanes.h),
// scores, online softmax, top-k (per-lane candidate buffers, a linear selection when one fills) and Vc over tiles of 256 keys,
// with no (C, N) matrix in memory. topk_refine: one task per (row, head): queries sorted by cluster, each
// cluster's top-k keys transposed once (16 x 16 register transposes) and every member scored against them
// as a small dense block, eight members at a time (two below AVX-512); a cluster of at most
// kRowScoreMembers members is scored from its key rows instead (row_scores, lanes.h).
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../checks.h"
#include "common.h"
#include "lanes.h"
#include "ops.h"
#include "parallel.h"
#include "steps.h"
#include "vec.h"

namespace bert_cluster {
namespace {

// ---------------------------------------------------------------------------------------------------
// group_queries

template <typename T>
BC_INLINE void group_head(const GroupJob& job, int64_t rh, float* __restrict row) {
  const int64_t r = rh / job.heads, h = rh % job.heads, n = job.n, dk = job.dk, clusters = job.clusters;
  float* s = job.sums + rh * clusters * dk;
  float* c = job.counts + rh * clusters;
  std::fill(s, s + clusters * dk, 0.f);
  std::fill(c, c + clusters, 0.f);
  const int64_t* a = job.assign + rh * n;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t j = a[i];
    TORCH_CHECK_VALUE(j >= -1 && j < clusters, "assignments must be -1 or in 0..", clusters - 1, ", got ", j);
    if (j < 0) continue;
    c[j] += 1.f;
    const T* qi = job.q.at<T>(r, h, i);
    const float* x;
    if constexpr (std::is_same_v<T, float>) {
      x = qi;
    } else {
      widen(qi, row, dk);
      x = row;
    }
    axpy(s + j * dk, x, 1.f, dk);
  }
  for (int64_t j = 0; j < clusters; ++j) {
    const float divisor = c[j] > 1.f ? c[j] : 1.f;
    for (int64_t d = 0; d < dk; ++d) s[j * dk + d] /= divisor;
  }
}

void group_heads(const GroupJob& job, int64_t begin, int64_t end) {
  Floats row(job.dk);
  for (int64_t rh = begin; rh < end; ++rh) {
    switch (job.type) {
      case InputType::kFloat32: group_head<float>(job, rh, row.data()); break;
      case InputType::kBFloat16: group_head<c10::BFloat16>(job, rh, row.data()); break;
      case InputType::kFloat16: group_head<c10::Half>(job, rh, row.data()); break;
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// centroid_attention

struct LaneScratch {
  Floats qt, s, kbuf, vbuf, acc, row, weights, scores;
  std::vector<const float*> rows;
  Bytes packed_keys, packed_values;  // a head's keys and values, when its rows are not adjacent
  std::vector<int32_t> first, last;
  LaneTopK top;
  LaneScratch(int64_t dk, int64_t dv, int64_t k)
      : qt(std::max<int64_t>(dk, 1) * kLaneCount),
        s(kKeyTile * kLaneCount),
        kbuf(kKeyTile * std::max<int64_t>(dk, 1)),
        vbuf(kKeyTile * pad16(std::max<int64_t>(dv, 1))),
        acc(kLaneCount * pad16(std::max<int64_t>(dv, 1))),
        row(std::max<int64_t>(k, 1) * std::max<int64_t>(dv, 1)),
        weights(std::max<int64_t>(k, 1)),
        scores(std::max<int64_t>(k, 1)),
        rows(std::max<int64_t>(k, 1)),
        first(kKeyTile),
        last(kKeyTile) {}
};

constexpr int64_t kPrefetchRows = 32;
constexpr int64_t kStreamBytes = int64_t{1} << 20;  // a head's keys and values past this come from memory

// One (row, head, group of 32 clusters).
void centroid_task(const CentroidJob& job, int64_t task, LaneScratch& sc) {
  const int64_t rh = task / job.groups, g = task % job.groups;
  const int64_t r = rh / job.heads, h = rh % job.heads;
  const int64_t dk = job.dk, dv = job.dv, dvp = pad16(dv), k = job.k, n = job.n;
  const int64_t c0 = g * kLaneCount, lanes = std::min<int64_t>(kLaneCount, job.clusters - c0);
  const int lane_vectors = lanes <= 16 ? 1 : 2;
  float* qt = sc.qt.data();
  std::fill(sc.qt.begin(), sc.qt.end(), 0.f);
  const float* cen = job.centroids + (rh * job.clusters + c0) * dk;
  for (int64_t c = 0; c < lanes; ++c)
    for (int64_t d = 0; d < dk; ++d) qt[d * kLaneCount + c] = cen[c * dk + d];
  float* acc = sc.acc.data();
  std::fill(acc, acc + kLaneCount * dvp, 0.f);
  float m[kLaneCount], z[kLaneCount];
  for (int c = 0; c < kLaneCount; ++c) {
    m[c] = kNegInf;
    z[c] = 0.f;
  }
  if (k > 0) sc.top.reset(k, lanes);
  const bool* ok = job.valid + r * n;
  float* s = sc.s.data();
  const int64_t key_bytes = dk * job.keys.itemsize, value_bytes = dv * job.values.itemsize;
  const int64_t key_step = job.keys.s2 * job.keys.itemsize, value_step = job.values.s2 * job.values.itemsize;
  const bool stream = n * (key_bytes + value_bytes) > kStreamBytes;
  for (int64_t j0 = job.span_lo[r]; j0 < job.span_hi[r]; j0 += kKeyTile) {
    const int64_t rows = std::min(kKeyTile, job.span_hi[r] - j0);
    int64_t ks = 0, vs = 0;
    const float* kp = float_rows(job.keys, job.type, r, h, j0, rows, dk, dk, true, sc.kbuf.data(), &ks);
    if (stream) {
      // While the tile is scored, key rows ahead (kPrefetchRows read in place; the next tile's when a
      // tile is widened before it is scored) and this tile's value rows are fetched, a few rows with each
      // block of keys: a head larger than the cache streams from memory, and its tiles used to wait for
      // it (at 4,096 x 64, 12 heads, 2 threads: 3.7 ms from memory against 2.6 from cache). Each key's
      // score is the same however the tile is blocked.
      const int64_t ahead = job.type == InputType::kFloat32 ? kPrefetchRows : kKeyTile;
      const TilePrefetch prefetch{static_cast<const char*>(job.keys.ptr(r, h, j0 + ahead)), key_step, key_bytes,
                                  static_cast<const char*>(job.values.ptr(r, h, j0)), value_step, value_bytes};
      score_tile(qt, kp, ks, rows, dk, job.scaling, lane_vectors, s, &prefetch);
    } else {
      score_tile(qt, kp, ks, rows, dk, job.scaling, lane_vectors, s);
    }
    // Padded keys get no weight. Lanes past the last cluster need no mask: the softmax, the top-k and the
    // accumulation read only lanes < `lanes`.
    bool masked = false;
    for (int64_t t = 0; t < rows; ++t) {
      sc.first[t] = 0;
      sc.last[t] = ok[j0 + t] ? static_cast<int32_t>(lanes - 1) : -1;
      masked |= !ok[j0 + t];
    }
    if (masked) mask_tile(s, rows, sc.first.data(), sc.last.data(), lane_vectors);
    if (k > 0) topk_tile(sc.top, s, rows, j0, lane_vectors);
    softmax_tile(s, rows, lanes, lane_vectors, m, z, acc, dvp);
    const float* vp = value_rows(job.values, job.type, r, h, j0, rows, dv, ok, sc.vbuf.data(), &vs);
    accumulate_tile(s, vp, vs, rows, lanes, acc, dvp);
  }
  if (k > 0) topk_finish(sc.top);
  const bool values_in_place = job.type == InputType::kFloat32;
  const HeadRows head_values = job.values.head(r, h);
  for (int64_t c = 0; c < lanes; ++c) {
    const int64_t row = rh * job.clusters + c0 + c;
    const float inv = z[c] > 0.f ? 1.f / z[c] : 0.f;
    float* out = job.centroid_values + row * dv;
    for (int64_t d = 0; d < dv; ++d) out[d] = acc[c * dvp + d] * inv;
    if (k == 0) continue;
    int64_t* idx = job.indices + row * k;
    std::fill(idx, idx + k, -1);
    const int64_t count = sc.top.count[c];
    const uint64_t* list = sc.top.list(c);
    for (int64_t j = 0; j < count; ++j) sc.scores[j] = LaneTopK::score_of(list[j]);
    exp_shifted(sc.scores.data(), count, m[c], inv, sc.weights.data());
    float mass = 0.f;
    for (int64_t j = 0; j < count; ++j) {
      const int64_t l = LaneTopK::index_of(list[j]);
      idx[j] = l;
      mass += sc.weights[j];
      if (values_in_place) {
        sc.rows[j] = head_values.at<float>(l);
      } else {
        widen_row(job.type, head_values.ptr(l), sc.row.data() + j * dv, dv);
        sc.rows[j] = sc.row.data() + j * dv;
      }
    }
    float* tv = job.top_values + row * dv;
    std::fill(tv, tv + dv, 0.f);
    weighted_rows(sc.weights.data(), sc.rows.data(), count, dv, tv);
    job.mass[row] = mass;
  }
}

void centroid_tasks(const CentroidJob& job, int64_t begin, int64_t end) {
  LaneScratch& sc = thread_scratch<LaneScratch>(job.dk, job.dv, job.k);
  CentroidJob head = job;  // keys and values of the current (row, head), packed (a head's tasks are adjacent)
  Bytes& keys = sc.packed_keys;
  Bytes& values = sc.packed_values;
  for (int64_t task = begin, packed = -1; task < end; ++task) {
    const int64_t rh = task / job.groups;
    if (rh != packed) {
      head.keys = packed_head(job.keys, rh / job.heads, rh % job.heads, job.n, job.dk, keys);
      head.values = packed_head(job.values, rh / job.heads, rh % job.heads, job.n, job.dv, values);
      packed = rh;
    }
    centroid_task(head, task, sc);
  }
}

// ---------------------------------------------------------------------------------------------------
// topk_refine

// Members refined together: 2M accumulators, which must stay in registers (32 with AVX-512; with AVX2 an
// accumulator takes 2 of 16, and 8 members ran at 254 ns per query against 134 for 2).
constexpr int kRefineBlock = kNativeBytes == 64 ? 8 : 2;

// Whether topk_refine prefetches the next block's output rows (in (R, N, H, Dv) memory from clustered_heads,
// one page apart or so). With AVX-512 (blocks of 8) the prefetches waited for miss buffers and page walks,
// and the refinement at 4,096 tokens, one thread, took 4-6% longer with them than with the stores alone;
// with AVX2 (blocks of 2) it took 24-37% longer without them.
constexpr bool kPrefetchOutputs = kNativeBytes < 64;

struct RefineScratch {
  Floats kt, kbuf, vbuf, base, scores, qbuf, tail, zero_row;
  std::vector<const float*> krows, vrows;
  std::vector<int64_t> slot, start, fill, order;
  RefineScratch(int64_t n, int64_t clusters, int64_t k, int64_t dk, int64_t dv)
      : kt(std::max<int64_t>(dk, 1) * pad16(std::max<int64_t>(k, 1))),
        kbuf(std::max<int64_t>(k, 1) * std::max<int64_t>(dk, 1)),
        vbuf(std::max<int64_t>(k, 1) * pad16(std::max<int64_t>(dv, 1))),
        base(pad16(std::max<int64_t>(dv, 1))),
        scores(kRefineBlock * pad16(std::max<int64_t>(k, 1))),
        qbuf(kRefineBlock * std::max<int64_t>(dk, 1)),
        tail(16),
        zero_row(std::max<int64_t>(dk, 1)),
        krows(pad16(std::max<int64_t>(k, 1))),
        vrows(std::max<int64_t>(k, 1)),
        slot(std::max<int64_t>(k, 1)),
        start(clusters + 1),
        fill(clusters),
        order(std::max<int64_t>(n, 1)) {}
};

// Scores of M members from the transposed keys kt (dk x kvp): a key's score is one chain of dk multiply-adds
// in its lane, and each key vector is loaded once for the M members (2M accumulators).
template <int M>
BC_INLINE void transposed_scores(const float* const* qm, const float* __restrict kt, int64_t kvp, int64_t dk,
                                 float scaling, float* __restrict scores) {
  int64_t c = 0;
  for (; c + 32 <= kvp; c += 32) {
    f32x16 a[M], b[M];
    for (int m = 0; m < M; ++m) a[m] = b[m] = f32x16{};
    for (int64_t d = 0; d < dk; ++d) {
      const f32x16 k0 = load16(kt + d * kvp + c), k1 = load16(kt + d * kvp + c + 16);
      for (int m = 0; m < M; ++m) {
        const float x = qm[m][d];
        a[m] += x * k0;
        b[m] += x * k1;
      }
    }
    for (int m = 0; m < M; ++m) {
      store16(scores + m * kvp + c, a[m] * scaling);
      store16(scores + m * kvp + c + 16, b[m] * scaling);
    }
  }
  if (c < kvp) {
    f32x16 a[M];
    for (int m = 0; m < M; ++m) a[m] = f32x16{};
    for (int64_t d = 0; d < dk; ++d) {
      const f32x16 k0 = load16(kt + d * kvp + c);
      for (int m = 0; m < M; ++m) a[m] += qm[m][d] * k0;
    }
    for (int m = 0; m < M; ++m) store16(scores + m * kvp + c, a[m] * scaling);
  }
}

// M (<= 8) members (query rows q[0..M)) against their cluster's kv keys: out rows = base + mass *
// softmax(q K^T * scaling) V. The scores come from the transposed keys kt (dk x kvp), or with `from_rows`
// from the key rows krows (see row_scores); vrows: the kv value rows (dvp floats readable each). Each
// value vector is loaded once for the M members; 2M accumulators stay in registers.
template <int M>
BC_INLINE void refine_block(const float* const* q, const float* __restrict kt, const float* const* krows,
                            bool from_rows, int64_t kvp, int64_t kv, const float* const* vrows,
                            const float* __restrict base, float mass, float scaling, int64_t dk, int64_t dv,
                            int64_t dvp, float* __restrict scores, float* const* out, float* __restrict tail) {
  const float* qm[M];
  for (int m = 0; m < M; ++m) qm[m] = q[m];
  if (from_rows) {
    row_scores<M>(qm, krows, kvp, dk, scaling, scores);
  } else {
    transposed_scores<M>(qm, kt, kvp, dk, scaling, scores);
  }
  // The softmax of each member's scores, one phase for all M members at a time (maxima, exponentials,
  // sums, scaling): each member's steps are a chain of dependent reductions, and phase by phase the M
  // chains overlap (8 members: 193 -> 143 ns); every member's operations are the same as one by one.
  // From 4 members on, their sums of exponentials are added up across their lanes together (hsums: one
  // lane_sums, the same bits as M hsums); below, each member's right away (with AVX2, blocks of 2, keeping
  // the sums for later made the refinement 11-16% slower).
  constexpr bool kTogether = M >= 4;
  float top[M], coef[M], total[M];
  f32x16 acc[kTogether ? M : 1];
  for (int m = 0; m < M; ++m) {
    const float* sm = scores + m * kvp;
    f32x16 mx = f32x16{} + kNegInf;
    for (int64_t j = 0; j < kvp; j += 16) {
      const f32x16 x = load16(sm + j);
      mx = select(first_lanes(kv - j) & (x > mx), x, mx);
    }
    top[m] = hmax(mx);
  }
  for (int m = 0; m < M; ++m) {
    float* sm = scores + m * kvp;
    f32x16& a = acc[kTogether ? m : 0];
    a = f32x16{};
    for (int64_t j = 0; j < kvp; j += 16) {
      f32x16 e = fast_exp16(load16(sm + j) - top[m]);
      e = select(first_lanes(kv - j), e, f32x16{});  // padding slots: no weight
      a += e;
      store16(sm + j, e);
    }
    if constexpr (!kTogether) coef[m] = mass / hsum(a);
  }
  if constexpr (kTogether) {
    hsums<M>(acc, total);
    for (int m = 0; m < M; ++m) coef[m] = mass / total[m];
  }
  for (int m = 0; m < M; ++m) {
    float* sm = scores + m * kvp;
    for (int64_t j = 0; j < kvp; j += 16) store16(sm + j, load16(sm + j) * coef[m]);
  }
  int64_t d = 0;
  for (; d + 32 <= dvp; d += 32) {
    f32x16 a[M], b[M];
    const f32x16 b0 = load16(base + d), b1 = load16(base + d + 16);
    for (int m = 0; m < M; ++m) {
      a[m] = b0;
      b[m] = b1;
    }
    for (int64_t j = 0; j < kv; ++j) {
      const float* vr = vrows[j] + d;
      const f32x16 x0 = load16(vr), x1 = load16(vr + 16);
      for (int m = 0; m < M; ++m) {
        const float w = scores[m * kvp + j];
        a[m] += w * x0;
        b[m] += w * x1;
      }
    }
    for (int m = 0; m < M; ++m) {
      if (d + 32 <= dv) {
        store16(out[m] + d, a[m]);
        store16(out[m] + d + 16, b[m]);
      } else {  // the last, partial chunk of a row
        store16(out[m] + d, a[m]);
        store16(tail, b[m]);
        std::copy(tail, tail + (dv - d - 16), out[m] + d + 16);
      }
    }
  }
  if (d < dvp) {
    f32x16 a[M];
    const f32x16 b0 = load16(base + d);
    for (int m = 0; m < M; ++m) a[m] = b0;
    for (int64_t j = 0; j < kv; ++j) {
      const f32x16 x = load16(vrows[j] + d);
      for (int m = 0; m < M; ++m) a[m] += scores[m * kvp + j] * x;
    }
    for (int m = 0; m < M; ++m) {
      store16(tail, a[m]);
      std::copy(tail, tail + (dv - d), out[m] + d);
    }
  }
}

void refine_members(int count, const float* const* q, const float* kt, const float* const* krows, bool from_rows,
                    int64_t kvp, int64_t kv, const float* const* vrows, const float* base, float mass, float scaling,
                    int64_t dk, int64_t dv, int64_t dvp, float* scores, float* const* out, float* tail) {
#define BC_REFINE(M) \
  refine_block<M>(q, kt, krows, from_rows, kvp, kv, vrows, base, mass, scaling, dk, dv, dvp, scores, out, tail)
  switch (count) {
    case 8: BC_REFINE(8); break;
    case 7: BC_REFINE(7); break;
    case 6: BC_REFINE(6); break;
    case 5: BC_REFINE(5); break;
    case 4: BC_REFINE(4); break;
    case 3: BC_REFINE(3); break;
    case 2: BC_REFINE(2); break;
    default: BC_REFINE(1);
  }
#undef BC_REFINE
}

void refine_head(const RefineJob& job, int64_t rh, RefineScratch& sc) {
  const int64_t r = rh / job.heads, h = rh % job.heads;
  const int64_t n = job.n, clusters = job.clusters, k = job.k, dk = job.dk, dv = job.dv, dvp = pad16(dv);
  const int64_t* a = job.assign + rh * n;
  // Rows addressed from the head's base: the full (r, h, i) arithmetic per gathered row, with the job's
  // fields reloaded each time, was over half of this function's own time (7.4% -> 3.4% of a call at 128
  // tokens).
  const HeadRows queries = job.q.head(r, h), keys = job.keys.head(r, h), values = job.values.head(r, h);
  const int64_t query_bytes = dk * job.q.itemsize, key_bytes = dk * job.keys.itemsize;
  const int64_t value_bytes = dv * job.values.itemsize;
  float* out = job.out.head(rh);
  const int64_t os = job.out.s2;  // from one output row to the next
  // Counting sort of the head's queries by cluster: members of cluster c are order[start[c] .. start[c + 1]).
  int64_t* st = sc.start.data();
  std::fill(st, st + clusters + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(a[i] >= -1 && a[i] < clusters, "assignments must be -1 or in 0..", clusters - 1, ", got ",
                      a[i]);
    if (a[i] >= 0) {
      st[a[i] + 1] += 1;
    } else {
      std::fill(out + i * os, out + i * os + dv, 0.f);  // padded query: zeros
    }
  }
  for (int64_t c = 0; c < clusters; ++c) st[c + 1] += st[c];
  std::copy(st, st + clusters, sc.fill.begin());
  for (int64_t i = 0; i < n; ++i)
    if (a[i] >= 0) sc.order[sc.fill[a[i]]++] = i;
  const bool is_float = job.type == InputType::kFloat32;
  // The rows of a cluster's top-k keys and values sit anywhere in the head: start fetching those of the
  // next cluster while this one computes (they are the first touch, from L2 or further).
  auto prefetch_cluster = [&](int64_t c) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t l = job.indices[(rh * clusters + c) * k + j];
      if (l < 0 || l >= n) continue;
      const char* key = static_cast<const char*>(keys.ptr(l));
      const char* value = static_cast<const char*>(values.ptr(l));
      for (int64_t b = 0; b < key_bytes; b += 64) __builtin_prefetch(key + b);
      for (int64_t b = 0; b < value_bytes; b += 64) __builtin_prefetch(value + b);
    }
  };
  int64_t next = 0;
  while (next < clusters && st[next + 1] == st[next]) ++next;
  if (next < clusters) prefetch_cluster(next);
  for (int64_t c = 0; c < clusters; ++c) {
    const int64_t members = st[c + 1] - st[c];
    if (members == 0) continue;
    next = c + 1;
    while (next < clusters && st[next + 1] == st[next]) ++next;
    if (next < clusters) prefetch_cluster(next);
    const int64_t* member = sc.order.data() + st[c];
    const int64_t task = rh * clusters + c;
    float* base = sc.base.data();
    std::fill(base, base + dvp, 0.f);
    for (int64_t d = 0; d < dv; ++d) base[d] = job.centroid_values[task * dv + d] - job.top_values[task * dv + d];
    int64_t kv = 0;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t l = job.indices[task * k + j];
      TORCH_CHECK_VALUE(l >= -1 && l < n, "topk_indices must be -1 or in 0..", n - 1, ", got ", l);
      if (l >= 0) sc.slot[kv++] = l;
    }
    if (kv == 0) {  // no valid key in the row: the centroid output as it is
      for (int64_t j = 0; j < members; ++j) std::copy(base, base + dv, out + member[j] * os);
      continue;
    }
    // The cluster's keys (transposed) and values, gathered once for all its members.
    const float** krows = sc.krows.data();
    const float** vrows = sc.vrows.data();
    if (is_float && dv % 16 == 0) {  // both read in place
      for (int64_t j = 0; j < kv; ++j) {
        krows[j] = keys.at<float>(sc.slot[j]);
        vrows[j] = values.at<float>(sc.slot[j]);
      }
    } else {
      for (int64_t j = 0; j < kv; ++j) {
        if (is_float) {
          krows[j] = keys.at<float>(sc.slot[j]);
        } else {
          widen_row(job.type, keys.ptr(sc.slot[j]), sc.kbuf.data() + j * dk, dk);
          krows[j] = sc.kbuf.data() + j * dk;
        }
        float* dst = sc.vbuf.data() + j * dvp;
        widen_row(job.type, values.ptr(sc.slot[j]), dst, dv);
        std::fill(dst + dv, dst + dvp, 0.f);
        vrows[j] = dst;
      }
    }
    const int64_t kvp = pad16(kv);
    // A small cluster's scores come from the key rows: its transposition would cost more than it saves.
    const bool from_rows = dk % 16 == 0 && members <= kRowScoreMembers;
    if (from_rows) {
      std::fill(sc.krows.begin() + kv, sc.krows.begin() + kvp, sc.zero_row.data());
    } else {
      transpose_rows(sc.krows.data(), kv, dk, sc.kt.data());
    }
    const float mass = job.mass[task];
    for (int64_t m0 = 0; m0 < members; m0 += kRefineBlock) {
      const int count = static_cast<int>(std::min<int64_t>(kRefineBlock, members - m0));
      const float* qrows[kRefineBlock];
      float* orows[kRefineBlock];
      for (int m = 0; m < count; ++m) {
        if (is_float) {
          qrows[m] = queries.at<float>(member[m0 + m]);
        } else {
          widen_row(job.type, queries.ptr(member[m0 + m]), sc.qbuf.data() + m * dk, dk);
          qrows[m] = sc.qbuf.data() + m * dk;
        }
        orows[m] = out + member[m0 + m] * os;
      }
      // The next block's query rows: a cluster's members lie anywhere in the head, and waiting for them
      // took most of the refinement's time on heads larger than the cache (4,096 x 64, one thread: 8.2 ms
      // for 12 heads without, 4.6 with). Its output rows only below AVX-512 (kPrefetchOutputs).
      for (int64_t m = m0 + kRefineBlock; m < std::min<int64_t>(members, m0 + 2 * kRefineBlock); ++m) {
        const char* row = static_cast<const char*>(queries.ptr(member[m]));
        for (int64_t b = 0; b < query_bytes; b += 64) __builtin_prefetch(row + b);
        if constexpr (kPrefetchOutputs) {
          const char* dst = reinterpret_cast<const char*>(out + member[m] * os);
          for (int64_t b = 0; b < dv * static_cast<int64_t>(sizeof(float)); b += 64) __builtin_prefetch(dst + b, 1);
        }
      }
      refine_members(count, qrows, sc.kt.data(), sc.krows.data(), from_rows, kvp, kv, sc.vrows.data(), base, mass,
                     job.scaling, dk, dv, dvp, sc.scores.data(), orows, sc.tail.data());
    }
  }
}

void refine_heads(const RefineJob& job, int64_t begin, int64_t end) {
  RefineScratch& sc = thread_scratch<RefineScratch>(job.n, job.clusters, job.k, job.dk, job.dv);
  for (int64_t rh = begin; rh < end; ++rh) refine_head(job, rh, sc);
}

}  // namespace

void group_query_heads(const GroupJob& job, int64_t begin, int64_t end) { group_heads(job, begin, end); }

void centroid_attention_tasks(const CentroidJob& job, int64_t begin, int64_t end) {
  centroid_tasks(job, begin, end);
}

void topk_refine_heads(const RefineJob& job, int64_t begin, int64_t end) { refine_heads(job, begin, end); }

void broadcast_cluster_heads(const float* centroid_values, const int64_t* assign, int64_t n, int64_t clusters,
                             int64_t dv, int64_t begin, int64_t end, const OutRows& out) {
  for (int64_t i = begin * n; i < end * n; ++i) {
    const int64_t c = assign[i];
    TORCH_CHECK_VALUE(c >= -1 && c < clusters, "assignments must be -1 or in 0..", clusters - 1, ", got ", c);
    float* o = out.head(i / n) + (i % n) * out.s2;
    if (c < 0) {
      std::fill(o, o + dv, 0.f);
    } else {
      const float* src = centroid_values + ((i / n) * clusters + c) * dv;
      std::copy(src, src + dv, o);
    }
  }
}

std::tuple<at::Tensor, at::Tensor> group_queries_cpu(const at::Tensor& queries, const at::Tensor& assignments,
                                                     int64_t clusters) {
  check_group_args(queries, assignments, clusters);
  const int64_t rows = queries.size(0), heads = queries.size(1), n = queries.size(2), dk = queries.size(3);
  const at::Tensor q = last_dim_contiguous(queries);
  const at::Tensor a = assignments.contiguous();
  const auto f32 = queries.options().dtype(at::kFloat);
  at::Tensor sums = zeros_tensor({rows, heads, clusters, dk}, f32);
  at::Tensor counts = zeros_tensor({rows, heads, clusters}, f32);
  if (rows * heads == 0) return {sums, counts};
  GroupJob job{Rows::of(q), input_type(q), a.data_ptr<int64_t>(), heads, n, clusters, dk,
               sums.data_ptr<float>(), counts.data_ptr<float>()};
  parallel_for(0, rows * heads, grain_for(n * dk), [&](int64_t begin, int64_t end) { group_heads(job, begin, end); });
  return {sums, counts};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> centroid_attention_cpu(
    const at::Tensor& centroids, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& valid,
    int64_t topk, double scaling) {
  check_centroid_args(centroids, keys, values, valid, topk);
  const int64_t rows = keys.size(0), heads = keys.size(1), n = keys.size(2), dk = keys.size(3), dv = values.size(3);
  const int64_t clusters = centroids.size(2);
  const int64_t k = std::min(topk, n);
  const at::Tensor cen = centroids.contiguous();
  const at::Tensor kk = last_dim_contiguous(keys), vv = last_dim_contiguous(values);
  const at::Tensor ok = valid.contiguous();
  const auto f32 = keys.options().dtype(at::kFloat);
  at::Tensor centroid_values = empty_tensor({rows, heads, clusters, dv}, f32);
  at::Tensor indices = empty_tensor({rows, heads, clusters, k}, keys.options().dtype(at::kLong));
  at::Tensor mass = zeros_tensor({rows, heads, clusters}, f32);
  at::Tensor top_values = zeros_tensor({rows, heads, clusters, dv}, f32);
  if (rows * heads * clusters == 0) return {centroid_values, indices, mass, top_values};
  std::vector<int64_t> lo(rows), hi(rows);
  valid_spans(ok.data_ptr<bool>(), rows, n, lo.data(), hi.data());
  const int64_t groups = (clusters + kLaneCount - 1) / kLaneCount;
  CentroidJob job{cen.data_ptr<float>(), Rows::of(kk), Rows::of(vv), input_type(kk), ok.data_ptr<bool>(),
                  lo.data(), hi.data(), heads, n, clusters, groups, dk, dv, k, static_cast<float>(scaling),
                  centroid_values.data_ptr<float>(), mass.data_ptr<float>(), top_values.data_ptr<float>(),
                  indices.data_ptr<int64_t>()};
  TORCH_CHECK_TYPE(kk.scalar_type() == vv.scalar_type(), "keys and values must share one dtype, got ",
                   kk.scalar_type(), " and ", vv.scalar_type());
  // Per task: scores, softmax and Vc over n keys for 32 lanes, ~(dk + dv + 16) steps per key and lane.
  parallel_for(0, rows * heads * groups, grain_for(n * (dk + dv + 16) * kLaneCount / 16),
               [&](int64_t begin, int64_t end) { centroid_tasks(job, begin, end); });
  return {centroid_values, indices, mass, top_values};
}

at::Tensor topk_refine_cpu(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
                           const at::Tensor& assignments, const at::Tensor& centroid_values,
                           const at::Tensor& topk_indices, const at::Tensor& topk_mass, const at::Tensor& topk_values,
                           double scaling, double dropout, int64_t seed) {
  if (dropout != 0.0)
    return topk_refine_dropped_cpu(float_rows(queries), float_rows(keys), float_rows(values), assignments.contiguous(),
                                   float_rows(centroid_values), topk_indices.contiguous(), float_rows(topk_mass),
                                   float_rows(topk_values), scaling, dropout, seed);
  check_refine_args(queries, keys, values, assignments, centroid_values, topk_indices, topk_mass, topk_values);
  const int64_t rows = queries.size(0), heads = queries.size(1), n = queries.size(2);
  const int64_t dk = queries.size(3), dv = values.size(3);
  const int64_t clusters = centroid_values.size(2), k = topk_indices.size(3);
  const at::Tensor q = last_dim_contiguous(queries), kk = last_dim_contiguous(keys), vv = last_dim_contiguous(values);
  const at::Tensor a = assignments.contiguous(), cv = centroid_values.contiguous();
  const at::Tensor ti = topk_indices.contiguous(), tm = topk_mass.contiguous(), tv = topk_values.contiguous();
  at::Tensor out = empty_tensor({rows, heads, n, dv}, queries.options().dtype(at::kFloat));  // every row is written
  if (out.numel() == 0) return out;
  RefineJob job{Rows::of(q), Rows::of(kk), Rows::of(vv), input_type(q), a.data_ptr<int64_t>(),
                cv.data_ptr<float>(), tm.data_ptr<float>(), tv.data_ptr<float>(), ti.data_ptr<int64_t>(),
                heads, n, clusters, k, dk, dv, static_cast<float>(scaling), OutRows::of(out)};
  parallel_for(0, rows * heads, grain_for(n * std::max<int64_t>(k, 1) * (dk + dv) / 8),
               [&](int64_t begin, int64_t end) { refine_heads(job, begin, end); });
  return out;
}

at::Tensor broadcast_clusters_cpu(const at::Tensor& centroid_values, const at::Tensor& assignments) {
  check_broadcast_args(centroid_values, assignments);
  const int64_t rows = assignments.size(0), heads = assignments.size(1), n = assignments.size(2);
  const int64_t clusters = centroid_values.size(2), dv = centroid_values.size(3);
  const at::Tensor cv = centroid_values.contiguous(), a = assignments.contiguous();
  at::Tensor out = empty_tensor({rows, heads, n, dv}, cv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, cv.scalar_type(), "broadcast_clusters_cpu", [&] {
    const scalar_t* cvp = cv.data_ptr<scalar_t>();
    const int64_t* ap = a.data_ptr<int64_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    parallel_for(0, rows * heads * n, grain_for(dv), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t c = ap[i];
        TORCH_CHECK_VALUE(c >= -1 && c < clusters, "assignments must be -1 or in 0..", clusters - 1, ", got ", c);
        scalar_t* o = op + i * dv;
        if (c < 0) {
          std::fill(o, o + dv, scalar_t(0));
        } else {
          const scalar_t* src = cvp + ((i / n) * clusters + c) * dv;
          std::copy(src, src + dv, o);
        }
      }
    });
  });
  return out;
}

}  // namespace bert_cluster
