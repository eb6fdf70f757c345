// Backward kernels on CUDA (issue 38): topk_refine, centroid_attention, group_queries (and lloyd_refine's
// centroids), broadcast_clusters and banded_attention, the same ops and results as kernels/cpu/backward*.cpp, on the current
// stream with no host synchronisation.
//
// Deterministic, with no float atomics: every output element has one owner that sums in a fixed order.
// - topk_refine: one block per (row, head, cluster) walks the cluster's members in index order; per member,
//   the query's gradient is its own, and the gradients of the cluster's k key and value rows gather in the
//   block's own (C, k, D) scratch, each element owned by one thread. A second pass gives each key its rows'
//   sum over the clusters whose top-k hold it, in (cluster, slot) order.
// - centroid_attention: dense C x N products through cuBLAS (at::matmul), as the forward; the top-k part as
//   a 0/1 membership matrix (a slot's key is unique in its row, so writing the 1s collides nowhere).
// - group_queries, broadcast_clusters: one block per (row, head, cluster) over its members in index order.
// - banded_attention: one warp per query (its dq and softmax statistics), then one warp per key (its dK and
//   dV over the queries whose band holds it, in query order).
// Assignments and top-k indices out of range fail a device-side assertion, as in the forward kernels.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <type_traits>

#include "../checks.h"
#include "common.cuh"

namespace bert_cluster {
namespace {

using cuda::blocks_for;
using cuda::kFull;
using cuda::kWarp;

constexpr int kBlock = 128;  // threads per block of the per-cluster kernels (4 warps)
constexpr int kWarps = kBlock / kWarp;

// The members of cluster c among queries [base, base + kBlock) of a head, in index order, into list[0..);
// returns how many. Every thread of the block calls it (it synchronises).
__device__ int block_members(const int64_t* __restrict__ assign, int64_t base, int64_t n, int64_t clusters,
                             int64_t c, int* list, int* warp_counts) {
  const int tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp;
  const int64_t i = base + tid;
  const int64_t a = i < n ? assign[i] : -1;
  CUDA_KERNEL_ASSERT(a >= -1 && a < clusters && "assignments must be -1 or in 0..C-1");
  const bool mine = a == c;
  const unsigned ballot = __ballot_sync(kFull, mine);
  if (lane == 0) warp_counts[warp] = __popc(ballot);
  __syncthreads();
  int before = 0, total = 0;
  for (int w = 0; w < kWarps; ++w) {
    if (w < warp) before += warp_counts[w];
    total += warp_counts[w];
  }
  if (mine) list[before + __popc(ballot & ((1u << lane) - 1u))] = static_cast<int>(tid);
  __syncthreads();
  return total;
}

// Sum over the block in a fixed order: warp trees, then the warps' partials in warp order (thread 0 gets it).
__device__ float block_sum(float x, float* partials) {
  x = cuda::warp_sum(x);
  if (threadIdx.x % kWarp == 0) partials[threadIdx.x / kWarp] = x;
  __syncthreads();
  float total = 0.f;
  if (threadIdx.x == 0)
    for (int w = 0; w < kWarps; ++w) total += partials[w];
  __syncthreads();
  return total;
}

// ---------------------------------------------------------------------------------------------------
// topk_refine: out_i = (Vc_j - Vtop_j) + m_j * sum_{l in T_j} softmax_l(s q_i.K_l) V_l for query i in j.

template <typename T>
__global__ void topk_refine_backward_kernel(const float* __restrict__ grad, const T* __restrict__ q,
                                            const T* __restrict__ keys, const T* __restrict__ values,
                                            const int64_t* __restrict__ assign, const int64_t* __restrict__ indices,
                                            const float* __restrict__ mass, int64_t n, int64_t clusters, int64_t k,
                                            int64_t dk, int64_t dv, float scaling, float* __restrict__ dq,
                                            float* __restrict__ dcv, float* __restrict__ dmass,
                                            float* __restrict__ dkc, float* __restrict__ dvc) {
  extern __shared__ float smem[];
  float* qs = smem;          // dk
  float* gs = qs + dk;       // dv
  float* p = gs + dv;        // k
  float* gv = p + k;         // k
  float* partials = gv + k;  // kWarps
  int* slots = reinterpret_cast<int*>(partials + kWarps);  // k
  int* list = slots + k;                                    // kBlock
  int* warp_counts = list + kBlock;                         // kWarps
  __shared__ int used_shared;
  __shared__ float weighted_shared;

  const int64_t line = blockIdx.x;  // (row, head, cluster)
  const int64_t head = line / clusters, c = line % clusters;
  const int tid = threadIdx.x;
  const T* K = keys + head * n * dk;
  const T* V = values + head * n * dv;
  const int64_t* a = assign + head * n;
  const int64_t* idx = indices + line * k;
  float* dk_rows = dkc + line * k * dk;  // this block's (k, dk) and (k, dv) scratch, zeroed
  float* dv_rows = dvc + line * k * dv;
  if (tid == 0) {
    int used = 0;
    for (int64_t u = 0; u < k; ++u) {
      const int64_t l = idx[u];
      CUDA_KERNEL_ASSERT(l >= -1 && l < n && "topk_indices must be -1 or in 0..N-1");
      if (l >= 0) slots[used++] = static_cast<int>(l);
    }
    used_shared = used;
  }
  __syncthreads();
  const int m = used_shared;
  const float mj = mass[line];
  float dm = 0.f;
  for (int64_t d = tid; d < dv; d += kBlock) dcv[line * dv + d] = 0.f;
  for (int64_t base = 0; base < n; base += kBlock) {
    const int members = block_members(a, base, n, clusters, c, list, warp_counts);
    for (int t = 0; t < members; ++t) {
      const int64_t i = base + list[t];
      for (int64_t d = tid; d < dk; d += kBlock) qs[d] = static_cast<float>(q[(head * n + i) * dk + d]);
      for (int64_t d = tid; d < dv; d += kBlock) gs[d] = grad[(head * n + i) * dv + d];
      __syncthreads();
      for (int u = tid; u < m; u += kBlock) {
        const T* key = K + static_cast<int64_t>(slots[u]) * dk;
        const T* value = V + static_cast<int64_t>(slots[u]) * dv;
        float s = 0.f, h = 0.f;
        for (int64_t d = 0; d < dk; ++d) s = fmaf(qs[d], static_cast<float>(key[d]), s);
        for (int64_t d = 0; d < dv; ++d) h = fmaf(gs[d], static_cast<float>(value[d]), h);
        p[u] = s * scaling;
        gv[u] = mj * h;  // dP_u
      }
      __syncthreads();
      if (tid == 0) {  // softmax over the slots, in slot order
        float top = -INFINITY;
        for (int u = 0; u < m; ++u) top = fmaxf(top, p[u]);
        float total = 0.f;
        for (int u = 0; u < m; ++u) {
          p[u] = expf(p[u] - top);
          total += p[u];
        }
        float weighted = 0.f;
        for (int u = 0; u < m; ++u) {
          p[u] /= total;
          weighted += p[u] * gv[u];
        }
        weighted_shared = weighted;
      }
      __syncthreads();
      // E = sum P V for d.Mass (g . E), the centroid values' gradient, the query's own gradient.
      float ge = 0.f;
      for (int64_t d = tid; d < dv; d += kBlock) {
        float e = 0.f;
        for (int u = 0; u < m; ++u) e = fmaf(p[u], static_cast<float>(V[static_cast<int64_t>(slots[u]) * dv + d]), e);
        ge = fmaf(gs[d], e, ge);
        dcv[line * dv + d] += gs[d];
      }
      dm += block_sum(ge, partials);
      for (int u = tid; u < m; u += kBlock) gv[u] = scaling * p[u] * (gv[u] - weighted_shared);  // dS_u
      __syncthreads();
      for (int64_t d = tid; d < dk; d += kBlock) {
        float acc = 0.f;
        for (int u = 0; u < m; ++u) acc = fmaf(gv[u], static_cast<float>(K[static_cast<int64_t>(slots[u]) * dk + d]), acc);
        dq[(head * n + i) * dk + d] = acc;
      }
      for (int64_t e = tid; e < m * dk; e += kBlock) dk_rows[e] = fmaf(gv[e / dk], qs[e % dk], dk_rows[e]);
      for (int64_t e = tid; e < m * dv; e += kBlock) dv_rows[e] = fmaf(mj * p[e / dv], gs[e % dv], dv_rows[e]);
      __syncthreads();
    }
  }
  if (tid == 0) dmass[line] = dm;
}

// Each key's gradient: the sum of its rows in the clusters' scratch, clusters and slots in order. One block
// per (row, head, key), threads over the dims; padded queries' rows get zeros, as every unpicked key.
__global__ void gather_key_rows_kernel(const int64_t* __restrict__ indices, const float* __restrict__ rows,
                                       int64_t n, int64_t clusters, int64_t k, int64_t d_count,
                                       float* __restrict__ out) {
  const int64_t line = blockIdx.x;  // (row, head, key)
  const int64_t head = line / n, l = line % n;
  const int64_t* idx = indices + head * clusters * k;
  const float* head_rows = rows + head * clusters * k * d_count;
  for (int64_t d = threadIdx.x; d < d_count; d += blockDim.x) {
    float acc = 0.f;
    for (int64_t s = 0; s < clusters * k; ++s) {
      if (idx[s] != l) continue;
      // a slot's position among its cluster's used slots: -1 entries hold no row and are skipped on fill
      const int64_t c = s / k;
      int64_t position = 0;
      for (int64_t u = c * k; u < s; ++u) position += idx[u] >= 0;
      acc += head_rows[(c * k + position) * d_count + d];
    }
    out[line * d_count + d] = acc;
  }
}

// ---------------------------------------------------------------------------------------------------
// centroid_attention's top-k membership: M[c, l] = 1 for l in T_c.

__global__ void membership_kernel(const int64_t* __restrict__ indices, int64_t lines, int64_t n, int64_t k,
                                  float* __restrict__ member) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= lines * k) return;
  const int64_t l = indices[e];
  CUDA_KERNEL_ASSERT(l >= -1 && l < n && "topk_indices must be -1 or in 0..N-1");
  if (l >= 0) member[(e / k) * n + l] = 1.f;
}

// ---------------------------------------------------------------------------------------------------
// group_queries: per (row, head, cluster) its member count and, per dim, whether a member holds a
// non-finite entry there (then the reference's centroid entry is a constant: no gradient).

template <typename T>
__global__ void group_stats_kernel(const T* __restrict__ q, const int64_t* __restrict__ assign, int64_t n,
                                   int64_t clusters, int64_t dk, float* __restrict__ counts,
                                   uint8_t* __restrict__ broken) {
  const int64_t line = blockIdx.x, head = line / clusters, c = line % clusters;
  const int64_t* a = assign + head * n;
  for (int64_t d = threadIdx.x; d < dk; d += blockDim.x) {
    float count = 0.f;
    bool bad = false;
    for (int64_t i = 0; i < n; ++i) {
      if (a[i] != c) continue;
      count += 1.f;
      bad |= !isfinite(static_cast<float>(q[(head * n + i) * dk + d]));
    }
    broken[line * dk + d] = bad;
    if (d == 0) counts[line] = count;
  }
}

template <typename T>
__global__ void group_backward_kernel(const float* __restrict__ grad, const T* __restrict__ q,
                                      const int64_t* __restrict__ assign, const float* __restrict__ counts,
                                      const uint8_t* __restrict__ broken, int64_t n, int64_t clusters, int64_t dk,
                                      int64_t total, T* __restrict__ out) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= total) return;
  const int64_t d = e % dk, row = e / dk, head = row / n;
  const int64_t c = assign[row];
  CUDA_KERNEL_ASSERT(c >= -1 && c < clusters && "assignments must be -1 or in 0..C-1");
  float g = 0.f;
  if (c >= 0) {
    const int64_t line = head * clusters + c;
    if (!broken[line * dk + d] && isfinite(static_cast<float>(q[e])))
      g = grad[line * dk + d] / fmaxf(counts[line], 1.f);
  }
  out[e] = static_cast<T>(g);
}

// broadcast_clusters: dVc_c = the sum of its members' output gradients, in query order.
template <typename T>
__global__ void broadcast_backward_kernel(const T* __restrict__ grad, const int64_t* __restrict__ assign, int64_t n,
                                          int64_t clusters, int64_t dv, T* __restrict__ out) {
  using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const int64_t line = blockIdx.x, head = line / clusters, c = line % clusters;
  const int64_t* a = assign + head * n;
  for (int64_t d = threadIdx.x; d < dv; d += blockDim.x) {
    Acc acc = 0;
    for (int64_t i = 0; i < n; ++i) {
      CUDA_KERNEL_ASSERT(a[i] >= -1 && a[i] < clusters && "assignments must be -1 or in 0..C-1");
      if (a[i] == c) acc += static_cast<Acc>(grad[(head * n + i) * dv + d]);
    }
    out[line * dv + d] = static_cast<T>(acc);
  }
}

// ---------------------------------------------------------------------------------------------------
// banded_attention: query i attends to the valid keys l with |i - l| <= w, P_il = softmax_l(s q_i . K_l),
// out_i = sum_l P_il V_l. As the reference (and kernels/cpu/backward_steps.cpp): a non-finite value of a
// visible key enters the products as 0 and makes the output elements it touches NaN, constants, so those
// pass no gradient. With g'_i the output gradient less those dims (0 for a padded query) and V' the values
// with their non-finite entries 0:
//   dP_il = g'_i . V'_l,  delta_i = sum_l P_il dP_il,  dS_il = s P_il (dP_il - delta_i),
//   dq_i = sum_l dS_il K_l,  dK_l = sum_i dS_il q_i,  dV_l = sum_i P_il g'_i (0 on a non-finite V_l entry).
// Three kernels, one warp per row, so that every gradient row has one owner: g' per query; per query its
// softmax statistics (max, sum, delta) and dq; per key dK and dV over the queries whose band holds it. The
// key pass recomputes P_il and dP_il with the query pass's expressions (the same operations in the same
// order: the same bits). Lanes take keys (or queries) 32 at a time for the dot products, then dims.
constexpr int kBandWarps = 8;

template <typename T>
__device__ __forceinline__ float dot_row(const float* __restrict__ x, const T* __restrict__ row, int64_t d_count) {
  float acc = 0.f;
  for (int64_t d = 0; d < d_count; ++d) acc = fmaf(x[d], static_cast<float>(row[d]), acc);
  return acc;
}

// Like dot_row with the row's non-finite entries read as 0 (the values, V').
template <typename T>
__device__ __forceinline__ float dot_clean_row(const float* __restrict__ x, const T* __restrict__ row,
                                               int64_t d_count) {
  float acc = 0.f;
  for (int64_t d = 0; d < d_count; ++d) {
    const float v = static_cast<float>(row[d]);
    acc = fmaf(x[d], isfinite(v) ? v : 0.f, acc);
  }
  return acc;
}

// g': per (row, head, query) one warp, lanes over the value dims.
template <typename T>
__global__ void band_clean_grad_kernel(const float* __restrict__ grad, const T* __restrict__ values,
                                       const bool* __restrict__ valid, int64_t heads, int64_t n, int64_t window,
                                       int64_t dv, int64_t total, float* __restrict__ clean) {
  const int64_t line = static_cast<int64_t>(blockIdx.x) * kBandWarps + threadIdx.x / kWarp;  // (row, head, query)
  if (line >= total) return;
  const int lane = threadIdx.x % kWarp;
  const int64_t rh = line / n, i = line % n, r = rh / heads;
  const bool* ok = valid + r * n;
  const int64_t lo = i - window > 0 ? i - window : 0, hi = i + window < n - 1 ? i + window : n - 1;
  const T* V = values + rh * n * dv;
  for (int64_t d = lane; d < dv; d += kWarp) {
    bool seen = false;
    if (ok[i])
      for (int64_t l = lo; l <= hi; ++l) seen |= ok[l] && !isfinite(static_cast<float>(V[l * dv + d]));
    clean[line * dv + d] = ok[i] && !seen ? grad[line * dv + d] : 0.f;
  }
}

// Per query: max and sum of its band's exponentials, delta, and dq. One warp per (row, head, query).
template <typename T, int NV>
__global__ void band_query_backward_kernel(const float* __restrict__ clean, const T* __restrict__ q,
                                           const T* __restrict__ keys, const T* __restrict__ values,
                                           const bool* __restrict__ valid, int64_t heads, int64_t n, int64_t window,
                                           int64_t dk, int64_t dv, int64_t total, float scaling,
                                           float* __restrict__ stats, float* __restrict__ dq) {
  extern __shared__ float band_bwd_smem[];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t line = static_cast<int64_t>(blockIdx.x) * kBandWarps + warp;
  if (line >= total) return;  // warp-uniform; the kernel has no block-wide barrier
  const int64_t rh = line / n, i = line % n, r = rh / heads;
  const bool* ok = valid + r * n;
  float* qs = band_bwd_smem + warp * (dk + dv);
  float* gs = qs + dk;
  for (int64_t d = lane; d < dk; d += kWarp) qs[d] = static_cast<float>(q[line * dk + d]);
  for (int64_t d = lane; d < dv; d += kWarp) gs[d] = clean[line * dv + d];
  __syncwarp();
  const T* K = keys + rh * n * dk;
  const T* V = values + rh * n * dv;
  const int64_t lo = i - window > 0 ? i - window : 0, hi = i + window < n - 1 ? i + window : n - 1;
  // The scores, three times (max; sums; dq): nothing of the band is kept.
  auto score = [&](int64_t l, bool& visible) {
    visible = ok[i] && l <= hi && ok[l];
    return visible ? dot_row(qs, K + l * dk, dk) * scaling : -INFINITY;
  };
  float top = -INFINITY;
  bool any = false;
  for (int64_t j0 = lo; j0 <= hi; j0 += kWarp) {
    bool visible;
    const float s = score(j0 + lane, visible);
    top = fmaxf(top, cuda::warp_max(s));
    any |= __any_sync(kFull, visible);
  }
  float* st = stats + line * 3;
  float acc[NV];
  for (int t = 0; t < NV; ++t) acc[t] = 0.f;
  // A padded query, or no valid key in the band: a zero output, no gradient (decided from the mask: NaN
  // scores propagate, as on the CPU).
  if (!any) {
    if (lane == 0) {
      st[0] = -INFINITY;
      st[1] = 0.f;
      st[2] = 0.f;
    }
  } else {
    float sum = 0.f, weighted = 0.f;
    for (int64_t j0 = lo; j0 <= hi; j0 += kWarp) {
      bool visible;
      const float s = score(j0 + lane, visible);
      const float e = visible ? expf(s - top) : 0.f;
      const float dp = visible ? dot_clean_row(gs, V + (j0 + lane) * dv, dv) : 0.f;
      sum += cuda::warp_sum(e);
      weighted += cuda::warp_sum(e * dp);
    }
    const float delta = weighted / sum;
    for (int64_t j0 = lo; j0 <= hi; j0 += kWarp) {
      bool visible;
      const float s = score(j0 + lane, visible);
      float ds = 0.f;
      if (visible) {
        const float p = expf(s - top) / sum;
        const float dp = dot_clean_row(gs, V + (j0 + lane) * dv, dv);
        ds = scaling * p * (dp - delta);
      }
      const unsigned seen = __ballot_sync(kFull, visible);
      for (int j = 0; j < kWarp; ++j) {
        const float w = __shfl_sync(kFull, ds, j);
        if (!(seen >> j & 1u)) continue;  // warp-uniform
        const T* key = K + (j0 + j) * dk;
        for (int t = 0; t < NV; ++t) {
          const int64_t d = lane + t * kWarp;
          if (d < dk) acc[t] = fmaf(w, static_cast<float>(key[d]), acc[t]);
        }
      }
    }
    if (lane == 0) {
      st[0] = top;
      st[1] = sum;
      st[2] = delta;
    }
  }
  for (int t = 0; t < NV; ++t) {
    const int64_t d = lane + t * kWarp;
    if (d < dk) dq[line * dk + d] = acc[t];
  }
}

// Per key: dK and dV over the queries whose band holds it, in query order. One warp per (row, head, key).
template <typename T, int NV>
__global__ void band_key_backward_kernel(const float* __restrict__ clean, const T* __restrict__ q,
                                         const T* __restrict__ keys, const T* __restrict__ values,
                                         const bool* __restrict__ valid, const float* __restrict__ stats,
                                         int64_t heads, int64_t n, int64_t window, int64_t dk, int64_t dv,
                                         int64_t total, float scaling, float* __restrict__ dkeys,
                                         float* __restrict__ dvalues) {
  extern __shared__ float band_bwd_smem[];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t line = static_cast<int64_t>(blockIdx.x) * kBandWarps + warp;
  if (line >= total) return;  // warp-uniform
  const int64_t rh = line / n, l = line % n, r = rh / heads;
  const bool* ok = valid + r * n;
  float* ks = band_bwd_smem + warp * (dk + dv);
  float* vs = ks + dk;
  const T* value = values + line * dv;
  for (int64_t d = lane; d < dk; d += kWarp) ks[d] = static_cast<float>(keys[line * dk + d]);
  for (int64_t d = lane; d < dv; d += kWarp) vs[d] = static_cast<float>(value[d]);
  __syncwarp();
  float gk[NV], gv[NV];
  for (int t = 0; t < NV; ++t) gk[t] = gv[t] = 0.f;
  if (ok[l]) {  // a padded key is never visible: zero gradients
    const T* Q = q + rh * n * dk;
    const float* G = clean + rh * n * dv;
    const int64_t lo = l - window > 0 ? l - window : 0, hi = l + window < n - 1 ? l + window : n - 1;
    for (int64_t i0 = lo; i0 <= hi; i0 += kWarp) {
      const int64_t i = i0 + lane;
      const float* st = stats + (rh * n + i) * 3;
      const bool visible = i <= hi && ok[i] && st[1] != 0.f;  // 0: no valid key in i's band (NaN counts)
      float ds = 0.f, p = 0.f;
      if (visible) {
        // The query pass's expressions: dot_row(q_i, K_l) there is fmaf(q_i[d], K_l[d], .) in d order, as here.
        float s = 0.f;
        for (int64_t d = 0; d < dk; ++d) s = fmaf(static_cast<float>(Q[i * dk + d]), ks[d], s);
        s *= scaling;
        float dp = 0.f;
        for (int64_t d = 0; d < dv; ++d) dp = fmaf(G[i * dv + d], isfinite(vs[d]) ? vs[d] : 0.f, dp);
        p = expf(s - st[0]) / st[1];
        ds = scaling * p * (dp - st[2]);
      }
      const unsigned seen = __ballot_sync(kFull, visible);
      for (int j = 0; j < kWarp; ++j) {
        const float wk = __shfl_sync(kFull, ds, j), wv = __shfl_sync(kFull, p, j);
        if (!(seen >> j & 1u)) continue;  // warp-uniform
        const T* qi = Q + (i0 + j) * dk;
        const float* gi = G + (i0 + j) * dv;
        for (int t = 0; t < NV; ++t) {
          const int64_t d = lane + t * kWarp;
          if (d < dk) gk[t] = fmaf(wk, static_cast<float>(qi[d]), gk[t]);
          if (d < dv) gv[t] = fmaf(wv, gi[d], gv[t]);
        }
      }
    }
  }
  for (int t = 0; t < NV; ++t) {
    const int64_t d = lane + t * kWarp;
    if (d < dk) dkeys[line * dk + d] = gk[t];
    if (d < dv) dvalues[line * dv + d] = isfinite(vs[d]) ? gv[t] : 0.f;
  }
}

template <typename T>
void launch_band_backward(int nv, const at::Tensor& clean, const at::Tensor& q, const at::Tensor& k,
                          const at::Tensor& v, const at::Tensor& ok, at::Tensor& stats, int64_t heads, int64_t n,
                          int64_t window, int64_t dk, int64_t dv, int64_t total, float scaling, at::Tensor& dq,
                          at::Tensor& dkeys, at::Tensor& dvalues) {
  const auto stream = at::cuda::getCurrentCUDAStream();
  const auto blocks = blocks_for(total, kBandWarps);
  const size_t smem = static_cast<size_t>(kBandWarps) * (dk + dv) * sizeof(float);
#define BC_BAND_BWD(NV)                                                                                         \
  band_query_backward_kernel<T, NV><<<blocks, kBandWarps * kWarp, smem, stream>>>(                              \
      clean.data_ptr<float>(), q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(), ok.data_ptr<bool>(), heads, n, \
      window, dk, dv, total, scaling, stats.data_ptr<float>(), dq.data_ptr<float>());                          \
  C10_CUDA_KERNEL_LAUNCH_CHECK();                                                                               \
  band_key_backward_kernel<T, NV><<<blocks, kBandWarps * kWarp, smem, stream>>>(                                \
      clean.data_ptr<float>(), q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(), ok.data_ptr<bool>(),          \
      stats.data_ptr<float>(), heads, n, window, dk, dv, total, scaling, dkeys.data_ptr<float>(),               \
      dvalues.data_ptr<float>());                                                                               \
  C10_CUDA_KERNEL_LAUNCH_CHECK()
  switch (nv) {
    case 1: BC_BAND_BWD(1); break;
    case 2: BC_BAND_BWD(2); break;
    case 4: BC_BAND_BWD(4); break;
    case 8: BC_BAND_BWD(8); break;
    default: BC_BAND_BWD(16); break;
  }
#undef BC_BAND_BWD
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> topk_refine_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
    const at::Tensor& assignments, const at::Tensor& topk_indices, const at::Tensor& topk_mass, double scaling,
    double dropout, int64_t /*seed*/) {
  check_no_dropout(dropout, "topk_refine_backward");
  check_qkv(queries, keys, values);
  check_dtype(grad_out, at::kFloat, "grad_out");
  check_dtype(topk_mass, at::kFloat, "topk_mass");
  check_dtype(topk_indices, at::kLong, "topk_indices");
  const int64_t rows = queries.size(0), heads = queries.size(1), n = queries.size(2);
  const int64_t dk = queries.size(3), dv = values.size(3);
  check_assignments(assignments, rows, heads, n, queries);
  check_dim(topk_indices, 4, "topk_indices", "(R, H, C, k)");
  const int64_t clusters = topk_indices.size(2), k = topk_indices.size(3);
  TORCH_CHECK_VALUE(grad_out.sizes() == values.sizes(), "grad_out must be (R, H, N, Dv) = ", values.sizes(),
                    ", got ", grad_out.sizes());
  const c10::cuda::CUDAGuard guard(queries.device());
  const at::Tensor g = grad_out.contiguous(), q = queries.contiguous(), kk = keys.contiguous();
  const at::Tensor v = values.contiguous(), a = assignments.contiguous(), ti = topk_indices.contiguous();
  const at::Tensor tm = topk_mass.contiguous();
  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor dq = at::zeros({rows, heads, n, dk}, f32);
  at::Tensor dkeys = at::zeros({rows, heads, n, dk}, f32);
  at::Tensor dvalues = at::zeros({rows, heads, n, dv}, f32);
  at::Tensor dcv = at::zeros({rows, heads, clusters, dv}, f32);
  at::Tensor dmass = at::zeros({rows, heads, clusters}, f32);
  const int64_t lines = rows * heads * clusters;
  if (lines > 0 && n > 0) {  // k = 0 too: each member's gradient then reaches only Vc - Vtop
    at::Tensor dkc = at::zeros({lines, k, dk}, f32), dvc = at::zeros({lines, k, dv}, f32);
    const size_t smem = (dk + dv + 2 * k + kWarps) * sizeof(float) + (k + kBlock + kWarps) * sizeof(int);
    const auto stream = at::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "topk_refine_backward_cuda", [&] {
      topk_refine_backward_kernel<scalar_t><<<static_cast<unsigned int>(lines), kBlock, smem, stream>>>(
          g.data_ptr<float>(), q.data_ptr<scalar_t>(), kk.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
          a.data_ptr<int64_t>(), ti.data_ptr<int64_t>(), tm.data_ptr<float>(), n, clusters, k, dk, dv,
          static_cast<float>(scaling), dq.data_ptr<float>(), dcv.data_ptr<float>(), dmass.data_ptr<float>(),
          dkc.data_ptr<float>(), dvc.data_ptr<float>());
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const auto keys_lines = static_cast<unsigned int>(rows * heads * n);
    gather_key_rows_kernel<<<keys_lines, 64, 0, stream>>>(ti.data_ptr<int64_t>(), dkc.data_ptr<float>(), n, clusters,
                                                          k, dk, dkeys.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    gather_key_rows_kernel<<<keys_lines, 64, 0, stream>>>(ti.data_ptr<int64_t>(), dvc.data_ptr<float>(), n, clusters,
                                                          k, dv, dvalues.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {dq, dkeys, dvalues, dcv, dmass, dcv.neg()};
}

namespace {

// centroid_attention's gradients of centroids, keys and values, all float32.
std::tuple<at::Tensor, at::Tensor, at::Tensor> centroid_backward_float(
    const at::Tensor& grad_centroid_values, const at::Tensor& grad_topk_mass, const at::Tensor& grad_topk_values,
    const at::Tensor& centroids, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& valid,
    const at::Tensor& topk_indices, double scaling) {
  check_dim(centroids, 4, "centroids", "(R, H, C, Dk)");
  check_dim(keys, 4, "keys", "(R, H, N, Dk)");
  check_dim(values, 4, "values", "(R, H, N, Dv)");
  check_dtype(centroids, at::kFloat, "centroids");
  check_dtype(topk_indices, at::kLong, "topk_indices");
  check_valid(valid, keys.size(0), keys.size(2), keys);
  const c10::cuda::CUDAGuard guard(keys.device());
  const int64_t n = keys.size(2), k = topk_indices.size(3);
  const float s = static_cast<float>(scaling);
  const at::Tensor key_valid = valid.view({valid.size(0), 1, 1, n});
  const at::Tensor kf = keys.to(at::kFloat);
  const at::Tensor vf = at::where(valid.view({valid.size(0), 1, n, 1}), values.to(at::kFloat), 0.0);
  // The forward's weights again (the reference's expression), then zero on rows with no valid key.
  at::Tensor weights = at::softmax(at::matmul(centroids, kf.transpose(-1, -2)).mul_(s).masked_fill_(
                                       key_valid.logical_not(), -INFINITY),
                                   -1);
  weights = at::where(key_valid.any(-1, /*keepdim=*/true), weights, 0.0);
  at::Tensor member = at::zeros_like(weights);
  const int64_t lines = centroids.size(0) * centroids.size(1) * centroids.size(2);
  if (lines * k > 0) {
    const at::Tensor ti = topk_indices.contiguous();
    membership_kernel<<<blocks_for(lines * k, 256), 256, 0, at::cuda::getCurrentCUDAStream()>>>(
        ti.data_ptr<int64_t>(), lines, n, k, member.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const at::Tensor gvc = grad_centroid_values.to(at::kFloat), gtv = grad_topk_values.to(at::kFloat);
  at::Tensor da = at::matmul(gvc, vf.transpose(-1, -2));
  da.add_(member * (at::matmul(gtv, vf.transpose(-1, -2)) + grad_topk_mass.to(at::kFloat).unsqueeze(-1)));
  const at::Tensor delta = (weights * da).sum(-1, /*keepdim=*/true);
  const at::Tensor ds = weights * (da - delta) * s;
  at::Tensor dcent = at::matmul(ds, kf);
  at::Tensor dkeys = at::matmul(ds.transpose(-1, -2), centroids);
  at::Tensor dvalues = at::matmul(weights.transpose(-1, -2), gvc) + at::matmul((weights * member).transpose(-1, -2), gtv);
  dvalues = at::where(valid.view({valid.size(0), 1, n, 1}), dvalues, 0.0);
  return {dcent, dkeys, dvalues};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> centroid_attention_backward_cuda(
    const at::Tensor& grad_centroid_values, const at::Tensor& grad_topk_mass, const at::Tensor& grad_topk_values,
    const at::Tensor& centroids, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& valid,
    const at::Tensor& topk_indices, double scaling) {
  auto [dcent, dkeys, dvalues] = centroid_backward_float(grad_centroid_values, grad_topk_mass, grad_topk_values,
                                                         centroids, keys, values, valid, topk_indices, scaling);
  return {dcent, dkeys.to(keys.scalar_type()), dvalues.to(values.scalar_type())};
}

// The same, the key and value gradients added (in float32, before any rounding) into grad_keys and
// grad_values (float32, the keys' and values' shapes); returns the centroids' gradient.
at::Tensor centroid_attention_backward_into_cuda(at::Tensor& grad_keys, at::Tensor& grad_values,
                                                 const at::Tensor& grad_centroid_values,
                                                 const at::Tensor& grad_topk_mass, const at::Tensor& grad_topk_values,
                                                 const at::Tensor& centroids, const at::Tensor& keys,
                                                 const at::Tensor& values, const at::Tensor& valid,
                                                 const at::Tensor& topk_indices, double scaling) {
  check_dtype(grad_keys, at::kFloat, "grad_keys");
  check_dtype(grad_values, at::kFloat, "grad_values");
  TORCH_CHECK_VALUE(grad_keys.sizes() == keys.sizes() && grad_values.sizes() == values.sizes(),
                    "grad_keys and grad_values must have the keys' and values' shapes, got ", grad_keys.sizes(),
                    " and ", grad_values.sizes());
  auto [dcent, dkeys, dvalues] = centroid_backward_float(grad_centroid_values, grad_topk_mass, grad_topk_values,
                                                         centroids, keys, values, valid, topk_indices, scaling);
  grad_keys.add_(dkeys);
  grad_values.add_(dvalues);
  return dcent;
}

at::Tensor group_queries_backward_cuda(const at::Tensor& grad_centroids, const at::Tensor& queries,
                                       const at::Tensor& assignments) {
  check_dim(queries, 4, "queries", "(R, H, N, Dk)");
  check_attention_dtype(queries, "queries");
  check_dtype(grad_centroids, at::kFloat, "grad_centroids");
  const int64_t rows = queries.size(0), heads = queries.size(1), n = queries.size(2), dk = queries.size(3);
  check_assignments(assignments, rows, heads, n, queries);
  check_dim(grad_centroids, 4, "grad_centroids", "(R, H, C, Dk)");
  const int64_t clusters = grad_centroids.size(2);
  const c10::cuda::CUDAGuard guard(queries.device());
  const at::Tensor g = grad_centroids.contiguous(), q = queries.contiguous(), a = assignments.contiguous();
  at::Tensor out = at::empty_like(q);
  const int64_t total = out.numel();
  if (total == 0) return out;
  if (clusters == 0) return out.zero_();
  at::Tensor counts = at::empty({rows, heads, clusters}, q.options().dtype(at::kFloat));
  at::Tensor broken = at::empty({rows, heads, clusters, dk}, q.options().dtype(at::kByte));
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "group_queries_backward_cuda", [&] {
    group_stats_kernel<scalar_t><<<static_cast<unsigned int>(rows * heads * clusters), 64, 0, stream>>>(
        q.data_ptr<scalar_t>(), a.data_ptr<int64_t>(), n, clusters, dk, counts.data_ptr<float>(),
        broken.data_ptr<uint8_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    group_backward_kernel<scalar_t><<<blocks_for(total, 256), 256, 0, stream>>>(
        g.data_ptr<float>(), q.data_ptr<scalar_t>(), a.data_ptr<int64_t>(), counts.data_ptr<float>(),
        broken.data_ptr<uint8_t>(), n, clusters, dk, total, out.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor broadcast_clusters_backward_cuda(const at::Tensor& grad_out, const at::Tensor& centroid_values,
                                            const at::Tensor& assignments) {
  check_dim(centroid_values, 4, "centroid_values", "(R, H, C, Dv)");
  check_dim(grad_out, 4, "grad_out", "(R, H, N, Dv)");
  check_same_dtype(grad_out, centroid_values, "grad_out", "centroid_values");
  const int64_t rows = centroid_values.size(0), heads = centroid_values.size(1);
  const int64_t clusters = centroid_values.size(2), dv = centroid_values.size(3), n = grad_out.size(2);
  check_assignments(assignments, rows, heads, n, grad_out);
  const c10::cuda::CUDAGuard guard(grad_out.device());
  const at::Tensor g = grad_out.contiguous(), a = assignments.contiguous();
  at::Tensor out = at::empty({rows, heads, clusters, dv}, centroid_values.options());
  if (out.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "broadcast_clusters_backward_cuda", [&] {
    broadcast_backward_kernel<scalar_t>
        <<<static_cast<unsigned int>(rows * heads * clusters), 64, 0, at::cuda::getCurrentCUDAStream()>>>(
            g.data_ptr<scalar_t>(), a.data_ptr<int64_t>(), n, clusters, dv, out.data_ptr<scalar_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> banded_attention_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
    const at::Tensor& valid, int64_t window, double scaling, double dropout, int64_t /*seed*/) {
  check_no_dropout(dropout, "banded_attention_backward");
  check_qkv(queries, keys, values);
  check_dtype(grad_out, at::kFloat, "grad_out");
  const int64_t rows = queries.size(0), heads = queries.size(1), n = queries.size(2);
  const int64_t dk = queries.size(3), dv = values.size(3);
  check_valid(valid, rows, n, queries);
  TORCH_CHECK_VALUE(window >= 0, "window must be >= 0, got ", window);
  TORCH_CHECK_VALUE(grad_out.sizes() == values.sizes(), "grad_out must be (R, H, N, Dv) = ", values.sizes(),
                    ", got ", grad_out.sizes());
  TORCH_CHECK_VALUE(dk <= cuda::kMaxHeadDim && dv <= cuda::kMaxHeadDim,
                    "the CUDA banded_attention_backward supports head dims up to ", cuda::kMaxHeadDim, ", got Dk=",
                    dk, ", Dv=", dv);
  const c10::cuda::CUDAGuard guard(queries.device());
  const at::Tensor g = grad_out.contiguous(), q = queries.contiguous(), kk = keys.contiguous();
  const at::Tensor v = values.contiguous(), ok = valid.contiguous();
  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor dq = at::zeros({rows, heads, n, dk}, f32);
  at::Tensor dkeys = at::zeros({rows, heads, n, dk}, f32);
  at::Tensor dvalues = at::zeros({rows, heads, n, dv}, f32);
  const int64_t total = rows * heads * n;
  if (total == 0 || dk + dv == 0) return {dq, dkeys, dvalues};
  const int64_t w = window < n ? window : n;
  at::Tensor clean = at::empty({rows, heads, n, dv}, f32);
  at::Tensor stats = at::empty({total, 3}, f32);
  const int nv = cuda::lanes_per_dim_bucket(dk > dv ? dk : dv);
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "banded_attention_backward_cuda", [&] {
    if (dv > 0) {
      band_clean_grad_kernel<scalar_t><<<blocks_for(total, kBandWarps), kBandWarps * kWarp, 0, stream>>>(
          g.data_ptr<float>(), v.data_ptr<scalar_t>(), ok.data_ptr<bool>(), heads, n, w, dv, total,
          clean.data_ptr<float>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    launch_band_backward<scalar_t>(nv, clean, q, kk, v, ok, stats, heads, n, w, dk, dv, total,
                                   static_cast<float>(scaling), dq, dkeys, dvalues);
  });
  return {dq, dkeys, dvalues};
}

TORCH_LIBRARY_IMPL(bert_cluster, CUDA, m) {
  m.impl("topk_refine_backward", &topk_refine_backward_cuda);
  m.impl("centroid_attention_backward", &centroid_attention_backward_cuda);
  m.impl("centroid_attention_backward_into", &centroid_attention_backward_into_cuda);
  m.impl("group_queries_backward", &group_queries_backward_cuda);
  m.impl("broadcast_clusters_backward", &broadcast_clusters_backward_cuda);
  m.impl("banded_attention_backward", &banded_attention_backward_cuda);
}

}  // namespace bert_cluster
