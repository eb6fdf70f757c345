// Attention dropout inside the CPU kernels (issue 38, item 2): the centroids' attention over the keys
// outside their top-k (the op centroid_rest), and the dropout path of the two refinements, with each
// query's top-k weights dropped, and of the band: topk_refine, refine_with_query_mass and banded_attention
// with dropout != 0 (their entries in sparse.cpp, query_mass.cpp and banded.cpp call the *_dropped_cpu
// functions here), each with its backward. See reference.centroid_rest / topk_refine /
// refine_with_query_mass / banded_attention.
//
// The masks are the reference's, bit for bit: reference.dropout_uniforms is a counter-based hash of (seed,
// stream, row * H + head, first, second) -> 24-bit uniform, ported here (mix32), so a weight is kept iff
// its uniform >= dropout, whatever computes it; the backward draws the same masks again from the seed
// (nothing is saved: no mask, no N x N anything; per head the scratch is O(N * C) for centroid_rest and
// O(k + C * D) for the refinements).
//
// Deterministic: one task owns one (row, head) in every backward (and the forwards but the band's, whose
// tasks own disjoint queries), and each sum runs in a fixed order (keys in index order, centroids and
// top-k slots in index order), so the same inputs give the same bits at any thread count; no atomics.
// The kernels read float32 contiguous inputs: the ops' entries widen fp16/bf16 ones (float_rows, common.h; a
// no-op for inputs that are so already, as attention.dropped makes them once per call), as autograd through
// the reference computes in float32 too; outputs and gradients float32.
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
#include "vec.h"

namespace bert_cluster {
namespace {

constexpr uint32_t kQueryStream = 0, kCentroidStream = 1;  // reference.QUERY_STREAM, CENTROID_STREAM

// reference._mix32: C. Wellons' "lowbias32" (xor-shift-multiply), on 32-bit lanes.
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

// One call's dropout: keep a weight iff its uniform >= p, scaled by 1 / (1 - p).
struct Dropout {
  float p = 0.f, scale = 1.f;
  uint32_t key = 0;
  bool on = false;

  Dropout(double dropout, int64_t seed, uint32_t stream) {
    TORCH_CHECK_VALUE(dropout >= 0.0 && dropout < 1.0, "dropout must be in [0, 1), got ", dropout);
    on = dropout > 0.0;
    p = static_cast<float>(dropout);  // the reference compares float32 draws with it as float32
    scale = static_cast<float>(1.0 / (1.0 - dropout));
    const uint64_t s = static_cast<uint64_t>(seed);
    key = mix32(mix32(stream) ^ static_cast<uint32_t>(s >> 32));
    key = mix32(key ^ static_cast<uint32_t>(s));
  }
  // The hash state of one (row, head) (index row * H + head), then of one first position in it.
  uint32_t head(int64_t row_head) const { return mix32(key ^ static_cast<uint32_t>(row_head)); }
  static uint32_t first(uint32_t head_state, int64_t i) { return mix32(head_state ^ static_cast<uint32_t>(i)); }
  // The factor of the pair (first, second): 0 (dropped) or 1 / (1 - p).
  float factor(uint32_t first_state, int64_t second) const {
    if (!on) return 1.f;
    const uint32_t h = mix32(first_state ^ static_cast<uint32_t>(second));
    const float u = static_cast<float>(h >> 8) * (1.0f / 16777216.0f);
    return u >= p ? scale : 0.f;
  }
};

void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, name, " must be float32 with attention dropout, got ",
                   t.scalar_type());
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous with attention dropout");
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be a CPU tensor");
}

void check_long(const at::Tensor& t, const char* name) {
  check_dtype(t, at::kLong, name);
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous with attention dropout");
}

void check_mask(const at::Tensor& valid, int64_t rows, int64_t n) {
  check_dtype(valid, at::kBool, "valid");
  TORCH_CHECK_VALUE(valid.is_contiguous() && valid.dim() == 2 && valid.size(0) == rows && valid.size(1) == n,
                    "valid must be a contiguous (R, N) = (", rows, ", ", n, ") bool tensor, got ", valid.sizes());
}

void check_grad(const at::Tensor& g, int64_t r, int64_t h, int64_t n, int64_t d, const char* what) {
  check_float(g, "the output gradient");
  TORCH_CHECK_VALUE(g.dim() == 4 && g.size(0) == r && g.size(1) == h && g.size(2) == n && g.size(3) == d,
                    "the output gradient must be ", what, " = (", r, ", ", h, ", ", n, ", ", d, "), got ", g.sizes());
}

struct Qkv {
  int64_t rows, heads, n, dk, dv;
};

Qkv check_inputs(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values) {
  check_qkv(queries, keys, values);
  check_float(queries, "queries");
  check_float(keys, "keys");
  check_float(values, "values");
  return {queries.size(0), queries.size(1), queries.size(2), queries.size(3), values.size(3)};
}

inline void add_scaled(float* __restrict out, const float* __restrict x, float w, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] += w * x[i];
}

// out[0..d) += sum_{j < m} w[j] * rows[j * stride + 0..d), 16 columns at a time in a register (the rows in j
// order, their sum added to out once): the (key, centroid) loops' accumulations without a load and a store
// of out per row.
void combine(float* __restrict out, const float* __restrict w, const float* __restrict rows, int64_t stride,
             int64_t m, int64_t d) {
  int64_t col = 0;
  for (; col + 16 <= d; col += 16) {
    f32x16 acc = {};
    for (int64_t j = 0; j < m; ++j) acc += w[j] * load16(rows + j * stride + col);
    store16(out + col, load16(out + col) + acc);
  }
  for (; col < d; ++col) {
    float acc = 0.f;
    for (int64_t j = 0; j < m; ++j) acc += w[j] * rows[j * stride + col];
    out[col] += acc;
  }
}

// combine over m consecutive keys, skipping the padded ones (ok[u] == 0): their rows may hold anything,
// NaN included, and never enter a product.
void combine_keys(float* out, const float* w, const float* rows, int64_t stride, int64_t m, int64_t d,
                  const char* ok) {
  bool all = true;
  for (int64_t u = 0; u < m; ++u) all = all && ok[u];
  if (all) return combine(out, w, rows, stride, m, d);
  for (int64_t u = 0; u < m; ++u)
    if (ok[u]) combine(out, w + u, rows + u * stride, stride, 1, d);
}

// Keys are taken kChunk at a time where a centroid's sum over keys is blocked (combine's m).
constexpr int64_t kChunk = 16;
// Centroids are taken up to kMaxLanes at a time where a key's sum over centroids is blocked.
constexpr int64_t kMaxLanes = 64;

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

// The members of each cluster in query order (CSR: start[c]..start[c + 1] of order), padded queries out.
void cluster_members(const int64_t* assign, int64_t n, int64_t clusters, std::vector<int64_t>& start,
                     std::vector<int64_t>& order, std::vector<int64_t>& next) {
  start.assign(clusters + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t c = assign[i];
    if (c < 0) continue;
    TORCH_CHECK_VALUE(c < clusters, "assignments must be -1 or in 0..", clusters - 1, ", got ", c);
    ++start[c + 1];
  }
  for (int64_t c = 0; c < clusters; ++c) start[c + 1] += start[c];
  order.resize(start[clusters]);
  next.assign(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < n; ++i)
    if (assign[i] >= 0) order[next[assign[i]]++] = i;
}

// softmax of x[0..m) in place (max subtracted); returns log-sum-exp (-inf when m == 0).
float softmax_inplace(float* x, int64_t m) {
  if (m == 0) return kNegInf;
  const float top = max_of(x, m);
  const float total = exp_shift_sum(x, m, top);
  const float inv = 1.f / total;
  for (int64_t s = 0; s < m; ++s) x[s] *= inv;
  return top + std::log(total);
}

// ---------------------------------------------------------------------------------------------------
// centroid_rest: per (row, head), the scores of every valid key against all C centroids at once (the
// centroids transposed, C lanes), a softmax per centroid over the keys, the top-k keys' weights zeroed and
// the others dropped per (centroid, key); scratch (span, C) per head.

struct RestHead {
  int64_t c = 0, cp = 0, lo = 0, hi = 0, ns = 0, dk = 0, dv = 0;
  std::vector<float> ct, p;  // centroids transposed (dk, cp); weights (ns, cp), lane = centroid
  std::vector<char> key_ok;

  // Fills p with the softmax weights (0 on padded keys; a row without valid key: all 0). Returns whether
  // any key is valid.
  bool softmax(const float* cent, const float* keys, const bool* ok, float scaling) {
    cp = (c + 15) / 16 * 16;
    ns = std::max<int64_t>(hi - lo, 0);
    ct.assign(dk * cp, 0.f);
    for (int64_t j = 0; j < c; ++j)
      for (int64_t d = 0; d < dk; ++d) ct[d * cp + j] = cent[j * dk + d];
    p.assign(ns * cp, 0.f);
    key_ok.assign(ns, 0);
    const int64_t vectors = cp / 16;
    std::vector<f32x16> top(vectors, f32x16{} + kNegInf);
    bool any = false;
    for (int64_t l = lo; l < hi; ++l) {
      if (!ok[l]) continue;
      any = true;
      key_ok[l - lo] = 1;
      const float* key = keys + l * dk;
      float* row = p.data() + (l - lo) * cp;
      for (int64_t v = 0; v < vectors; ++v) {
        f32x16 acc = {};
        for (int64_t d = 0; d < dk; ++d) acc += key[d] * load16(ct.data() + d * cp + v * 16);
        acc = acc * scaling;
        store16(row + v * 16, acc);
        top[v] = select(acc > top[v], acc, top[v]);
      }
    }
    if (!any) return false;
    std::vector<f32x16> total(vectors, f32x16{});
    for (int64_t l = 0; l < ns; ++l) {
      if (!key_ok[l]) continue;
      float* row = p.data() + l * cp;
      for (int64_t v = 0; v < vectors; ++v) {
        const f32x16 e = fast_exp16(load16(row + v * 16) - top[v]);
        store16(row + v * 16, e);
        total[v] += e;
      }
    }
    for (int64_t v = 0; v < vectors; ++v) total[v] = 1.f / total[v];
    for (int64_t l = 0; l < ns; ++l) {
      if (!key_ok[l]) continue;
      float* row = p.data() + l * cp;
      for (int64_t v = 0; v < vectors; ++v) store16(row + v * 16, load16(row + v * 16) * total[v]);
    }
    return true;
  }

  // a[l * cp + j]: the factor of weight (centroid j, key l): 0 on its top-k keys, else the dropout's.
  void factors(const Dropout& drop, uint32_t head_state, const int64_t* topk, int64_t k, int64_t n,
               std::vector<float>& a) const {
    a.assign(ns * cp, 0.f);
    for (int64_t j = 0; j < c; ++j) {
      const uint32_t state = Dropout::first(head_state, j);
      for (int64_t l = 0; l < ns; ++l) a[l * cp + j] = drop.factor(state, l + lo);
      for (int64_t s = 0; s < k; ++s) {
        const int64_t l = topk[j * k + s];
        if (l < 0) continue;
        TORCH_CHECK_VALUE(l < n, "topk_indices must be -1 or in 0..", n - 1, ", got ", l);
        if (l >= lo && l < hi) a[(l - lo) * cp + j] = 0.f;
      }
    }
  }
};

struct RestArgs {
  int64_t rows, heads, n, c, k, dk, dv;
};

RestArgs check_rest(const at::Tensor& centroids, const at::Tensor& keys, const at::Tensor& values,
                    const at::Tensor& valid, const at::Tensor& topk_indices) {
  check_dim(centroids, 4, "centroids", "(R, H, C, Dk)");
  check_dim(keys, 4, "keys", "(R, H, N, Dk)");
  check_dim(values, 4, "values", "(R, H, N, Dv)");
  check_dim(topk_indices, 4, "topk_indices", "(R, H, C, k)");
  check_float(centroids, "centroids");
  check_float(keys, "keys");
  check_float(values, "values");
  check_long(topk_indices, "topk_indices");
  check_same_head_dim(centroids.size(3), keys.size(3));
  const RestArgs s{keys.size(0), keys.size(1), keys.size(2), centroids.size(2),
                   topk_indices.size(3), keys.size(3), values.size(3)};
  TORCH_CHECK_VALUE(centroids.size(0) == s.rows && centroids.size(1) == s.heads,
                    "centroids must be (R, H, C, Dk) with the keys' R, H, got ", centroids.sizes());
  TORCH_CHECK_VALUE(values.size(0) == s.rows && values.size(1) == s.heads && values.size(2) == s.n,
                    "values must be (R, H, N, Dv) with the keys' R, H, N, got ", values.sizes());
  TORCH_CHECK_VALUE(topk_indices.size(0) == s.rows && topk_indices.size(1) == s.heads && topk_indices.size(2) == s.c,
                    "topk_indices must be (R, H, C, k), got ", topk_indices.sizes());
  check_mask(valid, s.rows, s.n);
  return s;
}

}  // namespace

// centroid_rest on float32 contiguous inputs (the op's entry, centroid_rest_cpu below, makes them so).
static at::Tensor centroid_rest_rows(const at::Tensor& centroids, const at::Tensor& keys, const at::Tensor& values,
                                     const at::Tensor& valid, const at::Tensor& topk_indices, double scaling,
                                     double dropout, int64_t seed) {
  const RestArgs s = check_rest(centroids, keys, values, valid, topk_indices);
  const Dropout drop(dropout, seed, kCentroidStream);
  at::Tensor out = zeros_tensor({s.rows, s.heads, s.c, s.dv}, values.options());
  if (s.c == 0 || s.n == 0) return out;
  const float* cp = centroids.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  const bool* okp = valid.data_ptr<bool>();
  const int64_t* tip = topk_indices.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scaling);
  parallel_for(0, s.rows * s.heads, grain_for(s.n * s.c * (s.dk + s.dv)), [&](int64_t begin, int64_t end) {
    RestHead head;
    std::vector<float> a;
    for (int64_t rh = begin; rh < end; ++rh) {
      const int64_t r = rh / s.heads;
      const bool* ok = okp + r * s.n;
      int64_t lo = 0, hi = 0;
      valid_spans(ok, 1, s.n, &lo, &hi);
      head.c = s.c, head.lo = lo, head.hi = hi, head.dk = s.dk, head.dv = s.dv;
      if (!head.softmax(cp + rh * s.c * s.dk, kp + rh * s.n * s.dk, ok, sc)) continue;
      head.factors(drop, drop.head(rh), tip + rh * s.c * s.k, s.k, s.n, a);
      float* o = op + rh * s.c * s.dv;
      const float* V = vp + rh * s.n * s.dv;
      // W = P * A in place, then each centroid's sum over kChunk keys at a time (padded keys skipped).
      for (int64_t l = 0; l < head.ns * head.cp; ++l) head.p[l] *= a[l];
      float w[kChunk];
      for (int64_t l0 = 0; l0 < head.ns; l0 += kChunk) {
        const int64_t m = std::min(kChunk, head.ns - l0);
        for (int64_t j = 0; j < s.c; ++j) {
          for (int64_t u = 0; u < m; ++u) w[u] = head.p[(l0 + u) * head.cp + j];
          combine_keys(o + j * s.dv, w, V + (l0 + lo) * s.dv, s.dv, m, s.dv, head.key_ok.data() + l0);
        }
      }
    }
  });
  return out;
}

static std::tuple<at::Tensor, at::Tensor, at::Tensor> centroid_rest_backward_rows(
    const at::Tensor& grad, const at::Tensor& centroids, const at::Tensor& keys, const at::Tensor& values,
    const at::Tensor& valid, const at::Tensor& topk_indices, double scaling, double dropout, int64_t seed) {
  const RestArgs s = check_rest(centroids, keys, values, valid, topk_indices);
  check_grad(grad, s.rows, s.heads, s.c, s.dv, "(R, H, C, Dv)");
  const Dropout drop(dropout, seed, kCentroidStream);
  at::Tensor dcent = zeros_tensor({s.rows, s.heads, s.c, s.dk}, centroids.options());
  at::Tensor dkeys = zeros_tensor({s.rows, s.heads, s.n, s.dk}, keys.options());
  at::Tensor dvalues = zeros_tensor({s.rows, s.heads, s.n, s.dv}, values.options());
  if (s.c == 0 || s.n == 0) return {dcent, dkeys, dvalues};
  const float* gp = grad.data_ptr<float>();
  const float* cp = centroids.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  const bool* okp = valid.data_ptr<bool>();
  const int64_t* tip = topk_indices.data_ptr<int64_t>();
  const float sc = static_cast<float>(scaling);
  parallel_for(0, s.rows * s.heads, grain_for(2 * s.n * s.c * (s.dk + s.dv)), [&](int64_t begin, int64_t end) {
    RestHead head;
    std::vector<float> a, gt, dp;
    for (int64_t rh = begin; rh < end; ++rh) {
      const int64_t r = rh / s.heads;
      const bool* ok = okp + r * s.n;
      int64_t lo = 0, hi = 0;
      valid_spans(ok, 1, s.n, &lo, &hi);
      head.c = s.c, head.lo = lo, head.hi = hi, head.dk = s.dk, head.dv = s.dv;
      const float* cent = cp + rh * s.c * s.dk;
      const float* K = kp + rh * s.n * s.dk;
      const float* V = vp + rh * s.n * s.dv;
      const float* G = gp + rh * s.c * s.dv;
      if (!head.softmax(cent, K, ok, sc)) continue;
      head.factors(drop, drop.head(rh), tip + rh * s.c * s.k, s.k, s.n, a);
      const int64_t cpad = head.cp, vectors = cpad / 16;
      gt.assign(s.dv * cpad, 0.f);  // the output gradient transposed: (dv, cp)
      for (int64_t j = 0; j < s.c; ++j)
        for (int64_t d = 0; d < s.dv; ++d) gt[d * cpad + j] = G[j * s.dv + d];
      float* dC = dcent.data_ptr<float>() + rh * s.c * s.dk;
      float* dK = dkeys.data_ptr<float>() + rh * s.n * s.dk;
      float* dV = dvalues.data_ptr<float>() + rh * s.n * s.dv;
      // dW = G . V_l, dP = A * dW; the values' gradient sum_j P A G_j; the softmax's sum_l P dP per centroid.
      dp.assign(head.ns * cpad, 0.f);
      std::vector<f32x16> weighted(vectors, f32x16{});
      for (int64_t l = 0; l < head.ns; ++l) {
        if (!head.key_ok[l]) continue;
        const float* value = V + (l + lo) * s.dv;
        const float* prow = head.p.data() + l * cpad;
        const float* f = a.data() + l * cpad;
        float* drow = dp.data() + l * cpad;
        for (int64_t v = 0; v < vectors; ++v) {
          f32x16 acc = {};
          for (int64_t d = 0; d < s.dv; ++d) acc += value[d] * load16(gt.data() + d * cpad + v * 16);
          acc = acc * load16(f + v * 16);
          store16(drow + v * 16, acc);
          weighted[v] += load16(prow + v * 16) * acc;
        }
        float wrow[kMaxLanes];
        for (int64_t j0 = 0; j0 < s.c; j0 += kMaxLanes) {
          const int64_t m = std::min(kMaxLanes, s.c - j0);
          for (int64_t j = 0; j < m; ++j) wrow[j] = prow[j0 + j] * f[j0 + j];
          combine(dV + (l + lo) * s.dv, wrow, G + j0 * s.dv, s.dv, m, s.dv);
        }
      }
      // dS = s * P * (dP - sum P dP) (0 on padded keys: P is), then the keys' and centroids' gradients.
      for (int64_t l = 0; l < head.ns; ++l) {
        const float* prow = head.p.data() + l * cpad;
        float* drow = dp.data() + l * cpad;
        for (int64_t v = 0; v < vectors; ++v)
          store16(drow + v * 16, load16(prow + v * 16) * (load16(drow + v * 16) - weighted[v]) * sc);
        if (!head.key_ok[l]) continue;
        for (int64_t j0 = 0; j0 < s.c; j0 += kMaxLanes)
          combine(dK + (l + lo) * s.dk, drow + j0, cent + j0 * s.dk, s.dk, std::min(kMaxLanes, s.c - j0), s.dk);
      }
      float w[kChunk];
      for (int64_t l0 = 0; l0 < head.ns; l0 += kChunk) {
        const int64_t m = std::min(kChunk, head.ns - l0);
        for (int64_t j = 0; j < s.c; ++j) {
          for (int64_t u = 0; u < m; ++u) w[u] = dp[(l0 + u) * cpad + j];
          combine_keys(dC + j * s.dk, w, K + (l0 + lo) * s.dk, s.dk, m, s.dk, head.key_ok.data() + l0);
        }
      }
    }
  });
  return {dcent, dkeys, dvalues};
}

at::Tensor centroid_rest_cpu(const at::Tensor& centroids, const at::Tensor& keys, const at::Tensor& values,
                             const at::Tensor& valid, const at::Tensor& topk_indices, double scaling, double dropout,
                             int64_t seed) {
  return centroid_rest_rows(float_rows(centroids), float_rows(keys), float_rows(values), valid.contiguous(),
                            topk_indices.contiguous(), scaling, dropout, seed);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> centroid_rest_backward_cpu(
    const at::Tensor& grad, const at::Tensor& centroids, const at::Tensor& keys, const at::Tensor& values,
    const at::Tensor& valid, const at::Tensor& topk_indices, double scaling, double dropout, int64_t seed) {
  return centroid_rest_backward_rows(float_rows(grad), float_rows(centroids), float_rows(keys), float_rows(values),
                                     valid.contiguous(), topk_indices.contiguous(), scaling, dropout, seed);
}

namespace {

// ---------------------------------------------------------------------------------------------------
// The refinements: one cluster's top-k keys prepared once (widened rows and transposed), then each member
// query: P = softmax(s q.K_l) over the slots, E = sum_u P_u D_u V_u with D the query's dropout factors.

struct TopkDrop {
  int64_t m = 0, kp = 0, dk = 0, dv = 0;
  const int64_t* slots = nullptr;
  std::vector<float> kr, vr, kt, vt, p, f, gv, dkr, dvr;

  void prepare(const float* keys, const float* values, const int64_t* sl, int64_t used, int64_t dk_, int64_t dv_) {
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
    f.assign(kp, 0.f);
    gv.assign(kp, 0.f);
    dkr.assign(m * dk, 0.f);
    dvr.assign(m * dv, 0.f);
    for (int64_t u = 0; u < m; ++u) {
      const float* key = keys + sl[u] * dk;
      const float* value = values + sl[u] * dv;
      for (int64_t d = 0; d < dk; ++d) kt[d * kp + u] = kr[u * dk + d] = key[d];
      for (int64_t d = 0; d < dv; ++d) vt[d * kp + u] = vr[u * dv + d] = value[d];
    }
  }

  // out[0..kp) = sum_d x[d] * t[d * kp + 0..kp)
  void slot_products(const float* x, const float* t, int64_t d_count, float* out) const {
    for (int64_t base = 0; base < kp; base += 32) {  // two independent chains where there are 32 slots
      const bool pair = base + 16 < kp;
      f32x16 a0 = {}, a1 = {};
      for (int64_t d = 0; d < d_count; ++d) {
        a0 += x[d] * load16(t + d * kp + base);
        if (pair) a1 += x[d] * load16(t + d * kp + base + 16);
      }
      store16(out + base, a0);
      if (pair) store16(out + base + 16, a1);
    }
  }

  // Fills p (softmax) and f (the query's dropout factors), e = sum P D V; returns log-sum-exp.
  float forward(const float* q, float scaling, const Dropout& drop, uint32_t query_state, float* e) {
    if (kp > 0) slot_products(q, kt.data(), dk, p.data());
    for (int64_t u = 0; u < m; ++u) p[u] *= scaling;
    const float lse = softmax_inplace(p.data(), m);
    for (int64_t u = 0; u < m; ++u) f[u] = drop.factor(query_state, slots[u]);
    std::fill(e, e + dv, 0.f);
    for (int64_t u = 0; u < m; ++u) add_scaled(e, vr.data() + u * dv, p[u] * f[u], dv);
    return lse;
  }

  // After forward: dE = scale_e * g; dlse: a gradient on the log-sum-exp of the scores.
  void backward(const float* q, float scaling, const float* g, float scale_e, float dlse, float* dq) {
    if (kp > 0) slot_products(g, vt.data(), dv, gv.data());
    float weighted = 0.f;
    for (int64_t u = 0; u < m; ++u) {
      gv[u] *= scale_e * f[u];  // dP_u
      weighted += p[u] * gv[u];
    }
    for (int64_t u = 0; u < m; ++u) {
      const float ds = scaling * (p[u] * (gv[u] - weighted) + dlse * p[u]);
      add_scaled(dkr.data() + u * dk, q, ds, dk);
      add_scaled(dvr.data() + u * dv, g, scale_e * p[u] * f[u], dv);
      add_scaled(dq, kr.data() + u * dk, ds, dk);
    }
  }

  void flush(float* dkeys, float* dvalues) const {
    for (int64_t u = 0; u < m; ++u) {
      add_scaled(dkeys + slots[u] * dk, dkr.data() + u * dk, 1.f, dk);
      add_scaled(dvalues + slots[u] * dv, dvr.data() + u * dv, 1.f, dv);
    }
  }
};

struct RefineArgs {
  int64_t rows, heads, n, dk, dv, c, k;
};

RefineArgs check_refine(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
                        const at::Tensor& assignments, const at::Tensor& topk_indices, const at::Tensor& topk_mass) {
  const Qkv s = check_inputs(queries, keys, values);
  check_long(assignments, "assignments");
  check_long(topk_indices, "topk_indices");
  check_float(topk_mass, "topk_mass");
  check_dim(assignments, 3, "assignments", "(R, H, N)");
  check_dim(topk_indices, 4, "topk_indices", "(R, H, C, k)");
  check_dim(topk_mass, 3, "topk_mass", "(R, H, C)");
  const RefineArgs a{s.rows, s.heads, s.n, s.dk, s.dv, topk_indices.size(2), topk_indices.size(3)};
  TORCH_CHECK_VALUE(assignments.size(0) == a.rows && assignments.size(1) == a.heads && assignments.size(2) == a.n,
                    "assignments must be (R, H, N), got ", assignments.sizes());
  TORCH_CHECK_VALUE(topk_indices.size(0) == a.rows && topk_indices.size(1) == a.heads,
                    "topk_indices must be (R, H, C, k), got ", topk_indices.sizes());
  TORCH_CHECK_VALUE(topk_mass.size(0) == a.rows && topk_mass.size(1) == a.heads && topk_mass.size(2) == a.c,
                    "topk_mass must be (R, H, C), got ", topk_mass.sizes());
  return a;
}

void check_cluster_rows(const at::Tensor& t, const RefineArgs& a, int64_t d, const char* name) {
  check_float(t, name);
  TORCH_CHECK_VALUE(t.dim() == 4 && t.size(0) == a.rows && t.size(1) == a.heads && t.size(2) == a.c && t.size(3) == d,
                    name, " must be (R, H, C, D) = (", a.rows, ", ", a.heads, ", ", a.c, ", ", d, "), got ", t.sizes());
}

// topk_refine with dropout, forward (grad == nullptr) or backward, on one (row, head).
struct TopkRefineJob {
  RefineArgs a;
  const float *q, *k, *v, *cv, *tv, *mass, *g;
  const int64_t *assign, *topk;
  float scaling;
  const Dropout* drop;
  float *out, *dq, *dk, *dv, *dcv, *dmass;
};

void topk_refine_head(const TopkRefineJob& job, int64_t rh, TopkDrop& top, std::vector<int64_t>& slots,
                      std::vector<int64_t>& start, std::vector<int64_t>& order, std::vector<int64_t>& next,
                      std::vector<float>& e) {
  const RefineArgs& a = job.a;
  const int64_t qo = rh * a.n * a.dk, vo = rh * a.n * a.dv;
  cluster_members(job.assign + rh * a.n, a.n, a.c, start, order, next);
  const uint32_t head_state = job.drop->head(rh);
  for (int64_t c = 0; c < a.c; ++c) {
    if (start[c] == start[c + 1]) continue;
    const int64_t used = cluster_slots(job.topk + (rh * a.c + c) * a.k, a.k, a.n, slots.data());
    top.prepare(job.k + qo, job.v + vo, slots.data(), used, a.dk, a.dv);
    const float mass = job.mass[rh * a.c + c];
    for (int64_t o = start[c]; o < start[c + 1]; ++o) {
      const int64_t i = order[o];
      const float* qi = job.q + qo + i * a.dk;
      top.forward(qi, job.scaling, *job.drop, Dropout::first(head_state, i), e.data());
      if (job.g == nullptr) {
        float* out = job.out + vo + i * a.dv;
        const float* cv = job.cv + (rh * a.c + c) * a.dv;
        const float* tv = job.tv + (rh * a.c + c) * a.dv;
        for (int64_t d = 0; d < a.dv; ++d) out[d] = (cv[d] - tv[d]) + mass * e[d];
        continue;
      }
      const float* gi = job.g + vo + i * a.dv;
      add_scaled(job.dcv + (rh * a.c + c) * a.dv, gi, 1.f, a.dv);
      job.dmass[rh * a.c + c] += dot(gi, e.data(), a.dv);
      top.backward(qi, job.scaling, gi, mass, 0.f, job.dq + qo + i * a.dk);
    }
    if (job.g != nullptr) top.flush(job.dk + qo, job.dv + vo);
  }
}

void run_topk_refine(const TopkRefineJob& job) {
  const RefineArgs& a = job.a;
  parallel_for(0, a.rows * a.heads, grain_for(a.n * std::max<int64_t>(a.k, 1) * (a.dk + a.dv)),
               [&](int64_t begin, int64_t end) {
                 TopkDrop top;
                 std::vector<int64_t> slots(std::max<int64_t>(a.k, 1)), start, order, next;
                 std::vector<float> e(a.dv);
                 for (int64_t rh = begin; rh < end; ++rh) topk_refine_head(job, rh, top, slots, start, order, next, e);
               });
}

}  // namespace

at::Tensor topk_refine_dropped_cpu(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
                                   const at::Tensor& assignments, const at::Tensor& centroid_values,
                                   const at::Tensor& topk_indices, const at::Tensor& topk_mass,
                                   const at::Tensor& topk_values, double scaling, double dropout, int64_t seed) {
  const RefineArgs a = check_refine(queries, keys, values, assignments, topk_indices, topk_mass);
  check_cluster_rows(centroid_values, a, a.dv, "centroid_values");
  check_cluster_rows(topk_values, a, a.dv, "topk_values");
  const Dropout drop(dropout, seed, kQueryStream);
  at::Tensor out = zeros_tensor({a.rows, a.heads, a.n, a.dv}, values.options());
  TopkRefineJob job{a,
                    queries.data_ptr<float>(),
                    keys.data_ptr<float>(),
                    values.data_ptr<float>(),
                    centroid_values.data_ptr<float>(),
                    topk_values.data_ptr<float>(),
                    topk_mass.data_ptr<float>(),
                    nullptr,
                    assignments.data_ptr<int64_t>(),
                    topk_indices.data_ptr<int64_t>(),
                    static_cast<float>(scaling),
                    &drop,
                    out.data_ptr<float>(),
                    nullptr,
                    nullptr,
                    nullptr,
                    nullptr,
                    nullptr};
  run_topk_refine(job);
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> topk_refine_backward_dropped_cpu(
    const at::Tensor& grad_out, const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
    const at::Tensor& assignments, const at::Tensor& topk_indices, const at::Tensor& topk_mass, double scaling,
    double dropout, int64_t seed) {
  const RefineArgs a = check_refine(queries, keys, values, assignments, topk_indices, topk_mass);
  check_grad(grad_out, a.rows, a.heads, a.n, a.dv, "(R, H, N, Dv)");
  const Dropout drop(dropout, seed, kQueryStream);
  const auto options = values.options();
  at::Tensor dq = zeros_tensor({a.rows, a.heads, a.n, a.dk}, options);
  at::Tensor dk = zeros_tensor({a.rows, a.heads, a.n, a.dk}, options);
  at::Tensor dv = zeros_tensor({a.rows, a.heads, a.n, a.dv}, options);
  at::Tensor dcv = zeros_tensor({a.rows, a.heads, a.c, a.dv}, options);
  at::Tensor dmass = zeros_tensor({a.rows, a.heads, a.c}, options);
  TopkRefineJob job{a,
                    queries.data_ptr<float>(),
                    keys.data_ptr<float>(),
                    values.data_ptr<float>(),
                    nullptr,
                    nullptr,
                    topk_mass.data_ptr<float>(),
                    grad_out.data_ptr<float>(),
                    assignments.data_ptr<int64_t>(),
                    topk_indices.data_ptr<int64_t>(),
                    static_cast<float>(scaling),
                    &drop,
                    nullptr,
                    dq.data_ptr<float>(),
                    dk.data_ptr<float>(),
                    dv.data_ptr<float>(),
                    dcv.data_ptr<float>(),
                    dmass.data_ptr<float>()};
  run_topk_refine(job);
  return {dq, dk, dv, dcv, dmass, dcv.neg()};
}

namespace {

// ---------------------------------------------------------------------------------------------------
// refine_with_query_mass with dropout (names as in backward.cpp and the reference): per cluster j the key
// statistics outside T_j, A_j; per query o_i = A_j - lzq_i + qrest_i, M_i = sigmoid(-o_i),
// out_i = M_i E_i + (1 - M_i) RM_j, with E_i = sum P D V (the query's top-k weights dropped).

struct PlusHead {
  int64_t C, dk, dv, n, k;
  std::vector<int64_t> slots, used;
  std::vector<float> mu, var, raw_var, rm, a, rest, count, sum_k, sum_k2, cscore;
  std::vector<char> no_rest;
  int64_t n_valid = 0;

  PlusHead(int64_t C_, int64_t dk_, int64_t dv_, int64_t n_, int64_t k_)
      : C(C_), dk(dk_), dv(dv_), n(n_), k(k_), slots(C_ * std::max<int64_t>(k_, 1)), used(C_), mu(C_ * dk_),
        var(C_ * dk_), raw_var(C_ * dk_), rm(C_ * dv_), a(C_), rest(C_), count(C_), sum_k(dk_), sum_k2(dk_),
        cscore(std::max<int64_t>(k_, 1)), no_rest(C_) {}

  void prepare(const float* K, const bool* ok, const float* cent, const float* cv, const float* tv,
               const float* mass, const int64_t* topk, float sc) {
    const float inf = std::numeric_limits<float>::infinity();
    const float tiny = std::numeric_limits<float>::min();
    n_valid = 0;
    std::fill(sum_k.begin(), sum_k.end(), 0.f);
    std::fill(sum_k2.begin(), sum_k2.end(), 0.f);
    for (int64_t l = 0; l < n; ++l) {
      if (!ok[l]) continue;
      ++n_valid;
      for (int64_t d = 0; d < dk; ++d) {
        sum_k[d] += K[l * dk + d];
        sum_k2[d] += K[l * dk + d] * K[l * dk + d];
      }
    }
    for (int64_t c = 0; c < C; ++c) {
      const int64_t* sl = &slots[c * k];
      used[c] = cluster_slots(topk + c * k, k, n, &slots[c * k]);
      const int64_t rest_count = n_valid - used[c];
      no_rest[c] = rest_count <= 0;
      count[c] = static_cast<float>(std::max<int64_t>(rest_count, 1));
      for (int64_t d = 0; d < dk; ++d) {
        float t1 = 0.f, t2 = 0.f;
        for (int64_t u = 0; u < used[c]; ++u) {
          const float x = K[sl[u] * dk + d];
          t1 += x;
          t2 += x * x;
        }
        const float m1 = (sum_k[d] - t1) / count[c];
        const float m2 = (sum_k2[d] - t2) / count[c];
        mu[c * dk + d] = m1;
        raw_var[c * dk + d] = m2 - m1 * m1;
        var[c * dk + d] = std::max(0.f, m2 - m1 * m1);
      }
      rest[c] = 1.f - mass[c];
      const bool safe = !no_rest[c] && rest[c] > 0.f;
      for (int64_t d = 0; d < dv; ++d)
        rm[c * dv + d] = no_rest[c] ? 0.f : (cv[c * dv + d] - tv[c * dv + d]) / (safe ? rest[c] : 1.f);
      const float* cj = cent + c * dk;
      for (int64_t u = 0; u < used[c]; ++u) cscore[u] = sc * dot(cj, K + sl[u] * dk, dk);
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
      const float log_odds = no_rest[c] ? -inf : log_rest - std::log(std::max(mass[c], tiny));
      a[c] = log_odds + lzc - crest;
    }
  }

  float query_rest(const float* qi, int64_t c, float sc) const {
    float qrest = 0.f;
    for (int64_t d = 0; d < dk; ++d) qrest += qi[d] * (mu[c * dk + d] + 0.5f * sc * var[c * dk + d] * qi[d]);
    return qrest * sc;
  }
};

struct PlusArgs {
  RefineArgs a;
  const float *q, *k, *v, *cent, *cv, *mass, *tv;
  const bool* valid;
  const int64_t *assign, *topk;
  float scaling;
};

void check_plus(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& valid,
                const at::Tensor& assignments, const at::Tensor& centroids, const at::Tensor& centroid_values,
                const at::Tensor& topk_indices, const at::Tensor& topk_mass, const at::Tensor& topk_values,
                RefineArgs& a) {
  a = check_refine(queries, keys, values, assignments, topk_indices, topk_mass);
  check_mask(valid, a.rows, a.n);
  check_cluster_rows(centroids, a, a.dk, "centroids");
  check_cluster_rows(centroid_values, a, a.dv, "centroid_values");
  check_cluster_rows(topk_values, a, a.dv, "topk_values");
}

PlusArgs plus_args(const RefineArgs& a, const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
                   const at::Tensor& valid, const at::Tensor& assignments, const at::Tensor& centroids,
                   const at::Tensor& centroid_values, const at::Tensor& topk_indices, const at::Tensor& topk_mass,
                   const at::Tensor& topk_values, double scaling) {
  return {a,
          queries.data_ptr<float>(),
          keys.data_ptr<float>(),
          values.data_ptr<float>(),
          centroids.data_ptr<float>(),
          centroid_values.data_ptr<float>(),
          topk_mass.data_ptr<float>(),
          topk_values.data_ptr<float>(),
          valid.data_ptr<bool>(),
          assignments.data_ptr<int64_t>(),
          topk_indices.data_ptr<int64_t>(),
          static_cast<float>(scaling)};
}

}  // namespace

at::Tensor refine_with_query_mass_dropped_cpu(const at::Tensor& queries, const at::Tensor& keys,
                                              const at::Tensor& values, const at::Tensor& valid,
                                              const at::Tensor& assignments, const at::Tensor& centroids,
                                              const at::Tensor& centroid_values, const at::Tensor& topk_indices,
                                              const at::Tensor& topk_mass, const at::Tensor& topk_values,
                                              double scaling, double dropout, int64_t seed) {
  RefineArgs a{};
  check_plus(queries, keys, values, valid, assignments, centroids, centroid_values, topk_indices, topk_mass,
             topk_values, a);
  const PlusArgs p = plus_args(a, queries, keys, values, valid, assignments, centroids, centroid_values,
                               topk_indices, topk_mass, topk_values, scaling);
  const Dropout drop(dropout, seed, kQueryStream);
  at::Tensor out = zeros_tensor({a.rows, a.heads, a.n, a.dv}, values.options());
  float* op = out.data_ptr<float>();
  const float inf = std::numeric_limits<float>::infinity();
  const int64_t C = a.c, dk = a.dk, dv = a.dv, n = a.n, k = a.k;
  parallel_for(0, a.rows * a.heads, grain_for(n * std::max<int64_t>(k, 1) * (dk + dv) + n * C * dk),
               [&](int64_t begin, int64_t end) {
                 PlusHead head(C, dk, dv, n, k);
                 TopkDrop top;
                 std::vector<int64_t> start, order, next;
                 std::vector<float> e(dv);
                 for (int64_t rh = begin; rh < end; ++rh) {
                   const int64_t r = rh / a.heads, qo = rh * n * dk, vo = rh * n * dv;
                   const float* K = p.k + qo;
                   head.prepare(K, p.valid + r * n, p.cent + rh * C * dk, p.cv + rh * C * dv, p.tv + rh * C * dv,
                                p.mass + rh * C, p.topk + rh * C * k, p.scaling);
                   const uint32_t head_state = drop.head(rh);
                   cluster_members(p.assign + rh * n, n, C, start, order, next);
                   for (int64_t c = 0; c < C; ++c) {
                     if (start[c] == start[c + 1]) continue;
                     top.prepare(K, p.v + vo, &head.slots[c * k], head.used[c], dk, dv);
                     for (int64_t o = start[c]; o < start[c + 1]; ++o) {
                       const int64_t i = order[o];
                       const float* qi = p.q + qo + i * dk;
                       const float lzq = top.forward(qi, p.scaling, drop, Dropout::first(head_state, i), e.data());
                       const float o_i =
                           head.used[c] == 0 ? inf : head.a[c] - lzq + head.query_rest(qi, c, p.scaling);
                       const float own = 1.f / (1.f + std::exp(o_i));
                       float* out = op + vo + i * dv;
                       for (int64_t d = 0; d < dv; ++d) out[d] = own * e[d] + (1.f - own) * head.rm[c * dv + d];
                     }
                   }
                 }
               });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
refine_with_query_mass_backward_dropped_cpu(const at::Tensor& grad_out, const at::Tensor& queries,
                                            const at::Tensor& keys, const at::Tensor& values, const at::Tensor& valid,
                                            const at::Tensor& assignments, const at::Tensor& centroids,
                                            const at::Tensor& centroid_values, const at::Tensor& topk_indices,
                                            const at::Tensor& topk_mass, const at::Tensor& topk_values,
                                            double scaling, double dropout, int64_t seed) {
  RefineArgs a{};
  check_plus(queries, keys, values, valid, assignments, centroids, centroid_values, topk_indices, topk_mass,
             topk_values, a);
  check_grad(grad_out, a.rows, a.heads, a.n, a.dv, "(R, H, N, Dv)");
  const PlusArgs p = plus_args(a, queries, keys, values, valid, assignments, centroids, centroid_values,
                               topk_indices, topk_mass, topk_values, scaling);
  const Dropout drop(dropout, seed, kQueryStream);
  const auto options = values.options();
  const int64_t C = a.c, dk = a.dk, dv = a.dv, n = a.n, k = a.k;
  at::Tensor dq = zeros_tensor({a.rows, a.heads, n, dk}, options);
  at::Tensor dkeys = zeros_tensor({a.rows, a.heads, n, dk}, options);
  at::Tensor dvalues = zeros_tensor({a.rows, a.heads, n, dv}, options);
  at::Tensor dcent = zeros_tensor({a.rows, a.heads, C, dk}, options);
  at::Tensor dcv = zeros_tensor({a.rows, a.heads, C, dv}, options);
  at::Tensor dmass = zeros_tensor({a.rows, a.heads, C}, options);
  at::Tensor dtopv = zeros_tensor({a.rows, a.heads, C, dv}, options);
  const float* g = grad_out.data_ptr<float>();
  const float inf = std::numeric_limits<float>::infinity();
  const float tiny = std::numeric_limits<float>::min();
  const float sc = p.scaling;
  parallel_for(0, a.rows * a.heads, grain_for(2 * n * std::max<int64_t>(k, 1) * (dk + dv) + n * C * dk),
               [&](int64_t begin, int64_t end) {
                 PlusHead head(C, dk, dv, n, k);
                 TopkDrop top;
                 std::vector<int64_t> start, order, next;
                 std::vector<float> e(dv), d_a(C), d_mu(C * dk), d_var(C * dk), d_rm(C * dv);
                 for (int64_t rh = begin; rh < end; ++rh) {
                   const int64_t r = rh / a.heads, qo = rh * n * dk, vo = rh * n * dv;
                   const float* K = p.k + qo;
                   const bool* ok = p.valid + r * n;
                   const float* cent = p.cent + rh * C * dk;
                   const float* mass = p.mass + rh * C;
                   float* dK = dkeys.data_ptr<float>() + qo;
                   float* dV = dvalues.data_ptr<float>() + vo;
                   head.prepare(K, ok, cent, p.cv + rh * C * dv, p.tv + rh * C * dv, mass, p.topk + rh * C * k, sc);
                   const uint32_t head_state = drop.head(rh);
                   std::fill(d_a.begin(), d_a.end(), 0.f);
                   std::fill(d_mu.begin(), d_mu.end(), 0.f);
                   std::fill(d_var.begin(), d_var.end(), 0.f);
                   std::fill(d_rm.begin(), d_rm.end(), 0.f);
                   cluster_members(p.assign + rh * n, n, C, start, order, next);
                   for (int64_t c = 0; c < C; ++c) {
                     if (start[c] == start[c + 1]) continue;
                     top.prepare(K, p.v + vo, &head.slots[c * k], head.used[c], dk, dv);
                     for (int64_t at = start[c]; at < start[c + 1]; ++at) {
                       const int64_t i = order[at];
                       const float* gi = g + vo + i * dv;
                       const float* qi = p.q + qo + i * dk;
                       float* dqi = dq.data_ptr<float>() + qo + i * dk;
                       const float lzq = top.forward(qi, sc, drop, Dropout::first(head_state, i), e.data());
                       const float o = head.used[c] == 0 ? inf : head.a[c] - lzq + head.query_rest(qi, c, sc);
                       const float own = 1.f / (1.f + std::exp(o));
                       float d_own = 0.f;
                       for (int64_t d = 0; d < dv; ++d) d_own += gi[d] * (e[d] - head.rm[c * dv + d]);
                       add_scaled(&d_rm[c * dv], gi, 1.f - own, dv);
                       const float d_o = std::isfinite(o) ? -d_own * own * (1.f - own) : 0.f;
                       d_a[c] += d_o;
                       top.backward(qi, sc, gi, own, -d_o, dqi);
                       if (d_o != 0.f) {
                         for (int64_t d = 0; d < dk; ++d) {
                           dqi[d] += d_o * sc * (head.mu[c * dk + d] + sc * head.var[c * dk + d] * qi[d]);
                           d_mu[c * dk + d] += d_o * sc * qi[d];
                           d_var[c * dk + d] += d_o * 0.5f * sc * sc * qi[d] * qi[d];
                         }
                       }
                     }
                     top.flush(dK, dV);
                   }
                   float* dcj_all = dcent.data_ptr<float>() + rh * C * dk;
                   float* dcv_all = dcv.data_ptr<float>() + rh * C * dv;
                   float* dtv_all = dtopv.data_ptr<float>() + rh * C * dv;
                   float* dm_all = dmass.data_ptr<float>() + rh * C;
                   std::vector<float>& sum_k = head.sum_k;  // now: the gradient on the sums over valid keys
                   std::vector<float>& sum_k2 = head.sum_k2;
                   std::fill(sum_k.begin(), sum_k.end(), 0.f);
                   std::fill(sum_k2.begin(), sum_k2.end(), 0.f);
                   for (int64_t c = 0; c < C; ++c) {
                     const int64_t* sl = &head.slots[c * k];
                     const float* cj = cent + c * dk;
                     float* dcj = dcj_all + c * dk;
                     const float rest = head.rest[c];
                     const bool safe = !head.no_rest[c] && rest > 0.f;
                     if (!head.no_rest[c]) {
                       const float inv = 1.f / (safe ? rest : 1.f);
                       float d_rest = 0.f;
                       for (int64_t d = 0; d < dv; ++d) {
                         dcv_all[c * dv + d] += d_rm[c * dv + d] * inv;
                         dtv_all[c * dv + d] -= d_rm[c * dv + d] * inv;
                         d_rest -= d_rm[c * dv + d] * head.rm[c * dv + d] * inv;
                       }
                       if (safe) dm_all[c] -= d_rest;
                     }
                     const float da = d_a[c];
                     if (da == 0.f || !std::isfinite(head.a[c])) continue;
                     if (rest > 0.f) dm_all[c] -= da / rest;
                     if (mass[c] > tiny) dm_all[c] -= da / mass[c];
                     std::vector<float>& cscore = head.cscore;
                     for (int64_t u = 0; u < head.used[c]; ++u) cscore[u] = sc * dot(cj, K + sl[u] * dk, dk);
                     if (head.used[c] > 0) {
                       float top_score = cscore[0];
                       for (int64_t u = 1; u < head.used[c]; ++u) top_score = std::max(top_score, cscore[u]);
                       float total = 0.f;
                       for (int64_t u = 0; u < head.used[c]; ++u) total += (cscore[u] = std::exp(cscore[u] - top_score));
                       for (int64_t u = 0; u < head.used[c]; ++u) cscore[u] /= total;
                     }
                     for (int64_t u = 0; u < head.used[c]; ++u) {
                       add_scaled(dcj, K + sl[u] * dk, sc * da * cscore[u], dk);
                       add_scaled(dK + sl[u] * dk, cj, sc * da * cscore[u], dk);
                     }
                     for (int64_t d = 0; d < dk; ++d) {
                       dcj[d] -= da * sc * (head.mu[c * dk + d] + sc * head.var[c * dk + d] * cj[d]);
                       d_mu[c * dk + d] -= da * sc * cj[d];
                       d_var[c * dk + d] -= da * 0.5f * sc * sc * cj[d] * cj[d];
                     }
                   }
                   for (int64_t c = 0; c < C; ++c) {
                     const int64_t* sl = &head.slots[c * k];
                     for (int64_t d = 0; d < dk; ++d) {
                       const float dvar = head.raw_var[c * dk + d] >= 0.f ? d_var[c * dk + d] : 0.f;
                       const float dmu = d_mu[c * dk + d] - 2.f * head.mu[c * dk + d] * dvar;
                       const float g1 = dmu / head.count[c], g2 = dvar / head.count[c];
                       sum_k[d] += g1;
                       sum_k2[d] += g2;
                       for (int64_t u = 0; u < head.used[c]; ++u) {
                         const int64_t l = sl[u];
                         dK[l * dk + d] -= g1 + 2.f * K[l * dk + d] * g2;
                       }
                     }
                   }
                   for (int64_t l = 0; l < n; ++l) {
                     if (!ok[l]) continue;
                     for (int64_t d = 0; d < dk; ++d) dK[l * dk + d] += sum_k[d] + 2.f * K[l * dk + d] * sum_k2[d];
                   }
                 }
               });
  return {dq, dkeys, dvalues, dcent, dcv, dmass, dtopv};
}

// ---------------------------------------------------------------------------------------------------
// banded_attention with dropout: query i sees key j iff |i - j| <= window and j is valid; its weights
// dropped per (query, key). Forward: one task per (row, head, 64 queries); backward: one per (row, head).

namespace {

struct BandArgs {
  Qkv s;
  const float *q, *k, *v;
  const bool* valid;
  int64_t window;
  float scaling;
};

// The band of query i: its visible keys' softmax weights p[0..m) and factors f (keys lo + u, u < width,
// visible[u] tells which); returns false when the query sees no key.
bool band_weights(const BandArgs& b, int64_t rh, int64_t i, const Dropout& drop, uint32_t head_state, int64_t& lo,
                  int64_t& width, std::vector<float>& p, std::vector<float>& f, std::vector<char>& visible) {
  const int64_t n = b.s.n, dk = b.s.dk;
  const bool* ok = b.valid + (rh / b.s.heads) * n;
  lo = std::max<int64_t>(0, i - b.window);
  const int64_t hi = i + std::min<int64_t>(b.window, n) + 1 < n ? i + std::min<int64_t>(b.window, n) + 1 : n;
  width = hi - lo;
  p.resize(std::max<int64_t>(width, 1));
  f.resize(std::max<int64_t>(width, 1));
  visible.resize(std::max<int64_t>(width, 1));
  const float* qi = b.q + (rh * n + i) * dk;
  const float* K = b.k + rh * n * dk;
  float top = kNegInf;
  bool any = false;
  for (int64_t u = 0; u < width; ++u) {
    visible[u] = ok[lo + u];
    if (!visible[u]) continue;
    any = true;
    p[u] = b.scaling * dot(qi, K + (lo + u) * dk, dk);
    top = std::max(top, p[u]);
  }
  if (!any) return false;
  float total = 0.f;
  for (int64_t u = 0; u < width; ++u) {
    if (!visible[u]) continue;
    p[u] = fast_exp(p[u] - top);
    total += p[u];
  }
  const float inv = 1.f / total;
  const uint32_t state = Dropout::first(head_state, i);
  for (int64_t u = 0; u < width; ++u) {
    if (!visible[u]) {
      p[u] = 0.f;
      f[u] = 0.f;
      continue;
    }
    p[u] *= inv;
    f[u] = drop.factor(state, lo + u);
  }
  return true;
}

BandArgs band_args(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
                   const at::Tensor& valid, int64_t window, double scaling) {
  const Qkv s = check_inputs(queries, keys, values);
  check_mask(valid, s.rows, s.n);
  TORCH_CHECK_VALUE(window >= 0, "window must be >= 0, got ", window);
  return {s, queries.data_ptr<float>(), keys.data_ptr<float>(), values.data_ptr<float>(), valid.data_ptr<bool>(),
          window, static_cast<float>(scaling)};
}

constexpr int64_t kBandBlock = 64;

}  // namespace

at::Tensor banded_attention_dropped_cpu(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
                                        const at::Tensor& valid, int64_t window, double scaling, double dropout,
                                        int64_t seed) {
  const BandArgs b = band_args(queries, keys, values, valid, window, scaling);
  const Dropout drop(dropout, seed, kQueryStream);
  const Qkv& s = b.s;
  at::Tensor out = zeros_tensor({s.rows, s.heads, s.n, s.dv}, values.options());
  float* op = out.data_ptr<float>();
  const int64_t blocks = (s.n + kBandBlock - 1) / kBandBlock;
  const int64_t width = window >= s.n ? s.n : 2 * window + 1;
  parallel_for(0, s.rows * s.heads * blocks, grain_for(kBandBlock * width * (s.dk + s.dv)),
               [&](int64_t begin, int64_t end) {
                 std::vector<float> p, f;
                 std::vector<char> visible;
                 for (int64_t task = begin; task < end; ++task) {
                   const int64_t rh = task / blocks, block = task % blocks;
                   const bool* ok = b.valid + (rh / s.heads) * s.n;
                   const uint32_t head_state = drop.head(rh);
                   const float* V = b.v + rh * s.n * s.dv;
                   for (int64_t i = block * kBandBlock; i < std::min(s.n, (block + 1) * kBandBlock); ++i) {
                     if (!ok[i]) continue;
                     int64_t lo = 0, w = 0;
                     if (!band_weights(b, rh, i, drop, head_state, lo, w, p, f, visible)) continue;
                     float* o = op + (rh * s.n + i) * s.dv;
                     for (int64_t u = 0; u < w; ++u)
                       if (visible[u]) add_scaled(o, V + (lo + u) * s.dv, p[u] * f[u], s.dv);
                   }
                 }
               });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> banded_attention_backward_dropped_cpu(
    const at::Tensor& grad_out, const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
    const at::Tensor& valid, int64_t window, double scaling, double dropout, int64_t seed) {
  const BandArgs b = band_args(queries, keys, values, valid, window, scaling);
  const Qkv& s = b.s;
  check_grad(grad_out, s.rows, s.heads, s.n, s.dv, "(R, H, N, Dv)");
  const Dropout drop(dropout, seed, kQueryStream);
  const auto options = values.options();
  at::Tensor dq = zeros_tensor({s.rows, s.heads, s.n, s.dk}, options);
  at::Tensor dk = zeros_tensor({s.rows, s.heads, s.n, s.dk}, options);
  at::Tensor dv = zeros_tensor({s.rows, s.heads, s.n, s.dv}, options);
  const float* g = grad_out.data_ptr<float>();
  const int64_t width = window >= s.n ? s.n : 2 * window + 1;
  parallel_for(0, s.rows * s.heads, grain_for(2 * s.n * width * (s.dk + s.dv)), [&](int64_t begin, int64_t end) {
    std::vector<float> p, f, dp;
    std::vector<char> visible;
    for (int64_t rh = begin; rh < end; ++rh) {
      const bool* ok = b.valid + (rh / s.heads) * s.n;
      const uint32_t head_state = drop.head(rh);
      const float* K = b.k + rh * s.n * s.dk;
      const float* V = b.v + rh * s.n * s.dv;
      float* dK = dk.data_ptr<float>() + rh * s.n * s.dk;
      float* dV = dv.data_ptr<float>() + rh * s.n * s.dv;
      for (int64_t i = 0; i < s.n; ++i) {
        if (!ok[i]) continue;
        int64_t lo = 0, w = 0;
        if (!band_weights(b, rh, i, drop, head_state, lo, w, p, f, visible)) continue;
        const float* gi = g + (rh * s.n + i) * s.dv;
        const float* qi = b.q + (rh * s.n + i) * s.dk;
        float* dqi = dq.data_ptr<float>() + (rh * s.n + i) * s.dk;
        dp.resize(w);
        float weighted = 0.f;
        for (int64_t u = 0; u < w; ++u) {
          if (!visible[u]) {
            dp[u] = 0.f;
            continue;
          }
          dp[u] = f[u] * dot(gi, V + (lo + u) * s.dv, s.dv);
          weighted += p[u] * dp[u];
          add_scaled(dV + (lo + u) * s.dv, gi, p[u] * f[u], s.dv);
        }
        for (int64_t u = 0; u < w; ++u) {
          if (!visible[u]) continue;
          const float ds = b.scaling * p[u] * (dp[u] - weighted);
          add_scaled(dqi, K + (lo + u) * s.dk, ds, s.dk);
          add_scaled(dK + (lo + u) * s.dk, qi, ds, s.dk);
        }
      }
    }
  });
  return {dq, dk, dv};
}

}  // namespace bert_cluster
