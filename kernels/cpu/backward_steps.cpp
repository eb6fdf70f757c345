// Backward kernels of the steps before the refinement (issue 38): centroid_attention, group_queries (and
// lloyd_refine's centroids, the same means) and broadcast_clusters. Each is the exact gradient of what the
// step computes given the forward's discrete choices (assignments, top-k indices), which carry none; the
// oracle is autograd through the reference (reference.centroid_attention_backward and the others).
//
// Deterministic: one thread owns one (row, head), and every sum runs in a fixed order inside it, so the
// same inputs give the same gradient bits at any thread count; no float atomics. Queries, keys and values
// are read in place in their own dtype (fp32, fp16, bf16; any strides but the last dim), widened to float32
// a value or a row at a time, never as a full-size copy; the key and value gradients are written in that
// dtype (rounded once from float32, as autograd through the reference rounds them). Per head the scratch is
// O(N * C + C * D): nothing N x N.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#include "common.h"
#include "ops.h"
#include "parallel.h"
#include "vec.h"

namespace bert_cluster {
namespace {

constexpr int64_t kGroup = 32;  // clusters per pass over the keys: two 16-lane vectors

template <typename T>
BC_INLINE void store_row(T* __restrict dst, const float* __restrict src, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);  // round to nearest even, as .to()
  }
}

void check_float_input(const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, name, " must be float32 in the backward, got ", t.scalar_type());
}

// ---------------------------------------------------------------------------------------------------
// centroid_attention: per centroid c, S = s C K^T over the valid keys, A = softmax(S), Vc = A V,
// m = sum_{l in T_c} A_l, Vtop = sum_{l in T_c} A_l V_l. Given gVc, gm, gVtop:
//   dA_cl = gVc_c . V_l + [l in T_c] (gm_c + gVtop_c . V_l),   delta_c = sum_l A_cl dA_cl,
//   dS_cl = A_cl (dA_cl - delta_c),
//   dC_c = s sum_l dS_cl K_l,  dK_l = s sum_c dS_cl C_c,  dV_l = sum_c A_cl (gVc_c + [l in T_c] gVtop_c).
// Passes over a head's valid keys: scores and their max (32 clusters per vector pair), the softmax sums,
// A and dA (stored key-major, C rounded up to 32), delta; then per key its three gradients.

struct CentroidBackwardScratch {
  Floats ct, gt, p, da, top, inv, delta, ds, krow, vrow, acc;
  std::vector<int64_t> keys, position, member_start, members, next;
};

struct CentroidBackwardJob {
  const float *centroids, *grad_cv, *grad_mass, *grad_tv;  // (R, H, C, Dk), (R, H, C, Dv), (R, H, C), (R, H, C, Dv)
  Rows keys, values;
  const bool* valid;         // (R, N)
  const int64_t* indices;    // (R, H, C, k)
  int64_t heads, n, clusters, dk, dv, k;
  float scaling;
  float* dcent;  // (R, H, C, Dk), zeroed
  void *dkeys, *dvalues;  // (R, H, N, Dk), (R, H, N, Dv) in the keys' dtype, every row written
  // Or, where set, float32 (R, H, N, Dk) and (R, H, N, Dv) gradients the key and value gradients are added
  // into (centroid_attention_backward_into; dkeys and dvalues unused).
  float *add_dkeys = nullptr, *add_dvalues = nullptr;
};

template <typename T>
void centroid_backward_head(const CentroidBackwardJob& job, int64_t head, CentroidBackwardScratch& s) {
  const int64_t r = head / job.heads, h = head % job.heads;
  const int64_t n = job.n, C = job.clusters, dk = job.dk, dv = job.dv, k = job.k;
  const int64_t cp = (C + kGroup - 1) / kGroup * kGroup, groups = cp / kGroup;
  const float sc = job.scaling;
  const HeadRows K = job.keys.head(r, h), V = job.values.head(r, h);
  const bool* ok = job.valid + r * n;
  const float* cent = job.centroids + head * C * dk;
  const float* gvc = job.grad_cv + head * C * dv;
  const float* gm = job.grad_mass + head * C;
  const float* gtv = job.grad_tv + head * C * dv;
  const int64_t* idx = job.indices + head * C * k;
  float* dcent = job.dcent + head * C * dk;
  const bool adds = job.add_dkeys != nullptr;
  T* dK = adds ? nullptr : static_cast<T*>(job.dkeys) + head * n * dk;
  T* dV = adds ? nullptr : static_cast<T*>(job.dvalues) + head * n * dv;
  float* addK = adds ? job.add_dkeys + head * n * dk : nullptr;
  float* addV = adds ? job.add_dvalues + head * n * dv : nullptr;

  s.keys.clear();
  s.position.assign(n, -1);
  for (int64_t l = 0; l < n; ++l) {
    if (ok[l]) {
      s.position[l] = static_cast<int64_t>(s.keys.size());
      s.keys.push_back(l);
    } else if (!adds) {  // a padded key's gradient is 0 (added: nothing to add)
      std::fill(dK + l * dk, dK + (l + 1) * dk, T(0.f));
      std::fill(dV + l * dv, dV + (l + 1) * dv, T(0.f));
    }
  }
  const int64_t nv = static_cast<int64_t>(s.keys.size());
  if (nv == 0) return;  // no valid key: every weight is 0, every gradient 0

  // The top-k members of each key (the clusters whose T_c holds it), in cluster order.
  s.member_start.assign(nv + 1, 0);
  for (int64_t c = 0; c < C; ++c)
    for (int64_t u = 0; u < k; ++u) {
      const int64_t l = idx[c * k + u];
      if (l < 0) continue;
      TORCH_CHECK_VALUE(l < n, "topk_indices must be -1 or in 0..", n - 1, ", got ", l);
      if (s.position[l] >= 0) ++s.member_start[s.position[l] + 1];  // a padded key is never picked
    }
  for (int64_t j = 0; j < nv; ++j) s.member_start[j + 1] += s.member_start[j];
  s.members.resize(s.member_start[nv]);
  s.next.assign(s.member_start.begin(), s.member_start.end() - 1);
  for (int64_t c = 0; c < C; ++c)
    for (int64_t u = 0; u < k; ++u) {
      const int64_t l = idx[c * k + u];
      if (l >= 0 && s.position[l] >= 0) s.members[s.next[s.position[l]]++] = c;
    }

  // Centroids and the value gradient transposed (D x cp), zero in the lanes past C.
  s.ct.assign(dk * cp, 0.f);
  s.gt.assign(dv * cp, 0.f);
  for (int64_t c = 0; c < C; ++c) {
    for (int64_t d = 0; d < dk; ++d) s.ct[d * cp + c] = cent[c * dk + d];
    for (int64_t d = 0; d < dv; ++d) s.gt[d * cp + c] = gvc[c * dv + d];
  }
  s.p.resize(nv * cp);
  s.da.resize(nv * cp);
  s.top.resize(cp);
  s.inv.resize(cp);
  s.delta.resize(cp);
  s.ds.resize(cp);
  s.krow.resize(std::max<int64_t>(dk, 1));
  s.vrow.resize(std::max<int64_t>(dv, 1));
  s.acc.resize(std::max(dk, dv) + 1);

  for (int64_t g = 0; g < groups; ++g) {
    const float* ctg = s.ct.data() + g * kGroup;
    const float* gtg = s.gt.data() + g * kGroup;
    // Scores and their max.
    const f32x16 zero = {};
    f32x16 top0 = zero + kNegInf, top1 = zero + kNegInf;
    for (int64_t j = 0; j < nv; ++j) {
      const T* key = K.at<T>(s.keys[j]);
      f32x16 a0 = {}, a1 = {};
      for (int64_t d = 0; d < dk; ++d) {
        const float x = to_float(key[d]);
        a0 += x * load16(ctg + d * cp);
        a1 += x * load16(ctg + d * cp + 16);
      }
      a0 *= sc;
      a1 *= sc;
      store16(s.p.data() + j * cp + g * kGroup, a0);
      store16(s.p.data() + j * cp + g * kGroup + 16, a1);
      top0 = select(top0 > a0, top0, a0);
      top1 = select(top1 > a1, top1, a1);
    }
    // The softmax sums, in key order.
    f32x16 sum0 = {}, sum1 = {};
    for (int64_t j = 0; j < nv; ++j) {
      sum0 += fast_exp16(load16(s.p.data() + j * cp + g * kGroup) - top0);
      sum1 += fast_exp16(load16(s.p.data() + j * cp + g * kGroup + 16) - top1);
    }
    f32x16 inv0 = {}, inv1 = {};
    for (int lane = 0; lane < 16; ++lane) {
      inv0[lane] = g * kGroup + lane < C ? 1.f / sum0[lane] : 0.f;
      inv1[lane] = g * kGroup + 16 + lane < C ? 1.f / sum1[lane] : 0.f;
    }
    // A and gVc . V.
    for (int64_t j = 0; j < nv; ++j) {
      float* pj = s.p.data() + j * cp + g * kGroup;
      store16(pj, fast_exp16(load16(pj) - top0) * inv0);
      store16(pj + 16, fast_exp16(load16(pj + 16) - top1) * inv1);
      const T* value = V.at<T>(s.keys[j]);
      f32x16 a0 = {}, a1 = {};
      for (int64_t d = 0; d < dv; ++d) {
        const float x = to_float(value[d]);
        a0 += x * load16(gtg + d * cp);
        a1 += x * load16(gtg + d * cp + 16);
      }
      store16(s.da.data() + j * cp + g * kGroup, a0);
      store16(s.da.data() + j * cp + g * kGroup + 16, a1);
    }
  }
  // The top-k part of dA: gm_c + gVtop_c . V_l for each cluster whose top-k holds the key.
  for (int64_t j = 0; j < nv; ++j) {
    const int64_t first = s.member_start[j], last = s.member_start[j + 1];
    if (first == last) continue;
    widen(V.at<T>(s.keys[j]), s.vrow.data(), dv);
    for (int64_t e = first; e < last; ++e) {
      const int64_t c = s.members[e];
      s.da[j * cp + c] += gm[c] + dot(gtv + c * dv, s.vrow.data(), dv);
    }
  }
  // delta = sum_l A dA, in key order.
  for (int64_t g = 0; g < cp; g += 16) {
    f32x16 acc = {};
    for (int64_t j = 0; j < nv; ++j) acc += load16(s.p.data() + j * cp + g) * load16(s.da.data() + j * cp + g);
    store16(s.delta.data() + g, acc);
  }
  // Per key: dS, then dK_l, dV_l and the centroids' gradient (clusters in order).
  for (int64_t j = 0; j < nv; ++j) {
    const int64_t l = s.keys[j];
    const float* pj = s.p.data() + j * cp;
    const float* daj = s.da.data() + j * cp;
    for (int64_t g = 0; g < cp; g += 16)
      store16(s.ds.data() + g, load16(pj + g) * (load16(daj + g) - load16(s.delta.data() + g)) * sc);
    widen(K.at<T>(l), s.krow.data(), dk);
    float* acc = s.acc.data();
    std::fill(acc, acc + dk, 0.f);
    for (int64_t c = 0; c < C; ++c) {
      axpy(acc, cent + c * dk, s.ds[c], dk);
      axpy(dcent + c * dk, s.krow.data(), s.ds[c], dk);
    }
    if (adds) {
      for (int64_t d = 0; d < dk; ++d) addK[l * dk + d] += acc[d];
    } else {
      store_row(dK + l * dk, acc, dk);
    }
    std::fill(acc, acc + dv, 0.f);
    for (int64_t c = 0; c < C; ++c) axpy(acc, gvc + c * dv, pj[c], dv);
    for (int64_t e = s.member_start[j]; e < s.member_start[j + 1]; ++e) {
      const int64_t c = s.members[e];
      axpy(acc, gtv + c * dv, pj[c], dv);
    }
    if (adds) {
      for (int64_t d = 0; d < dv; ++d) addV[l * dv + d] += acc[d];
    } else {
      store_row(dV + l * dv, acc, dv);
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// group_queries: centroid_c = (sum of its members' finite entries) / count_c, an entry that any member
// holds non-finite (NaN, +-inf) being replaced by a constant (reference.group_queries). So dq_id =
// g_cd / count_c for a member i of c, unless q_id or another member's entry d is non-finite (then 0).

template <typename T>
void group_backward_head(const float* grad, const HeadRows& q, const int64_t* assign, int64_t n, int64_t C,
                         int64_t dk, T* dq, std::vector<float>& counts, std::vector<char>& broken) {
  counts.assign(C, 0.f);
  broken.assign(C * dk, 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t c = assign[i];
    if (c < 0) continue;
    TORCH_CHECK_VALUE(c < C, "assignments must be -1 or in 0..", C - 1, ", got ", c);
    counts[c] += 1.f;
    const T* row = q.at<T>(i);
    for (int64_t d = 0; d < dk; ++d) broken[c * dk + d] |= !std::isfinite(to_float(row[d]));
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t c = assign[i];
    T* out = dq + i * dk;
    if (c < 0) {
      std::fill(out, out + dk, T(0.f));
      continue;
    }
    const T* row = q.at<T>(i);
    const float count = std::max(counts[c], 1.f);
    for (int64_t d = 0; d < dk; ++d) {
      const bool flows = !broken[c * dk + d] && std::isfinite(to_float(row[d]));
      out[d] = static_cast<T>(flows ? grad[c * dk + d] / count : 0.f);
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// banded_attention: query i attends to the valid keys l with |i - l| <= window, P = softmax(s q.K_l), out =
// sum P V_l. dP_l = g . V_l, dS = P (dP - sum P dP), dq = s sum dS K_l, dK_l += s dS q, dV_l += P g: one
// thread per (row, head), queries in index order. As the reference: a non-finite value of a visible key
// enters the product as 0 (no gradient of its own) and makes the output element it touches NaN, a
// constant: those output elements pass no gradient.

struct BandBackwardScratch {
  Floats k, v, q, g, p, dp, dq;
  std::vector<uint8_t> broken, seen;
};

template <typename T>
void band_backward_head(const float* grad, const HeadRows& Q, const HeadRows& K, const HeadRows& V, const bool* ok,
                        int64_t n, int64_t dk, int64_t dv, int64_t window, float scaling, float* dq, float* dkeys,
                        float* dvalues, BandBackwardScratch& s) {
  s.k.resize(n * dk);
  s.v.resize(n * dv);
  s.q.resize(dk);
  s.g.resize(dv);
  s.dq.resize(dk);
  const int64_t span = 2 * std::min(window, n) + 1;
  s.p.resize(span);
  s.dp.resize(span);
  bool any_broken = false;
  for (int64_t l = 0; l < n; ++l) {
    if (!ok[l]) continue;
    widen(K.at<T>(l), s.k.data() + l * dk, dk);
    widen(V.at<T>(l), s.v.data() + l * dv, dv);
    for (int64_t d = 0; d < dv; ++d) any_broken |= !std::isfinite(s.v[l * dv + d]);
  }
  if (any_broken) {
    s.broken.assign(n * dv, 0);
    s.seen.resize(dv);
    for (int64_t l = 0; l < n; ++l) {
      if (!ok[l]) continue;
      for (int64_t d = 0; d < dv; ++d) {
        float& x = s.v[l * dv + d];
        if (!std::isfinite(x)) {
          s.broken[l * dv + d] = 1;
          x = 0.f;
        }
      }
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    if (!ok[i]) continue;  // a padded query's output is 0
    const int64_t first = std::max<int64_t>(0, i - window), last = std::min(n - 1, i + window);
    widen(Q.at<T>(i), s.q.data(), dk);
    std::copy_n(grad + i * dv, dv, s.g.data());
    if (any_broken) {
      std::fill(s.seen.begin(), s.seen.end(), 0);
      for (int64_t l = first; l <= last; ++l)
        if (ok[l])
          for (int64_t d = 0; d < dv; ++d) s.seen[d] |= s.broken[l * dv + d];
      for (int64_t d = 0; d < dv; ++d)
        if (s.seen[d]) s.g[d] = 0.f;
    }
    float top = kNegInf;
    int64_t m = 0;
    for (int64_t l = first; l <= last; ++l) {
      if (!ok[l]) continue;
      const float x = scaling * dot(s.q.data(), s.k.data() + l * dk, dk);
      s.p[m++] = x;
      top = std::max(top, x);
    }
    if (m == 0) continue;  // no valid key in the band: a zero output
    float total = 0.f;
    for (int64_t u = 0; u < m; ++u) {
      s.p[u] = std::exp(s.p[u] - top);
      total += s.p[u];
    }
    float weighted = 0.f;
    int64_t u = 0;
    for (int64_t l = first; l <= last; ++l) {
      if (!ok[l]) continue;
      s.p[u] /= total;
      s.dp[u] = dot(s.g.data(), s.v.data() + l * dv, dv);
      weighted += s.p[u] * s.dp[u];
      ++u;
    }
    std::fill(s.dq.begin(), s.dq.end(), 0.f);
    u = 0;
    for (int64_t l = first; l <= last; ++l) {
      if (!ok[l]) continue;
      const float ds = scaling * s.p[u] * (s.dp[u] - weighted);
      axpy(s.dq.data(), s.k.data() + l * dk, ds, dk);
      axpy(dkeys + l * dk, s.q.data(), ds, dk);
      axpy(dvalues + l * dv, s.g.data(), s.p[u], dv);
      ++u;
    }
    std::copy_n(s.dq.data(), dk, dq + i * dk);
  }
  if (any_broken)
    for (int64_t e = 0; e < n * dv; ++e)
      if (s.broken[e]) dvalues[e] = 0.f;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> banded_attention_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
    const at::Tensor& valid, int64_t window, double scaling, double dropout, int64_t seed) {
  if (dropout != 0.0)
    return banded_attention_backward_dropped_cpu(float_rows(grad_out), float_rows(queries), float_rows(keys),
                                                 float_rows(values), valid.contiguous(), window, scaling, dropout,
                                                 seed);
  check_qkv(queries, keys, values);
  check_float_input(grad_out, "grad_out");
  const int64_t rows = queries.size(0), heads = queries.size(1), n = queries.size(2);
  const int64_t dk = queries.size(3), dv = values.size(3);
  check_valid(valid, rows, n, queries);
  TORCH_CHECK_VALUE(window >= 0, "window must be >= 0, got ", window);
  TORCH_CHECK_VALUE(grad_out.sizes() == values.sizes(), "grad_out must be (R, H, N, Dv) = ", values.sizes(), ", got ",
                    grad_out.sizes());
  const at::Tensor g = grad_out.contiguous(), ok = valid.contiguous();
  const at::Tensor q = last_dim_contiguous(queries), kk = last_dim_contiguous(keys), vv = last_dim_contiguous(values);
  const auto f32 = queries.options().dtype(at::kFloat);
  at::Tensor dq = zeros_tensor({rows, heads, n, dk}, f32);
  at::Tensor dkeys = zeros_tensor({rows, heads, n, dk}, f32);
  at::Tensor dvalues = zeros_tensor({rows, heads, n, dv}, f32);
  if (dq.numel() + dvalues.numel() == 0) return {dq, dkeys, dvalues};
  const Rows qr = Rows::of(q), kr = Rows::of(kk), vr = Rows::of(vv);
  const InputType type = input_type(q);
  const int64_t span = 2 * std::min(window, n) + 1;
  parallel_for(0, rows * heads, grain_for(n * span * (2 * dk + 2 * dv)), [&](int64_t begin, int64_t end) {
    BandBackwardScratch scratch;
    for (int64_t head = begin; head < end; ++head) {
      const int64_t r = head / heads, h = head % heads;
      const float* gh = g.data_ptr<float>() + head * n * dv;
      float* dqh = dq.data_ptr<float>() + head * n * dk;
      float* dkh = dkeys.data_ptr<float>() + head * n * dk;
      float* dvh = dvalues.data_ptr<float>() + head * n * dv;
      const bool* okr = ok.data_ptr<bool>() + r * n;
      const float sc = static_cast<float>(scaling);
      switch (type) {
        case InputType::kFloat32:
          band_backward_head<float>(gh, qr.head(r, h), kr.head(r, h), vr.head(r, h), okr, n, dk, dv, window, sc,
                                    dqh, dkh, dvh, scratch);
          break;
        case InputType::kBFloat16:
          band_backward_head<c10::BFloat16>(gh, qr.head(r, h), kr.head(r, h), vr.head(r, h), okr, n, dk, dv, window,
                                            sc, dqh, dkh, dvh, scratch);
          break;
        case InputType::kFloat16:
          band_backward_head<c10::Half>(gh, qr.head(r, h), kr.head(r, h), vr.head(r, h), okr, n, dk, dv, window, sc,
                                        dqh, dkh, dvh, scratch);
          break;
      }
    }
  });
  return {dq, dkeys, dvalues};
}

namespace {

// centroid_attention_backward, its key and value gradients returned (adding == nullptr) or added into
// the float32 tensors adding points to (grad_keys, grad_values).
std::tuple<at::Tensor, at::Tensor, at::Tensor> centroid_backward(
    const at::Tensor& grad_centroid_values, const at::Tensor& grad_topk_mass, const at::Tensor& grad_topk_values,
    const at::Tensor& centroids, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& valid,
    const at::Tensor& topk_indices, double scaling, const std::pair<at::Tensor, at::Tensor>* adding) {
  check_dim(centroids, 4, "centroids", "(R, H, C, Dk)");
  check_dim(keys, 4, "keys", "(R, H, N, Dk)");
  check_dim(values, 4, "values", "(R, H, N, Dv)");
  check_attention_dtype(keys, "keys");
  TORCH_CHECK_VALUE(values.sizes().slice(0, 3) == keys.sizes().slice(0, 3),
                    "values must be (R, H, N, Dv) with the keys' R, H, N, got ", values.sizes(), " vs ", keys.sizes());
  TORCH_CHECK_TYPE(keys.scalar_type() == values.scalar_type(), "keys and values must share one dtype, got ",
                   keys.scalar_type(), " and ", values.scalar_type());
  for (auto [t, name] : {std::pair{&centroids, "centroids"}, {&grad_centroid_values, "grad_centroid_values"},
                         {&grad_topk_mass, "grad_topk_mass"}, {&grad_topk_values, "grad_topk_values"}})
    check_float_input(*t, name);
  const int64_t rows = keys.size(0), heads = keys.size(1), n = keys.size(2), dk = keys.size(3), dv = values.size(3);
  const int64_t clusters = centroids.size(2);
  check_same_head_dim(centroids.size(3), dk);
  TORCH_CHECK_VALUE(centroids.size(0) == rows && centroids.size(1) == heads,
                    "centroids must be (R, H, C, Dk) with the keys' R and H, got ", centroids.sizes());
  check_valid(valid, rows, n, keys);
  check_dtype(topk_indices, at::kLong, "topk_indices");
  check_dim(topk_indices, 4, "topk_indices", "(R, H, C, k)");
  TORCH_CHECK_VALUE(topk_indices.size(0) == rows && topk_indices.size(1) == heads && topk_indices.size(2) == clusters,
                    "topk_indices must be (R, H, C, k), got ", topk_indices.sizes());
  const std::vector<int64_t> cv_shape{rows, heads, clusters, dv};
  TORCH_CHECK_VALUE(grad_centroid_values.sizes() == at::IntArrayRef(cv_shape) &&
                        grad_topk_values.sizes() == at::IntArrayRef(cv_shape),
                    "grad_centroid_values and grad_topk_values must be (R, H, C, Dv), got ",
                    grad_centroid_values.sizes(), " and ", grad_topk_values.sizes());
  TORCH_CHECK_VALUE(grad_topk_mass.dim() == 3 && grad_topk_mass.size(0) == rows && grad_topk_mass.size(1) == heads &&
                        grad_topk_mass.size(2) == clusters,
                    "grad_topk_mass must be (R, H, C), got ", grad_topk_mass.sizes());
  const at::Tensor cen = centroids.contiguous(), gcv = grad_centroid_values.contiguous();
  const at::Tensor gm = grad_topk_mass.contiguous(), gtv = grad_topk_values.contiguous();
  const at::Tensor kk = last_dim_contiguous(keys), vv = last_dim_contiguous(values);
  const at::Tensor ok = valid.contiguous(), ti = topk_indices.contiguous();
  at::Tensor dcent = zeros_tensor({rows, heads, clusters, dk}, cen.options());
  if (adding != nullptr) {
    for (auto [t, name, d] : {std::tuple{&adding->first, "grad_keys", dk}, {&adding->second, "grad_values", dv}}) {
      TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat, name, " must be float32, got ", t->scalar_type());
      TORCH_CHECK_VALUE(t->is_contiguous(), name, " must be contiguous");
      TORCH_CHECK_VALUE(t->dim() == 4 && t->size(0) == rows && t->size(1) == heads && t->size(2) == n && t->size(3) == d,
                        name, " must be (R, H, N, D) as the keys and values, got ", t->sizes());
    }
    if (clusters == 0 || rows * heads * n == 0) return {dcent, adding->first, adding->second};
  } else if (clusters == 0) {
    return {dcent, zeros_tensor(keys.sizes(), keys.options()), zeros_tensor(values.sizes(), values.options())};
  }
  // Every row is written (padded ones with 0), or added to.
  at::Tensor dkeys = adding ? adding->first : empty_tensor({rows, heads, n, dk}, keys.options());
  at::Tensor dvalues = adding ? adding->second : empty_tensor({rows, heads, n, dv}, values.options());
  if (rows * heads * n == 0) return {dcent, dkeys, dvalues};
  CentroidBackwardJob job{cen.data_ptr<float>(), gcv.data_ptr<float>(), gm.data_ptr<float>(), gtv.data_ptr<float>(),
                          Rows::of(kk),          Rows::of(vv),          ok.data_ptr<bool>(),  ti.data_ptr<int64_t>(),
                          heads,                 n,                     clusters,             dk,
                          dv,                    ti.size(3),            static_cast<float>(scaling),
                          dcent.data_ptr<float>(), dkeys.data_ptr(),    dvalues.data_ptr()};
  if (adding != nullptr) {
    job.add_dkeys = dkeys.data_ptr<float>();
    job.add_dvalues = dvalues.data_ptr<float>();
  }
  const InputType type = input_type(kk);
  const int64_t cp = (clusters + kGroup - 1) / kGroup * kGroup;
  parallel_for(0, rows * heads, grain_for(n * (cp * (dk + dv) / 16 + clusters * (2 * dk + dv))),
               [&](int64_t begin, int64_t end) {
                 CentroidBackwardScratch scratch;
                 for (int64_t head = begin; head < end; ++head) {
                   switch (type) {
                     case InputType::kFloat32:
                       centroid_backward_head<float>(job, head, scratch);
                       break;
                     case InputType::kBFloat16:
                       centroid_backward_head<c10::BFloat16>(job, head, scratch);
                       break;
                     case InputType::kFloat16:
                       centroid_backward_head<c10::Half>(job, head, scratch);
                       break;
                   }
                 }
               });
  return {dcent, dkeys, dvalues};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> centroid_attention_backward_cpu(
    const at::Tensor& grad_centroid_values, const at::Tensor& grad_topk_mass, const at::Tensor& grad_topk_values,
    const at::Tensor& centroids, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& valid,
    const at::Tensor& topk_indices, double scaling) {
  return centroid_backward(grad_centroid_values, grad_topk_mass, grad_topk_values, centroids, keys, values, valid,
                           topk_indices, scaling, nullptr);
}

at::Tensor centroid_attention_backward_into_cpu(at::Tensor& grad_keys, at::Tensor& grad_values,
                                                const at::Tensor& grad_centroid_values,
                                                const at::Tensor& grad_topk_mass, const at::Tensor& grad_topk_values,
                                                const at::Tensor& centroids, const at::Tensor& keys,
                                                const at::Tensor& values, const at::Tensor& valid,
                                                const at::Tensor& topk_indices, double scaling) {
  const std::pair<at::Tensor, at::Tensor> adding{grad_keys, grad_values};
  return std::get<0>(centroid_backward(grad_centroid_values, grad_topk_mass, grad_topk_values, centroids, keys,
                                       values, valid, topk_indices, scaling, &adding));
}

at::Tensor group_queries_backward_cpu(const at::Tensor& grad_centroids, const at::Tensor& queries,
                                      const at::Tensor& assignments) {
  check_dim(queries, 4, "queries", "(R, H, N, Dk)");
  check_attention_dtype(queries, "queries");
  check_float_input(grad_centroids, "grad_centroids");
  const int64_t rows = queries.size(0), heads = queries.size(1), n = queries.size(2), dk = queries.size(3);
  check_assignments(assignments, rows, heads, n, queries);
  check_dim(grad_centroids, 4, "grad_centroids", "(R, H, C, Dk)");
  TORCH_CHECK_VALUE(grad_centroids.size(0) == rows && grad_centroids.size(1) == heads &&
                        grad_centroids.size(3) == dk,
                    "grad_centroids must be (R, H, C, Dk) with the queries' R, H and Dk, got ",
                    grad_centroids.sizes());
  const int64_t clusters = grad_centroids.size(2);
  const at::Tensor g = grad_centroids.contiguous(), a = assignments.contiguous(), q = last_dim_contiguous(queries);
  at::Tensor dq = empty_tensor({rows, heads, n, dk}, queries.options());
  if (dq.numel() == 0) return dq;
  const Rows qr = Rows::of(q);
  const InputType type = input_type(q);
  const float* gp = g.data_ptr<float>();
  const int64_t* ap = a.data_ptr<int64_t>();
  parallel_for(0, rows * heads, grain_for(n * dk * 2), [&](int64_t begin, int64_t end) {
    std::vector<float> counts;
    std::vector<char> broken;
    for (int64_t head = begin; head < end; ++head) {
      const HeadRows qh = qr.head(head / heads, head % heads);
      const float* gh = gp + head * clusters * dk;
      const int64_t* ah = ap + head * n;
      switch (type) {
        case InputType::kFloat32:
          group_backward_head(gh, qh, ah, n, clusters, dk, dq.data_ptr<float>() + head * n * dk, counts, broken);
          break;
        case InputType::kBFloat16:
          group_backward_head(gh, qh, ah, n, clusters, dk,
                              static_cast<c10::BFloat16*>(dq.data_ptr()) + head * n * dk, counts, broken);
          break;
        case InputType::kFloat16:
          group_backward_head(gh, qh, ah, n, clusters, dk, static_cast<c10::Half*>(dq.data_ptr()) + head * n * dk,
                              counts, broken);
          break;
      }
    }
  });
  return dq;
}

// broadcast_clusters: out_i = Vc_{a_i} for a member i, so dVc_c = sum of its members' output gradients, in
// query order (one thread per (row, head): no atomics).
at::Tensor broadcast_clusters_backward_cpu(const at::Tensor& grad_out, const at::Tensor& centroid_values,
                                           const at::Tensor& assignments) {
  check_dim(centroid_values, 4, "centroid_values", "(R, H, C, Dv)");
  check_dim(grad_out, 4, "grad_out", "(R, H, N, Dv)");
  const int64_t rows = centroid_values.size(0), heads = centroid_values.size(1);
  const int64_t clusters = centroid_values.size(2), dv = centroid_values.size(3), n = grad_out.size(2);
  TORCH_CHECK_VALUE(grad_out.size(0) == rows && grad_out.size(1) == heads && grad_out.size(3) == dv,
                    "grad_out must be (R, H, N, Dv) with the centroid values' R, H and Dv, got ", grad_out.sizes());
  check_assignments(assignments, rows, heads, n, grad_out);
  check_same_dtype(grad_out, centroid_values, "grad_out", "centroid_values");
  const at::Tensor g = grad_out.contiguous(), a = assignments.contiguous();
  at::Tensor out = empty_tensor({rows, heads, clusters, dv}, centroid_values.options());  // every row is written
  if (out.numel() == 0) return out;
  const int64_t* ap = a.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "broadcast_clusters_backward_cpu", [&] {
    // float32 sums (float64 for float64), rounded once to the dtype
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const scalar_t* gp = g.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    parallel_for(0, rows * heads, grain_for(n * dv), [&](int64_t begin, int64_t end) {
      std::vector<acc_t> sums(clusters * dv);
      for (int64_t head = begin; head < end; ++head) {
        std::fill(sums.begin(), sums.end(), acc_t(0));
        for (int64_t i = 0; i < n; ++i) {
          const int64_t c = ap[head * n + i];
          if (c < 0) continue;
          TORCH_CHECK_VALUE(c < clusters, "assignments must be -1 or in 0..", clusters - 1, ", got ", c);
          const scalar_t* gi = gp + (head * n + i) * dv;
          acc_t* sc = sums.data() + c * dv;
          for (int64_t d = 0; d < dv; ++d) sc[d] += static_cast<acc_t>(gi[d]);
        }
        scalar_t* oh = op + head * clusters * dv;
        for (int64_t e = 0; e < clusters * dv; ++e) oh[e] = static_cast<scalar_t>(sums[e]);
      }
    });
  });
  return out;
}

}  // namespace bert_cluster
