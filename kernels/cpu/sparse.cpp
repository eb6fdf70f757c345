// group_queries, centroid_attention (scores + softmax + top-k + Vc + Vtop in one op), topk_refine
// (gather + dot + softmax + weighted sum + combine in one op), broadcast_clusters and exact_attention on
// the CPU. Softmax and accumulation in float32; see bert_cluster/reference.py for the rules.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <cstdint>
#include <vector>

#include "../checks.h"
#include "parallel.h"
#include "vec.h"

namespace bert_cluster {
namespace {

// A float32 contiguous copy (or view) of an attention tensor: fp16/bf16 are widened once, O(N D).
at::Tensor as_float(const at::Tensor& t) { return t.to(at::kFloat).contiguous(); }

// In-place masked softmax of one row of raw scores: row * scaling, padded keys masked; the scaled scores
// are also written to `scaled` (used to rank keys) when it is not null. Returns false when the row has no
// valid key: then the row is all zeros, as the reference's nan_to_num gives.
BC_MULTIVERSION
bool masked_softmax_row(float* __restrict row, float* __restrict scaled, const bool* __restrict valid, int64_t n,
                        float scaling) {
  for (int64_t l = 0; l < n; ++l) row[l] = valid[l] ? row[l] * scaling : kNegInf;
  if (scaled != nullptr) std::copy(row, row + n, scaled);
  const float mx = n > 0 ? max_of(row, n) : kNegInf;
  if (mx == kNegInf) {
    std::fill(row, row + n, 0.f);
    return false;
  }
  const float sum = exp_shift_sum(row, n, mx);  // padded keys: e^-inf clamps to ~1e-38, zeroed below
  for (int64_t l = 0; l < n; ++l) row[l] = valid[l] ? row[l] : 0.f;
  const float inv = 1.f / sum;
  for (int64_t l = 0; l < n; ++l) row[l] *= inv;
  return true;
}

constexpr int64_t kLanes = 16;  // the width of f32x16 (vec.h)

inline int64_t round_up(int64_t x) { return (x + kLanes - 1) / kLanes * kLanes; }

// Four members of one cluster at once (register blocking: each key / value vector loaded once serves four
// queries, and the eight accumulators are independent FMA chains). qh: the head's (n, dk) queries, read
// in place at rows member[0..4); scores: (4, kp);
// rows: (4, dvp); out rows are written for member[0..4). Same layout rules as refine_members.
BC_MULTIVERSION
void refine_four(const float* __restrict qh, const int64_t* __restrict member, const float* __restrict kt,
                 const float* __restrict vt, int64_t kv, int64_t dk, int64_t dv, const float* __restrict base,
                 float mass, float scaling, float* __restrict scores, float* __restrict rows, float* __restrict out) {
  constexpr int M = 4;
  const int64_t kp = round_up(kv), dvp = round_up(dv);
  const float* q[M];  // the members' query rows, read in place (qh: the head's queries)
  for (int m = 0; m < M; ++m) q[m] = qh + member[m] * dk;
  for (int64_t c = 0; c < kp; c += 2 * kLanes) {
    const bool pair = c + kLanes < kp;
    f32x16 a[M] = {}, b[M] = {};
    for (int64_t d = 0; d < dk; ++d) {
      const f32x16 k0 = load16(kt + d * kp + c);
      const f32x16 k1 = pair ? load16(kt + d * kp + c + kLanes) : f32x16{};
      for (int m = 0; m < M; ++m) {
        const float x = q[m][d];
        a[m] += x * k0;
        b[m] += x * k1;
      }
    }
    for (int m = 0; m < M; ++m) {
      store16(scores + m * kp + c, a[m] * scaling);
      if (pair) store16(scores + m * kp + c + kLanes, b[m] * scaling);
    }
  }
  const f32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  for (int m = 0; m < M; ++m) {
    float* sm = scores + m * kp;
    const float mx = max_of(sm, kv);
    f32x16 acc = {};
    for (int64_t c = 0; c < kp; c += kLanes) {
      f32x16 e = fast_exp16(load16(sm + c) - mx);
      e = lane + static_cast<float>(c) < static_cast<float>(kv) ? e : f32x16{};  // padding lanes: 0
      acc += e;
      store16(sm + c, e);
    }
    float sum = 0.f;
    for (int j = 0; j < kLanes; ++j) sum += acc[j];
    const float coef = mass / sum;
    for (int64_t c = 0; c < kp; c += kLanes) store16(sm + c, load16(sm + c) * coef);
  }
  for (int64_t c = 0; c < dvp; c += 2 * kLanes) {
    const bool pair = c + kLanes < dvp;
    const f32x16 b0 = load16(base + c);
    const f32x16 b1 = pair ? load16(base + c + kLanes) : f32x16{};
    f32x16 a[M], b[M];
    for (int m = 0; m < M; ++m) {
      a[m] = b0;
      b[m] = b1;
    }
    for (int64_t l = 0; l < kv; ++l) {
      const f32x16 v0 = load16(vt + l * dvp + c);
      const f32x16 v1 = pair ? load16(vt + l * dvp + c + kLanes) : f32x16{};
      for (int m = 0; m < M; ++m) {
        const float w = scores[m * kp + l];
        a[m] += w * v0;
        b[m] += w * v1;
      }
    }
    for (int m = 0; m < M; ++m) {
      // Straight into the output row when it holds whole vectors, else through `rows`.
      float* dst = dvp == dv ? out + member[m] * dv : rows + m * dvp;
      store16(dst + c, a[m]);
      if (pair) store16(dst + c + kLanes, b[m]);
    }
  }
  if (dvp != dv)
    for (int m = 0; m < M; ++m) std::copy(rows + m * dvp, rows + m * dvp + dv, out + member[m] * dv);
}

// The members of one cluster: refine each query's output with the cluster's top-k keys.
// q: (members, dk) gathered queries; kt: (dk, kp) the cluster's valid top-k keys, transposed and
// zero-padded to kp = round_up(kv) columns; vt: (kv, dvp) their values zero-padded to dvp = round_up(dv);
// base: (dvp) Vc - Vtop. Every inner step is one kLanes-wide vector operation, no remainder handling.
BC_MULTIVERSION
void refine_members(const float* __restrict q, const int64_t* __restrict member, int64_t members,
                    const float* __restrict kt, const float* __restrict vt, int64_t kv, int64_t dk, int64_t dv,
                    const float* __restrict base, float mass, float scaling, float* __restrict scores,
                    float* __restrict row, float* __restrict out) {
  const int64_t kp = round_up(kv), dvp = round_up(dv);
  for (int64_t m = 0; m < members; ++m) {
    const float* qm = q + m * dk;
    float* o = out + member[m] * dv;
    if (kv == 0) {
      for (int64_t d = 0; d < dv; ++d) o[d] = base[d];
      continue;
    }
    // Scores, two 16-key chunks at a time with even/odd features in separate accumulators: four
    // independent FMA chains instead of one (the loop is latency-bound otherwise).
    for (int64_t c = 0; c < kp; c += 2 * kLanes) {
      const bool pair = c + kLanes < kp;
      f32x16 a0 = {}, a1 = {}, b0 = {}, b1 = {};
      int64_t d = 0;
      for (; d + 1 < dk; d += 2) {
        const float* k0 = kt + d * kp + c;
        const float* k1 = k0 + kp;
        a0 += qm[d] * load16(k0);
        a1 += qm[d + 1] * load16(k1);
        if (pair) {
          b0 += qm[d] * load16(k0 + kLanes);
          b1 += qm[d + 1] * load16(k1 + kLanes);
        }
      }
      if (d < dk) {
        a0 += qm[d] * load16(kt + d * kp + c);
        if (pair) b0 += qm[d] * load16(kt + d * kp + c + kLanes);
      }
      store16(scores + c, (a0 + a1) * scaling);
      if (pair) store16(scores + c + kLanes, (b0 + b1) * scaling);
    }
    const float sum = exp_shift_sum(scores, kv, max_of(scores, kv));
    const float coef = mass / sum;
    for (int64_t l = 0; l < kv; ++l) scores[l] *= coef;
    // Weighted values, the same way: two 16-feature chunks, even/odd keys apart.
    for (int64_t c = 0; c < dvp; c += 2 * kLanes) {
      const bool pair = c + kLanes < dvp;
      f32x16 a0 = load16(base + c), a1 = {}, b0 = {}, b1 = {};
      if (pair) b0 = load16(base + c + kLanes);
      int64_t l = 0;
      for (; l + 1 < kv; l += 2) {
        const float* v0 = vt + l * dvp + c;
        const float* v1 = v0 + dvp;
        a0 += scores[l] * load16(v0);
        a1 += scores[l + 1] * load16(v1);
        if (pair) {
          b0 += scores[l] * load16(v0 + kLanes);
          b1 += scores[l + 1] * load16(v1 + kLanes);
        }
      }
      if (l < kv) {
        a0 += scores[l] * load16(vt + l * dvp + c);
        if (pair) b0 += scores[l] * load16(vt + l * dvp + c + kLanes);
      }
      store16(row + c, a0 + a1);
      if (pair) store16(row + c + kLanes, b0 + b1);
    }
    for (int64_t d = 0; d < dv; ++d) o[d] = row[d];
  }
}

// The k best valid keys of one row by (score desc, index asc), by insertion into a sorted list: after the
// first k keys almost every key is rejected by one comparison with the current k-th score, kept in a
// register. Returns how many were taken (fewer than k when the row has fewer valid keys).
int64_t select_topk(const float* __restrict s, const bool* __restrict valid, int64_t n, int64_t k,
                    int64_t* __restrict top) {
  int64_t filled = 0;
  float threshold = kNegInf;  // the k-th best score once k are taken
  for (int64_t l = 0; l < n; ++l) {
    const float sl = s[l];
    if (filled == k && !(sl > threshold)) continue;  // equal score: the earlier (lower) index stays
    if (!valid[l]) continue;
    int64_t pos = filled == k ? k - 1 : filled++;
    while (pos > 0 && sl > s[top[pos - 1]]) {
      top[pos] = top[pos - 1];
      --pos;
    }
    top[pos] = l;
    if (filled == k) threshold = s[top[k - 1]];
  }
  return filled;
}

// Mass and weighted value sum of one centroid's top-k keys (w: the row's weights, v: the head's values).
BC_MULTIVERSION
float topk_part(const float* __restrict w, const float* __restrict v, const int64_t* __restrict idx, int64_t take,
                int64_t dv, float* __restrict out) {
  float m = 0.f;
  for (int64_t j = 0; j < take; ++j) {
    const int64_t l = idx[j];
    m += w[l];
    axpy(out, v + l * dv, w[l], dv);
  }
  return m;
}

// out[0..dv) = sum_l w[l] v[l] over the n keys of a head (one centroid's Vc row; padded keys have w = 0).
// Accumulates in place in `out` (dv floats, in L1), two keys per step.
BC_MULTIVERSION
void weighted_sum(const float* __restrict w, const float* __restrict v, int64_t n, int64_t dv,
                  float* __restrict out) {
  std::fill(out, out + dv, 0.f);
  int64_t l = 0;
  for (; l + 1 < n; l += 2) {
    const float w0 = w[l], w1 = w[l + 1];
    const float* v0 = v + l * dv;
    const float* v1 = v0 + dv;
    for (int64_t d = 0; d < dv; ++d) out[d] += w0 * v0[d] + w1 * v1[d];
  }
  if (l < n) axpy(out, v + l * dv, w[l], dv);
}

// weighted_sum for four rows of weights (w, w + n, w + 2n, w + 3n) over the same values, dv a multiple of
// 16: each value vector is loaded once for four rows (out: four rows of dv).
BC_MULTIVERSION
void weighted_sum4(const float* __restrict w, const float* __restrict v, int64_t n, int64_t dv,
                   float* __restrict out) {
  for (int64_t c = 0; c < dv; c += kLanes) {
    f32x16 a0 = {}, a1 = {}, a2 = {}, a3 = {};
    for (int64_t l = 0; l < n; ++l) {
      const f32x16 x = load16(v + l * dv + c);
      a0 += w[l] * x;
      a1 += w[n + l] * x;
      a2 += w[2 * n + l] * x;
      a3 += w[3 * n + l] * x;
    }
    store16(out + c, a0);
    store16(out + dv + c, a1);
    store16(out + 2 * dv + c, a2);
    store16(out + 3 * dv + c, a3);
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> group_queries_cpu(const at::Tensor& queries, const at::Tensor& assignments,
                                                     int64_t clusters) {
  check_dim(queries, 4, "queries", "(R, H, N, Dk)");
  check_attention_dtype(queries, "queries");
  TORCH_CHECK_VALUE(clusters >= 1, "clusters must be >= 1, got ", clusters);
  const int64_t rows = queries.size(0), heads = queries.size(1), n = queries.size(2), dk = queries.size(3);
  check_assignments(assignments, rows, heads, n, queries);
  const at::Tensor q = as_float(queries);
  const at::Tensor a = assignments.contiguous();
  at::Tensor sums = at::zeros({rows, heads, clusters, dk}, q.options());
  at::Tensor counts = at::zeros({rows, heads, clusters}, q.options());
  const float* qp = q.data_ptr<float>();
  const int64_t* ap = a.data_ptr<int64_t>();
  float* sp = sums.data_ptr<float>();
  float* cp = counts.data_ptr<float>();
  parallel_for(0, rows * heads, grain_for(n * dk), [&](int64_t begin, int64_t end) {
    for (int64_t rh = begin; rh < end; ++rh) {
      float* s = sp + rh * clusters * dk;
      float* c = cp + rh * clusters;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t j = ap[rh * n + i];
        if (j < 0) continue;
        TORCH_CHECK_VALUE(j < clusters, "assignments must be -1 or in 0..", clusters - 1, ", got ", j);
        c[j] += 1.f;
        axpy(s + j * dk, qp + (rh * n + i) * dk, 1.f, dk);
      }
      for (int64_t j = 0; j < clusters; ++j) {
        const float divisor = c[j] > 1.f ? c[j] : 1.f;
        for (int64_t d = 0; d < dk; ++d) s[j * dk + d] /= divisor;
      }
    }
  });
  return {sums, counts};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> centroid_attention_cpu(
    const at::Tensor& centroids, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& valid,
    int64_t topk, double scaling) {
  check_centroid_args(centroids, keys, values, valid, topk);
  const int64_t rows = keys.size(0), heads = keys.size(1), n = keys.size(2), dv = values.size(3);
  const int64_t clusters = centroids.size(2);
  const int64_t k = std::min(topk, n);
  const float scale = static_cast<float>(scaling);
  // Same GEMM as the reference (centroids @ keys.float().T), so the scores that rank the keys agree bit for bit.
  at::Tensor weights = at::matmul(centroids, keys.to(at::kFloat).transpose(-1, -2)).contiguous();
  const at::Tensor v = as_float(values);
  const at::Tensor ok = valid.contiguous();
  at::Tensor indices = at::empty({rows, heads, clusters, k}, keys.options().dtype(at::kLong));
  at::Tensor mass = at::zeros({rows, heads, clusters}, weights.options());
  at::Tensor top_values = at::zeros({rows, heads, clusters, dv}, weights.options());
  float* wp = weights.data_ptr<float>();
  const bool* okp = ok.data_ptr<bool>();
  const float* vp = v.data_ptr<float>();
  int64_t* ip = indices.data_ptr<int64_t>();
  float* mp = mass.data_ptr<float>();
  float* tp = top_values.data_ptr<float>();
  // Vc = weights @ values inside the same region (no second GEMM and its parallel region).
  at::Tensor centroid_values = at::empty({rows, heads, clusters, dv}, weights.options());
  float* cvp = centroid_values.data_ptr<float>();
  // Per centroid row: scale, mask, exp, normalise, select and Vc over n keys, ~(128 + dv) steps per key.
  parallel_for(0, rows * heads * clusters, grain_for(n * (128 + dv)), [&](int64_t begin, int64_t end) {
    std::vector<float> scaled(k > 0 ? n : 0);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t r = row / (heads * clusters);
      const int64_t rh = row / clusters;
      float* w = wp + row * n;
      const bool* okr = okp + r * n;
      const bool any = masked_softmax_row(w, k > 0 ? scaled.data() : nullptr, okr, n, scale);
      if (k == 0) continue;
      int64_t* idx = ip + row * k;
      std::fill(idx, idx + k, -1);
      if (!any) continue;
      // Top-k by scaled score (softmax is monotone), ties to the lowest key index, padded keys never.
      const int64_t take = select_topk(scaled.data(), okr, n, k, idx);
      const float m = topk_part(w, vp + rh * n * dv, idx, take, dv, tp + row * dv);
      mp[row] = m;
    }
    // Vc rows, four centroids of one head at a time where possible.
    for (int64_t row = begin; row < end;) {
      const int64_t rh = row / clusters;
      const int64_t run = std::min(end, (rh + 1) * clusters) - row;
      const float* vh = vp + rh * n * dv;
      if (run >= 4 && dv % kLanes == 0) {
        weighted_sum4(wp + row * n, vh, n, dv, cvp + row * dv);
        row += 4;
      } else {
        weighted_sum(wp + row * n, vh, n, dv, cvp + row * dv);
        row += 1;
      }
    }
  });
  return {centroid_values, indices, mass, top_values};
}

}  // namespace bert_cluster

namespace bert_cluster {

at::Tensor topk_refine_cpu(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
                           const at::Tensor& assignments, const at::Tensor& centroid_values,
                           const at::Tensor& topk_indices, const at::Tensor& topk_mass, const at::Tensor& topk_values,
                           double scaling) {
  check_refine_args(queries, keys, values, assignments, centroid_values, topk_indices, topk_mass, topk_values);
  const int64_t rows = queries.size(0), heads = queries.size(1), n = queries.size(2);
  const int64_t dk = queries.size(3), dv = values.size(3);
  const int64_t clusters = centroid_values.size(2), k = topk_indices.size(3);
  const at::Tensor q = as_float(queries), kf = as_float(keys), vf = as_float(values);
  const at::Tensor a = assignments.contiguous(), cv = centroid_values.contiguous();
  const at::Tensor ti = topk_indices.contiguous(), tm = topk_mass.contiguous(), tv = topk_values.contiguous();
  at::Tensor out = at::empty({rows, heads, n, dv}, q.options());  // every row is written below

  const int64_t* ap = a.data_ptr<int64_t>();
  const float* qp = q.data_ptr<float>();
  const float* kp_ = kf.data_ptr<float>();
  const float* vp = vf.data_ptr<float>();
  const float* cvp = cv.data_ptr<float>();
  const int64_t* tip = ti.data_ptr<int64_t>();
  const float* tmp = tm.data_ptr<float>();
  const float* tvp = tv.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float scale = static_cast<float>(scaling);
  const int64_t kp = round_up(k), dvp = round_up(dv);
  // One parallel region over (row, head): each task sorts its queries by cluster, then refines cluster by
  // cluster (one region instead of two: every region is a barrier that waits for the slowest thread).
  parallel_for(0, rows * heads, grain_for(n * k * (dk + dv)), [&](int64_t begin, int64_t end) {
    std::vector<float> qbuf, kt(dk * kp), vt(k * dvp), scores(4 * kp), base(dvp), row(4 * dvp);
    std::vector<int64_t> slot(k), start(clusters + 1), fill(clusters), order(n);
    for (int64_t rh = begin; rh < end; ++rh) {
      // Counting sort of the head's queries by cluster: members of cluster c are order[start[c] .. start[c + 1]).
      int64_t* st = start.data();
      std::fill(st, st + clusters + 1, 0);
      const int64_t* ar = ap + rh * n;
      for (int64_t i = 0; i < n; ++i) {
        TORCH_CHECK_VALUE(ar[i] >= -1 && ar[i] < clusters, "assignments must be -1 or in 0..", clusters - 1,
                          ", got ", ar[i]);
        if (ar[i] >= 0) {
          st[ar[i] + 1] += 1;
        } else {
          std::fill(op + (rh * n + i) * dv, op + (rh * n + i + 1) * dv, 0.f);  // padded query: zeros
        }
      }
      for (int64_t c = 0; c < clusters; ++c) st[c + 1] += st[c];
      std::copy(st, st + clusters, fill.begin());
      for (int64_t i = 0; i < n; ++i)
        if (ar[i] >= 0) order[fill[ar[i]]++] = i;
      for (int64_t c = 0; c < clusters; ++c) {
        const int64_t task = rh * clusters + c;
        const int64_t members = st[c + 1] - st[c];
        if (members == 0) continue;
        const int64_t* member = order.data() + st[c];
        // The cluster's valid top-k keys (transposed) and values, gathered once for all its members.
        int64_t kv = 0;
        for (int64_t j = 0; j < k; ++j) {
          const int64_t l = tip[task * k + j];
          if (l < 0) continue;
          TORCH_CHECK_VALUE(l < n, "topk_indices must be -1 or in 0..", n - 1, ", got ", l);
          slot[kv++] = l;
        }
        const int64_t kvp = round_up(kv);
        std::fill(kt.begin(), kt.begin() + dk * kvp, 0.f);
        std::fill(vt.begin(), vt.begin() + kv * dvp, 0.f);
        for (int64_t j = 0; j < kv; ++j) {
          const float* key = kp_ + (rh * n + slot[j]) * dk;
          for (int64_t d = 0; d < dk; ++d) kt[d * kvp + j] = key[d];
          std::copy(vp + (rh * n + slot[j]) * dv, vp + (rh * n + slot[j] + 1) * dv, vt.begin() + j * dvp);
        }
        std::fill(base.begin(), base.end(), 0.f);
        for (int64_t d = 0; d < dv; ++d) base[d] = cvp[task * dv + d] - tvp[task * dv + d];
        int64_t m = 0;
        if (kv > 0) {
          for (; m + 4 <= members; m += 4)
            refine_four(qp + rh * n * dk, member + m, kt.data(), vt.data(), kv, dk, dv, base.data(), tmp[task],
                        scale, scores.data(), row.data(), op + rh * n * dv);
        }
        // The remaining members (fewer than four), gathered.
        qbuf.resize((members - m) * dk);
        for (int64_t j = m; j < members; ++j)
          std::copy(qp + (rh * n + member[j]) * dk, qp + (rh * n + member[j] + 1) * dk, qbuf.begin() + (j - m) * dk);
        refine_members(qbuf.data(), member + m, members - m, kt.data(), vt.data(), kv, dk, dv, base.data(),
                       tmp[task], scale, scores.data(), row.data(), op + rh * n * dv);
      }
    }
  });
  return out;
}

at::Tensor broadcast_clusters_cpu(const at::Tensor& centroid_values, const at::Tensor& assignments) {
  check_broadcast_args(centroid_values, assignments);
  const int64_t rows = assignments.size(0), heads = assignments.size(1), n = assignments.size(2);
  const int64_t clusters = centroid_values.size(2), dv = centroid_values.size(3);
  const at::Tensor cv = centroid_values.contiguous(), a = assignments.contiguous();
  at::Tensor out = at::empty({rows, heads, n, dv}, cv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, cv.scalar_type(), "broadcast_clusters_cpu", [&] {
    const scalar_t* cvp = cv.data_ptr<scalar_t>();
    const int64_t* ap = a.data_ptr<int64_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    parallel_for(0, rows * heads * n, 256, [&](int64_t begin, int64_t end) {
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

at::Tensor exact_attention_cpu(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
                               const at::Tensor& valid, double scaling) {
  check_qkv(queries, keys, values);
  const int64_t rows = queries.size(0), heads = queries.size(1), n = queries.size(2);
  check_valid(valid, rows, n, queries);
  at::Tensor weights = at::matmul(queries.to(at::kFloat), keys.to(at::kFloat).transpose(-1, -2)).contiguous();
  const at::Tensor ok = valid.contiguous();
  float* wp = weights.data_ptr<float>();
  const bool* okp = ok.data_ptr<bool>();
  const float scale = static_cast<float>(scaling);
  parallel_for(0, rows * heads * n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t r = row / (heads * n), i = row % n;
      float* w = wp + row * n;
      if (!okp[r * n + i]) {  // padded query: zero output
        std::fill(w, w + n, 0.f);
        continue;
      }
      masked_softmax_row(w, nullptr, okp + r * n, n, scale);
    }
  });
  return at::matmul(weights, values.to(at::kFloat));
}

TORCH_LIBRARY_IMPL(bert_cluster, CPU, m) {
  m.impl("group_queries", &group_queries_cpu);
  m.impl("centroid_attention", &centroid_attention_cpu);
  m.impl("topk_refine", &topk_refine_cpu);
  m.impl("broadcast_clusters", &broadcast_clusters_cpu);
  m.impl("exact_attention", &exact_attention_cpu);
}

}  // namespace bert_cluster
