// Backward kernels of the two refinement steps (issue 38): the exact gradient of what topk_refine and
// refine_with_query_mass compute, given the forward's discrete choices (assignments, top-k indices), which
// carry none. The formulas are written out step by step beside the reference in docs/training.md.
//
// Deterministic: one thread owns one (row, head), and every sum runs in a fixed order inside it (queries in
// index order, slots in top-k order), so the same inputs give the same gradient bits at any thread count.
// Inputs are float32 (ops.py widens fp16/bf16 once: the gradients of those are rounded to their dtype at
// the end, as autograd through the reference does); the output gradient, queries, keys and values are read
// through their row strides (transformers' layouts, no contiguous copy), the rest contiguous. Nothing N x N is formed: per head the
// scratch is O(k + C * D).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "common.h"
#include "ops.h"
#include "parallel.h"
#include "simd.h"

namespace bert_cluster {
namespace {

inline float dot(const float* a, const float* b, int64_t d) {
  float s = 0.f;
  for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float alpha, const float* x, float* y, int64_t d) {
  for (int64_t i = 0; i < d; ++i) y[i] += alpha * x[i];
}

void check_float_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, name, " must be float32 in the backward, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous in the backward");
}

// A float32 (R, H, N, D) tensor read row by row through its strides (the output gradient as transformers
// gives it, the queries, keys and values as the attention's projections do): no contiguous copy.
void check_float_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, name, " must be float32 in the backward, got ", t.scalar_type());
}

// Shapes shared by both backward ops.
struct Shape {
  int64_t rows, heads, n, dk, dv, clusters, k;
};

Shape check_backward_args(const at::Tensor& grad_out, const at::Tensor& queries, const at::Tensor& keys,
                          const at::Tensor& values, const at::Tensor& assignments, const at::Tensor& topk_indices,
                          const at::Tensor& topk_mass) {
  check_dim(grad_out, 4, "grad_out", "(R, H, N, Dv)");
  check_qkv(queries, keys, values);
  check_float_rows(grad_out, "grad_out");
  check_float_contiguous(topk_mass, "topk_mass");
  check_dtype(assignments, at::kLong, "assignments");
  check_dtype(topk_indices, at::kLong, "topk_indices");
  TORCH_CHECK_VALUE(assignments.is_contiguous() && topk_indices.is_contiguous(),
                    "assignments and topk_indices must be contiguous in the backward");
  Shape s{queries.size(0), queries.size(1), queries.size(2), queries.size(3),
          values.size(3),  topk_indices.size(2), topk_indices.size(3)};
  TORCH_CHECK_VALUE(grad_out.size(0) == s.rows && grad_out.size(1) == s.heads && grad_out.size(2) == s.n &&
                        grad_out.size(3) == s.dv,
                    "grad_out must be (R, H, N, Dv) = ", values.sizes(), ", got ", grad_out.sizes());
  check_dim(assignments, 3, "assignments", "(R, H, N)");
  check_dim(topk_indices, 4, "topk_indices", "(R, H, C, k)");
  check_dim(topk_mass, 3, "topk_mass", "(R, H, C)");
  TORCH_CHECK_VALUE(assignments.size(0) == s.rows && assignments.size(1) == s.heads && assignments.size(2) == s.n,
                    "assignments must be (R, H, N), got ", assignments.sizes());
  TORCH_CHECK_VALUE(topk_indices.size(0) == s.rows && topk_indices.size(1) == s.heads,
                    "topk_indices must be (R, H, C, k), got ", topk_indices.sizes());
  TORCH_CHECK_VALUE(topk_mass.size(0) == s.rows && topk_mass.size(1) == s.heads && topk_mass.size(2) == s.clusters,
                    "topk_mass must be (R, H, C), got ", topk_mass.sizes());
  return s;
}

// A cluster's top-k slots holding a key (index >= 0), checked against N.
int64_t cluster_slots(const int64_t* indices, int64_t k, int64_t n, int64_t* out) {
  int64_t used = 0;
  for (int64_t s = 0; s < k; ++s) {
    const int64_t l = indices[s];
    if (l < 0) continue;
    TORCH_CHECK_VALUE(l < n, "topk_indices must be -1 or in 0..", n - 1, ", got ", l);
    out[used++] = l;
  }
  return used;
}

// softmax of scores[0..m) in place (max subtracted); returns log-sum-exp (-inf when m == 0).
float softmax_inplace(float* scores, int64_t m) {
  if (m == 0) return -std::numeric_limits<float>::infinity();
  float top = scores[0];
  for (int64_t s = 1; s < m; ++s) top = std::max(top, scores[s]);
  float total = 0.f;
  for (int64_t s = 0; s < m; ++s) {
    scores[s] = std::exp(scores[s] - top);
    total += scores[s];
  }
  for (int64_t s = 0; s < m; ++s) scores[s] /= total;
  return top + std::log(total);
}

// out[0..d) (+)= sum_u w[u] * rows[u * d + 0..d) for u < m, 16 columns at a time in a register (in u order).
void weighted_rows(const float* w, const float* rows, int64_t m, int64_t d, float* out, bool add) {
  int64_t c = 0;
  for (; c + 16 <= d; c += 16) {
    f32x16 acc = {};
    for (int64_t u = 0; u < m; ++u) acc += w[u] * load_vec<f32x16>(rows + u * d + c);
    if (add) acc += load_vec<f32x16>(out + c);
    store_vec(out + c, acc);
  }
  for (; c < d; ++c) {
    float acc = 0.f;
    for (int64_t u = 0; u < m; ++u) acc += w[u] * rows[u * d + c];
    out[c] = add ? out[c] + acc : acc;
  }
}

// The top-k part shared by both refinements, for one cluster's top-k keys T (prepared once: their rows widened
// to float32, and transposed, so that a query's k scores and k value products are vector loops over the
// slots) and then each member query: P = softmax(s q.K_l) over the slots, E = sum P V. Given dE (the output
// gradient times the query's mass) and an extra gradient on log-sum-exp (dlse), backward adds the query's,
// keys' and values' gradients and returns nothing else: the callers own the rest.
struct TopkCluster {
  int64_t m = 0, kp = 0, dk = 0, dv = 0;
  const int64_t* slots = nullptr;
  std::vector<float> kr, vr, kt, vt, p, gv, dkr, dvr;  // dkr, dvr: the slots' key and value gradients

  template <typename T>
  void prepare(const HeadRows& keys, const HeadRows& values, const int64_t* sl, int64_t used, int64_t dk_,
               int64_t dv_) {
    m = used;
    kp = (m + 15) / 16 * 16;
    dk = dk_;
    dv = dv_;
    slots = sl;
    kr.resize(m * dk);
    vr.resize(m * dv);
    kt.assign(dk * kp, 0.f);
    vt.assign(dv * kp, 0.f);
    p.assign(kp, 0.f);
    gv.assign(kp, 0.f);
    dkr.assign(m * dk, 0.f);
    dvr.assign(m * dv, 0.f);
    for (int64_t u = 0; u < m; ++u) {
      const T* key = keys.at<T>(sl[u]);
      const T* value = values.at<T>(sl[u]);
      for (int64_t d = 0; d < dk; ++d) kt[d * kp + u] = kr[u * dk + d] = static_cast<float>(key[d]);
      for (int64_t d = 0; d < dv; ++d) vt[d * kp + u] = vr[u * dv + d] = static_cast<float>(value[d]);
    }
  }

  // out[0..kp) = sum_d x[d] * t[d * kp + 0..kp), 32 slots at a time in registers (kp: a multiple of 16).
  void slot_products(const float* x, const float* t, int64_t d_count, float* out) const {
    for (int64_t base = 0; base < kp; base += 32) {
      const bool pair = base + 16 < kp;
      f32x16 a0 = {}, a1 = {};
      for (int64_t d = 0; d < d_count; ++d) {
        a0 += x[d] * load_vec<f32x16>(t + d * kp + base);
        if (pair) a1 += x[d] * load_vec<f32x16>(t + d * kp + base + 16);
      }
      store_vec(out + base, a0);
      if (pair) store_vec(out + base + 16, a1);
    }
  }

  // Fills p (softmax) and e (sum P V); returns log-sum-exp.
  float forward(const float* q, float scaling, float* e) {
    if (kp > 0) slot_products(q, kt.data(), dk, p.data());
    for (int64_t u = 0; u < m; ++u) p[u] *= scaling;
    const float lse = softmax_inplace(p.data(), m);
    weighted_rows(p.data(), vr.data(), m, dv, e, false);
    return lse;
  }

  // dE = scale_e * g (g: the output gradient); dlse: gradient on the log-sum-exp of the scores. The keys'
  // and values' gradients gather in the cluster's own rows (in cache), which flush adds to the head's.
  void backward(const float* q, float scaling, const float* g, float scale_e, float dlse, float* dq) {
    if (kp > 0) slot_products(g, vt.data(), dv, gv.data());
    float weighted = 0.f;
    for (int64_t u = 0; u < m; ++u) {
      gv[u] *= scale_e;  // dP_u
      weighted += p[u] * gv[u];
    }
    for (int64_t u = 0; u < m; ++u) {
      const float ds = scaling * (p[u] * (gv[u] - weighted) + dlse * p[u]);
      axpy(ds, q, dkr.data() + u * dk, dk);
      axpy(scale_e * p[u], g, dvr.data() + u * dv, dv);
      gv[u] = ds;
    }
    weighted_rows(gv.data(), kr.data(), m, dk, dq, true);
  }

  // Adds the cluster's key and value gradients to the head's (N, D) float32 ones, in slot order.
  void flush(float* dkeys, float* dvalues) const {
    for (int64_t u = 0; u < m; ++u) {
      axpy(1.f, dkr.data() + u * dk, dkeys + slots[u] * dk, dk);
      axpy(1.f, dvr.data() + u * dv, dvalues + slots[u] * dv, dv);
    }
  }
};

// The members of each cluster in query order (CSR: start[c]..start[c + 1] of order), padded queries out.
void cluster_members(const int64_t* assign, int64_t n, int64_t clusters, std::vector<int64_t>& start,
                     std::vector<int64_t>& order, std::vector<int64_t>& next) {
  start.assign(clusters + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t c = assign[i];
    if (c < 0) continue;  // padding: a zero output, no gradient
    TORCH_CHECK_VALUE(c < clusters, "assignments must be -1 or in 0..", clusters - 1, ", got ", c);
    ++start[c + 1];
  }
  for (int64_t c = 0; c < clusters; ++c) start[c + 1] += start[c];
  order.resize(start[clusters]);
  next.assign(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < n; ++i)
    if (assign[i] >= 0) order[next[assign[i]]++] = i;
}

}  // namespace

// i-clustered: out_i = (Vc_j - Vtop_j) + m_j * sum_{l in T_j} softmax_l(s q_i.K_l) V_l for query i in cluster j.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> topk_refine_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
    const at::Tensor& assignments, const at::Tensor& topk_indices, const at::Tensor& topk_mass, double scaling,
    double dropout, int64_t seed) {
  if (dropout != 0.0)
    return topk_refine_backward_dropped_cpu(float_rows(grad_out), float_rows(queries), float_rows(keys),
                                            float_rows(values), assignments.contiguous(), topk_indices.contiguous(),
                                            float_rows(topk_mass), scaling, dropout, seed);
  const Shape s = check_backward_args(grad_out, queries, keys, values, assignments, topk_indices, topk_mass);
  const auto options = queries.options().dtype(at::kFloat);
  at::Tensor dq = zeros_tensor({s.rows, s.heads, s.n, s.dk}, options);
  at::Tensor dkeys = zeros_tensor({s.rows, s.heads, s.n, s.dk}, options);
  at::Tensor dvalues = zeros_tensor({s.rows, s.heads, s.n, s.dv}, options);
  at::Tensor dcentroid = zeros_tensor({s.rows, s.heads, s.clusters, s.dv}, options);
  at::Tensor dmass = zeros_tensor({s.rows, s.heads, s.clusters}, options);
  const at::Tensor go = last_dim_contiguous(grad_out);
  const Rows gr = Rows::of(go);
  const at::Tensor q = last_dim_contiguous(queries), kk = last_dim_contiguous(keys), vv = last_dim_contiguous(values);
  const Rows qr = Rows::of(q), kr = Rows::of(kk), vr = Rows::of(vv);
  const InputType type = input_type(q);
  const int64_t* ap = assignments.data_ptr<int64_t>();
  const int64_t* tip = topk_indices.data_ptr<int64_t>();
  const float* mp = topk_mass.data_ptr<float>();
  const float scale = static_cast<float>(scaling);
  parallel_for(0, s.rows * s.heads, grain_for(s.n * std::max<int64_t>(s.k, 1) * (s.dk + s.dv)),
               [&](int64_t begin, int64_t end) {
                 TopkCluster top;
                 std::vector<int64_t> slots(std::max<int64_t>(s.k, 1)), start, order, next;
                 std::vector<float> e(s.dv), qrow(s.dk);
                 for (int64_t head = begin; head < end; ++head) {
                   const int64_t r = head / s.heads, h = head % s.heads;
                   const HeadRows qh = qr.head(r, h), kh = kr.head(r, h), vh = vr.head(r, h);
                   const int64_t qo = head * s.n * s.dk, vo = head * s.n * s.dv;
                   cluster_members(ap + head * s.n, s.n, s.clusters, start, order, next);
                   float* dcv = dcentroid.data_ptr<float>() + head * s.clusters * s.dv;
                   float* dm = dmass.data_ptr<float>() + head * s.clusters;
                   for (int64_t c = 0; c < s.clusters; ++c) {
                     if (start[c] == start[c + 1]) continue;
                     const int64_t used = cluster_slots(tip + (head * s.clusters + c) * s.k, s.k, s.n, slots.data());
                     switch (type) {
                       case InputType::kFloat32:
                         top.prepare<float>(kh, vh, slots.data(), used, s.dk, s.dv);
                         break;
                       case InputType::kBFloat16:
                         top.prepare<c10::BFloat16>(kh, vh, slots.data(), used, s.dk, s.dv);
                         break;
                       case InputType::kFloat16:
                         top.prepare<c10::Half>(kh, vh, slots.data(), used, s.dk, s.dv);
                         break;
                     }
                     const float mass = mp[head * s.clusters + c];
                     for (int64_t o = start[c]; o < start[c + 1]; ++o) {
                       const int64_t i = order[o];
                       const float* gi = gr.at<float>(r, h, i);
                       switch (type) {
                         case InputType::kFloat32:
                           std::copy_n(qh.at<float>(i), s.dk, qrow.data());
                           break;
                         case InputType::kBFloat16:
                           std::copy_n(qh.at<c10::BFloat16>(i), s.dk, qrow.data());
                           break;
                         case InputType::kFloat16:
                           std::copy_n(qh.at<c10::Half>(i), s.dk, qrow.data());
                           break;
                       }
                       top.forward(qrow.data(), scale, e.data());
                       axpy(1.f, gi, dcv + c * s.dv, s.dv);
                       dm[c] += dot(gi, e.data(), s.dv);
                       top.backward(qrow.data(), scale, gi, mass, 0.f, dq.data_ptr<float>() + qo + i * s.dk);
                     }
                     top.flush(dkeys.data_ptr<float>() + qo, dvalues.data_ptr<float>() + vo);
                   }
                 }
               });
  at::Tensor dtopv = dcentroid.neg();
  return {dq, dkeys, dvalues, dcentroid, dmass, dtopv};
}

// i-clustered+: each query's own mass on the top-k keys (reference.refine_with_query_mass, whose names this
// follows). Per cluster j: the key statistics outside T_j (mean mu, variance var), the centroid's
// log-sum-exp over T_j (lzc) and its Gaussian estimate over the rest (crest), A_j = log((1 - m_j) / m_j) +
// lzc_j - crest_j. Per query: o_i = A_j - lzq_i + qrest_i, M_i = sigmoid(-o_i), out_i = M_i E_i + (1 - M_i)
// RM_j with RM_j = (Vc_j - Vtop_j) / (1 - m_j).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
refine_with_query_mass_backward_cpu(const at::Tensor& grad_out, const at::Tensor& queries, const at::Tensor& keys,
                                    const at::Tensor& values, const at::Tensor& valid, const at::Tensor& assignments,
                                    const at::Tensor& centroids, const at::Tensor& centroid_values,
                                    const at::Tensor& topk_indices, const at::Tensor& topk_mass,
                                    const at::Tensor& topk_values, double scaling, double dropout, int64_t seed) {
  if (dropout != 0.0)
    return refine_with_query_mass_backward_dropped_cpu(
        float_rows(grad_out), float_rows(queries), float_rows(keys), float_rows(values), valid.contiguous(),
        assignments.contiguous(), float_rows(centroids), float_rows(centroid_values), topk_indices.contiguous(),
        float_rows(topk_mass), float_rows(topk_values), scaling, dropout, seed);
  const Shape s = check_backward_args(grad_out, queries, keys, values, assignments, topk_indices, topk_mass);
  for (auto [t, name] : {std::pair{&queries, "queries"}, {&keys, "keys"}, {&values, "values"}})
    check_float_rows(*t, name);
  check_float_contiguous(centroids, "centroids");
  check_float_contiguous(centroid_values, "centroid_values");
  check_float_contiguous(topk_values, "topk_values");
  check_dtype(valid, at::kBool, "valid");
  TORCH_CHECK_VALUE(valid.is_contiguous() && valid.dim() == 2 && valid.size(0) == s.rows && valid.size(1) == s.n,
                    "valid must be a contiguous (R, N) bool tensor, got ", valid.sizes());
  const auto options = queries.options().dtype(at::kFloat);
  at::Tensor dq = zeros_tensor({s.rows, s.heads, s.n, s.dk}, options);
  at::Tensor dkeys = zeros_tensor({s.rows, s.heads, s.n, s.dk}, options);
  at::Tensor dvalues = zeros_tensor({s.rows, s.heads, s.n, s.dv}, options);
  at::Tensor dcent = zeros_tensor({s.rows, s.heads, s.clusters, s.dk}, options);
  at::Tensor dcv = zeros_tensor({s.rows, s.heads, s.clusters, s.dv}, options);
  at::Tensor dmass = zeros_tensor({s.rows, s.heads, s.clusters}, options);
  at::Tensor dtopv = zeros_tensor({s.rows, s.heads, s.clusters, s.dv}, options);
  const at::Tensor go = last_dim_contiguous(grad_out), qq = last_dim_contiguous(queries);
  const at::Tensor kk = last_dim_contiguous(keys), vv = last_dim_contiguous(values);
  const Rows gr = Rows::of(go), qr = Rows::of(qq), kr = Rows::of(kk), vr = Rows::of(vv);
  const bool* validp = valid.data_ptr<bool>();
  const int64_t* ap = assignments.data_ptr<int64_t>();
  const float* cp = centroids.data_ptr<float>();
  const float* cvp = centroid_values.data_ptr<float>();
  const int64_t* tip = topk_indices.data_ptr<int64_t>();
  const float* mp = topk_mass.data_ptr<float>();
  const float* tvp = topk_values.data_ptr<float>();
  const float sc = static_cast<float>(scaling);
  const float inf = std::numeric_limits<float>::infinity();
  const float tiny = std::numeric_limits<float>::min();
  const int64_t C = s.clusters, dk = s.dk, dv = s.dv, n = s.n, k = s.k;
  parallel_for(0, s.rows * s.heads, grain_for(n * std::max<int64_t>(k, 1) * (dk + dv) + n * C * dk),
               [&](int64_t begin, int64_t end) {
                 TopkCluster top;
                 std::vector<int64_t> slots(C * std::max<int64_t>(k, 1)), used(C), start, order, next;
                 // Per cluster: mean and variance of the other keys, their pre-clamp variance, the rest mean
                 // of the values, A_j, and the gradients gathered from the queries.
                 std::vector<float> mu(C * dk), var(C * dk), raw_var(C * dk), rm(C * dv), a(C), rest(C);
                 std::vector<float> count(C), d_a(C), d_mu(C * dk), d_var(C * dk), d_rm(C * dv);
                 std::vector<float> sum_k(dk), sum_k2(dk), e(dv), cscore(k);
                 std::vector<char> no_rest(C);
                 for (int64_t head = begin; head < end; ++head) {
                   const int64_t r = head / s.heads, h = head % s.heads;
                   const int64_t qo = head * n * dk, vo = head * n * dv;
                   // Key and value rows through their strides (ks, vs floats apart).
                   const float* K = kr.at<float>(r, h);
                   const float* V = vr.at<float>(r, h);
                   const int64_t ks = kr.s2, vs = vr.s2;
                   const bool* ok = validp + r * n;
                   float* dK = dkeys.data_ptr<float>() + qo;
                   float* dV = dvalues.data_ptr<float>() + vo;
                   int64_t n_valid = 0;
                   std::fill(sum_k.begin(), sum_k.end(), 0.f);
                   std::fill(sum_k2.begin(), sum_k2.end(), 0.f);
                   for (int64_t l = 0; l < n; ++l) {
                     if (!ok[l]) continue;
                     ++n_valid;
                     for (int64_t d = 0; d < dk; ++d) {
                       sum_k[d] += K[l * ks + d];
                       sum_k2[d] += K[l * ks + d] * K[l * ks + d];
                     }
                   }
                   // The cluster-level forward quantities.
                   for (int64_t c = 0; c < C; ++c) {
                     const int64_t* sl = &slots[c * k];
                     used[c] = cluster_slots(tip + (head * C + c) * k, k, n, &slots[c * k]);
                     const int64_t rest_count = n_valid - used[c];
                     no_rest[c] = rest_count <= 0;
                     count[c] = static_cast<float>(std::max<int64_t>(rest_count, 1));
                     for (int64_t d = 0; d < dk; ++d) {
                       float t1 = 0.f, t2 = 0.f;
                       for (int64_t u = 0; u < used[c]; ++u) {
                         const float x = K[sl[u] * ks + d];
                         t1 += x;
                         t2 += x * x;
                       }
                       const float m1 = (sum_k[d] - t1) / count[c];
                       const float m2 = (sum_k2[d] - t2) / count[c];
                       mu[c * dk + d] = m1;
                       raw_var[c * dk + d] = m2 - m1 * m1;
                       var[c * dk + d] = std::max(0.f, m2 - m1 * m1);
                     }
                     const float mass = mp[head * C + c];
                     rest[c] = 1.f - mass;
                     const bool safe = !no_rest[c] && rest[c] > 0.f;
                     for (int64_t d = 0; d < dv; ++d)
                       rm[c * dv + d] = no_rest[c] ? 0.f
                                                   : (cvp[(head * C + c) * dv + d] - tvp[(head * C + c) * dv + d]) /
                                                         (safe ? rest[c] : 1.f);
                     const float* cj = cp + (head * C + c) * dk;
                     for (int64_t u = 0; u < used[c]; ++u) cscore[u] = sc * dot(cj, K + sl[u] * ks, dk);
                     float lzc = -inf;
                     if (used[c] > 0) {
                       float top_score = cscore[0];
                       for (int64_t u = 1; u < used[c]; ++u) top_score = std::max(top_score, cscore[u]);
                       float total = 0.f;
                       for (int64_t u = 0; u < used[c]; ++u) total += std::exp(cscore[u] - top_score);
                       lzc = top_score + std::log(total);
                     }
                     float crest = 0.f;
                     for (int64_t d = 0; d < dk; ++d) crest += cj[d] * (mu[c * dk + d] + 0.5f * sc * var[c * dk + d] * cj[d]);
                     crest *= sc;
                     const float log_rest = rest[c] > 0.f ? std::log(rest[c]) : -inf;
                     const float log_odds = no_rest[c] ? -inf : log_rest - std::log(std::max(mass, tiny));
                     a[c] = log_odds + lzc - crest;
                   }
                   std::fill(d_a.begin(), d_a.end(), 0.f);
                   std::fill(d_mu.begin(), d_mu.end(), 0.f);
                   std::fill(d_var.begin(), d_var.end(), 0.f);
                   std::fill(d_rm.begin(), d_rm.end(), 0.f);
                   // Each cluster's members, in query order.
                   cluster_members(ap + head * n, n, C, start, order, next);
                   for (int64_t at = 0; at < start[C]; ++at) {
                     const int64_t i = order[at];
                     const int64_t c = ap[head * n + i];
                     if (at == start[c])
                       top.prepare<float>(HeadRows{reinterpret_cast<const char*>(K), ks * 4},
                                          HeadRows{reinterpret_cast<const char*>(V), vs * 4}, &slots[c * k], used[c],
                                          dk, dv);
                     const float* gi = gr.at<float>(r, h, i);
                     const float* qi = qr.at<float>(r, h, i);
                     float* dqi = dq.data_ptr<float>() + qo + i * dk;
                     const float lzq = top.forward(qi, sc, e.data());
                     float qrest = 0.f;
                     for (int64_t d = 0; d < dk; ++d) qrest += qi[d] * (mu[c * dk + d] + 0.5f * sc * var[c * dk + d] * qi[d]);
                     qrest *= sc;
                     // o = +inf without a slot (the centroid's row); A = -inf without rest (exact top-k part).
                     const float o = used[c] == 0 ? inf : a[c] - lzq + qrest;
                     const float own = 1.f / (1.f + std::exp(o));  // M_i = sigmoid(-o)
                     float d_own = 0.f;
                     for (int64_t d = 0; d < dv; ++d) d_own += gi[d] * (e[d] - rm[c * dv + d]);
                     axpy(1.f - own, gi, &d_rm[c * dv], dv);
                     const float d_o = std::isfinite(o) ? -d_own * own * (1.f - own) : 0.f;
                     d_a[c] += d_o;
                     // -lzq: its gradient goes to the scores through the softmax (dlse = -d_o).
                     top.backward(qi, sc, gi, own, -d_o, dqi);
                     if (d_o != 0.f) {
                       for (int64_t d = 0; d < dk; ++d) {
                         dqi[d] += d_o * sc * (mu[c * dk + d] + sc * var[c * dk + d] * qi[d]);
                         d_mu[c * dk + d] += d_o * sc * qi[d];
                         d_var[c * dk + d] += d_o * 0.5f * sc * sc * qi[d] * qi[d];
                       }
                     }
                     if (at + 1 == start[c + 1]) top.flush(dK, dV);  // the cluster's last member
                   }
                   // Each cluster, in index order: back through A_j, RM_j and the key statistics.
                   float* dcj_all = dcent.data_ptr<float>() + head * C * dk;
                   float* dcv_all = dcv.data_ptr<float>() + head * C * dv;
                   float* dtv_all = dtopv.data_ptr<float>() + head * C * dv;
                   float* dm_all = dmass.data_ptr<float>() + head * C;
                   std::fill(sum_k.begin(), sum_k.end(), 0.f);   // now: the gradient on sum over valid keys
                   std::fill(sum_k2.begin(), sum_k2.end(), 0.f);  // and on the sum of their squares
                   for (int64_t c = 0; c < C; ++c) {
                     const int64_t* sl = &slots[c * k];
                     const float* cj = cp + (head * C + c) * dk;
                     float* dcj = dcj_all + c * dk;
                     const float mass = mp[head * C + c];
                     const bool safe = !no_rest[c] && rest[c] > 0.f;
                     // RM_j = (Vc_j - Vtop_j) / rest_j
                     if (!no_rest[c]) {
                       const float inv = 1.f / (safe ? rest[c] : 1.f);
                       float d_rest = 0.f;
                       for (int64_t d = 0; d < dv; ++d) {
                         dcv_all[c * dv + d] += d_rm[c * dv + d] * inv;
                         dtv_all[c * dv + d] -= d_rm[c * dv + d] * inv;
                         d_rest -= d_rm[c * dv + d] * rm[c * dv + d] * inv;
                       }
                       if (safe) dm_all[c] -= d_rest;
                     }
                     const float da = d_a[c];
                     if (da == 0.f || !std::isfinite(a[c])) continue;
                     // log_odds = log(rest) - log(max(m, tiny)); rest = 1 - m
                     if (rest[c] > 0.f) dm_all[c] -= da / rest[c];
                     if (mass > tiny) dm_all[c] -= da / mass;
                     // lzc_j: softmax over the slots of the centroid's scores
                     for (int64_t u = 0; u < used[c]; ++u) cscore[u] = sc * dot(cj, K + sl[u] * ks, dk);
                     softmax_inplace(cscore.data(), used[c]);
                     for (int64_t u = 0; u < used[c]; ++u) {
                       axpy(sc * da * cscore[u], K + sl[u] * ks, dcj, dk);
                       axpy(sc * da * cscore[u], cj, dK + sl[u] * dk, dk);
                     }
                     // -crest_j
                     for (int64_t d = 0; d < dk; ++d) {
                       dcj[d] -= da * sc * (mu[c * dk + d] + sc * var[c * dk + d] * cj[d]);
                       d_mu[c * dk + d] -= da * sc * cj[d];
                       d_var[c * dk + d] -= da * 0.5f * sc * sc * cj[d] * cj[d];
                     }
                   }
                   // The key statistics: var = max(0, m2 - mu^2), mu = (S - S_T) / count, m2 = (S2 - S2_T) / count.
                   for (int64_t c = 0; c < C; ++c) {
                     const int64_t* sl = &slots[c * k];
                     for (int64_t d = 0; d < dk; ++d) {
                       const float dv_ = raw_var[c * dk + d] >= 0.f ? d_var[c * dk + d] : 0.f;
                       const float dmu = d_mu[c * dk + d] - 2.f * mu[c * dk + d] * dv_;
                       const float g1 = dmu / count[c], g2 = dv_ / count[c];
                       sum_k[d] += g1;
                       sum_k2[d] += g2;
                       for (int64_t u = 0; u < used[c]; ++u) {
                         const int64_t l = sl[u];
                         dK[l * dk + d] -= g1 + 2.f * K[l * ks + d] * g2;
                       }
                     }
                   }
                   for (int64_t l = 0; l < n; ++l) {
                     if (!ok[l]) continue;
                     for (int64_t d = 0; d < dk; ++d) dK[l * dk + d] += sum_k[d] + 2.f * K[l * ks + d] * sum_k2[d];
                   }
                 }
               });
  return {dq, dkeys, dvalues, dcent, dcv, dmass, dtopv};
}

}  // namespace bert_cluster
