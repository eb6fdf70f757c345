// i-clustered+ on CUDA (issues 13 and 38): lloyd_refine, refine_with_query_mass and its backward, the same
// ops, rules and output dtypes as kernels/cpu/lloyd.cpp, query_mass.cpp and backward.cpp, on the current
// stream with no host synchronisation. Deterministic, with no float atomics: every output element has one
// owner that sums in a fixed order (members of a cluster in query order: cluster_order.cuh).
//
// - lloyd_refine: per round a bias kernel (||c||^2), an assignment kernel (one thread per query, the
//   centroids staged in shared memory, distances ||c||^2 - 2 q.c summed over d in order with fmaf, the
//   minimum taken down the centroids in index order with a strict <: ties to the lowest index, as the CPU
//   kernel) and the means of the new partition (members summed in query order, divided by max(count, 1):
//   the CPU's and the reference's sums, bit for bit, for one partition). A round that changes no
//   assignment of a (row, head) leaves a per-(row, head) flag at 0 and the later rounds skip it (the CPU's
//   early stop at a fixed point, decided on the device).
// - refine_with_query_mass: per (row, head) the sums of the valid keys and of their squares; per cluster
//   the statistics of the keys outside its top-k (mean, variance, rest mean, A_j; shared with the backward);
//   per cluster one block whose warps take one member at a time against the cluster's top-k keys staged in
//   shared memory (warp_attend in common.cuh), then the query's own mass.
// - refine_with_query_mass_backward: one block per cluster walks its members in query order; the gradients
//   of the cluster's top-k key and value rows gather in the block's own (k, D) scratch, and a last kernel
//   gives each key the sum of its rows over the slots that hold it, in (cluster, slot) order (the slots
//   sorted by key once per head, a stable sort).
// Assignments and top-k indices out of range fail a device-side assertion, as in the other CUDA kernels.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <tuple>

#include "../checks.h"
#include "cluster_order.cuh"
#include "common.cuh"

namespace bert_cluster {
namespace {

using cuda::blocks_for;
using cuda::ClusterOrder;
using cuda::kFull;
using cuda::kWarp;
using cuda::sort_by_cluster;

constexpr int kBlock = 128;  // threads of the per-cluster blocks (4 warps)
constexpr int kWarps = kBlock / kWarp;
constexpr float kTiny = 1.17549435e-38f;  // FLT_MIN, as std::numeric_limits<float>::min() on the CPU

// Block-wide sum in a fixed order (warp trees, then the warps' partials in warp order), in every thread.
__device__ float block_sum_all(float x, float* partials) {
  x = cuda::warp_sum(x);
  if (threadIdx.x % kWarp == 0) partials[threadIdx.x / kWarp] = x;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < kWarps; ++w) total += partials[w];
  __syncthreads();
  return total;
}

__device__ float block_max_all(float x, float* partials) {
  x = cuda::warp_max(x);
  if (threadIdx.x % kWarp == 0) partials[threadIdx.x / kWarp] = x;
  __syncthreads();
  float top = -INFINITY;
  for (int w = 0; w < kWarps; ++w) top = fmaxf(top, partials[w]);
  __syncthreads();
  return top;
}

// ---------------------------------------------------------------------------------------------------
// lloyd_refine

// The means of each (row-head, cluster) and its member count: members summed in query order, then divided
// by max(count, 1) (kernels/cpu/lloyd.cpp accumulate / divide; reference._cluster_means). With `changed`,
// a (row, head) whose last assignment round changed nothing keeps its means (the same partition).
__global__ void lloyd_means_kernel(const float* __restrict__ q, const int32_t* __restrict__ order,
                                   const int32_t* __restrict__ start, const int32_t* __restrict__ changed, int64_t n,
                                   int64_t clusters, int64_t dk, float* __restrict__ means,
                                   float* __restrict__ counts) {
  const int64_t line = blockIdx.x, rh = line / clusters, c = line % clusters;
  if (changed != nullptr && changed[rh] == 0) return;
  const int32_t lo = start[rh * (clusters + 1) + c], hi = start[rh * (clusters + 1) + c + 1];
  const float count = static_cast<float>(hi - lo);
  const float divisor = count > 1.f ? count : 1.f;
  for (int64_t d = threadIdx.x; d < dk; d += blockDim.x) {
    float sum = 0.f;
    for (int32_t m = lo; m < hi; ++m) sum += q[(rh * n + order[rh * n + m]) * dk + d];
    means[line * dk + d] = sum / divisor;
  }
  if (threadIdx.x == 0) counts[line] = count;
}

// ||c||^2 over d in order (fmaf: the CPU kernel's loop, contracted), +inf for an empty cluster (never wins).
__global__ void lloyd_bias_kernel(const float* __restrict__ means, const float* __restrict__ counts, int64_t lines,
                                  int64_t dk, float* __restrict__ bias) {
  const int64_t line = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (line >= lines) return;
  float norm = 0.f;
  const float* m = means + line * dk;
  for (int64_t d = 0; d < dk; ++d) norm = fmaf(m[d], m[d], norm);
  bias[line] = counts[line] == 0.f ? INFINITY : norm;
}

// One thread per query of a (row, head); the centroids staged `chunk` at a time. Distances ||c||^2 - 2 q.c
// with q.c summed over d in order by fmaf (the CPU's FMA chain per lane), the first strict minimum down the
// clusters; a query with no finite smaller distance than +inf keeps its cluster; padded queries stay -1.
// `active` (null in the first round): the (row, head)s whose previous round changed an assignment.
__global__ void lloyd_assign_kernel(const float* __restrict__ q, const float* __restrict__ means,
                                    const float* __restrict__ bias, const int32_t* __restrict__ active, int64_t n,
                                    int64_t clusters, int64_t dk, int64_t blocks_per_head, int64_t chunk,
                                    int64_t* __restrict__ assign, int32_t* __restrict__ changed) {
  extern __shared__ float lloyd_smem[];  // chunk x dk centroid rows, then their chunk biases
  const int64_t rh = blockIdx.x / blocks_per_head, b = blockIdx.x % blocks_per_head;
  if (active != nullptr && active[rh] == 0) return;  // block-uniform
  float* cs = lloyd_smem;
  float* bs = lloyd_smem + chunk * dk;
  const int64_t i = b * blockDim.x + threadIdx.x;
  int64_t* a = assign + rh * n;
  const int64_t current = i < n ? a[i] : -1;
  CUDA_KERNEL_ASSERT(current >= -1 && current < clusters && "assignments must be -1 or in 0..C-1");
  const bool live = current >= 0;
  const float* qi = q + (rh * n + (live ? i : 0)) * dk;
  float best_distance = INFINITY;
  int64_t best = -1;
  for (int64_t c0 = 0; c0 < clusters; c0 += chunk) {
    const int64_t count = clusters - c0 < chunk ? clusters - c0 : chunk;
    __syncthreads();
    for (int64_t x = threadIdx.x; x < count * dk; x += blockDim.x) cs[x] = means[(rh * clusters + c0) * dk + x];
    for (int64_t x = threadIdx.x; x < count; x += blockDim.x) bs[x] = bias[rh * clusters + c0 + x];
    __syncthreads();
    if (!live) continue;
    for (int64_t c = 0; c < count; ++c) {
      const float* m = cs + c * dk;
      float dot = 0.f;
      for (int64_t d = 0; d < dk; ++d) dot = fmaf(m[d], qi[d], dot);
      const float distance = bs[c] - 2.f * dot;
      if (distance < best_distance) {
        best_distance = distance;
        best = c0 + c;
      }
    }
  }
  if (live && best >= 0 && best != current) {
    a[i] = best;
    changed[rh] = 1;  // every writer stores the same 1
  }
}

// ---------------------------------------------------------------------------------------------------
// refine_with_query_mass: the statistics both directions share.

// Per (row, head): the sums of the valid keys and of their squares over the keys in order, and the count of
// valid keys. One block per (row, head), threads over the features.
template <typename T>
__global__ void key_sums_kernel(const T* __restrict__ keys, const bool* __restrict__ valid, int64_t heads,
                                int64_t n, int64_t dk, float* __restrict__ sums, float* __restrict__ squares,
                                int32_t* __restrict__ valid_count) {
  const int64_t rh = blockIdx.x, r = rh / heads;
  const bool* ok = valid + r * n;
  const T* K = keys + rh * n * dk;
  for (int64_t d = threadIdx.x; d < dk; d += blockDim.x) {
    float s = 0.f, s2 = 0.f;
    for (int64_t l = 0; l < n; ++l) {
      if (!ok[l]) continue;
      const float x = static_cast<float>(K[l * dk + d]);
      s += x;
      s2 = fmaf(x, x, s2);
    }
    sums[rh * dk + d] = s;
    squares[rh * dk + d] = s2;
  }
  if (threadIdx.x == 0) {
    int32_t count = 0;
    for (int64_t l = 0; l < n; ++l) count += ok[l] ? 1 : 0;
    valid_count[rh] = count;
  }
}

// Per (row, head, cluster) j, with T_j its used top-k slots (index >= 0, in slot order; `slots` their keys,
// `slot_at` their positions among the k): mu_j and the variance before its clamp at 0 (raw_var) of the
// valid keys outside T_j, RM_j = (Vc_j - Vtop_j) / (1 - m_j) (0 without such keys), the centroid's softmax
// over T_j (probs), and A_j = log((1 - m_j) / m_j) + log Z_T(c_j) - R(c_j) (-inf without keys outside T_j),
// as reference.refine_with_query_mass and the CPU backward compute them. One block per cluster.
template <typename T>
__global__ void cluster_stats_kernel(const T* __restrict__ keys, const int64_t* __restrict__ indices,
                                     const float* __restrict__ centroids, const float* __restrict__ centroid_values,
                                     const float* __restrict__ topk_values, const float* __restrict__ topk_mass,
                                     const float* __restrict__ sums, const float* __restrict__ squares,
                                     const int32_t* __restrict__ valid_count, int64_t n, int64_t clusters, int64_t k,
                                     int64_t dk, int64_t dv, float scaling, int32_t* __restrict__ slots,
                                     int32_t* __restrict__ slot_at, int32_t* __restrict__ used,
                                     float* __restrict__ mu, float* __restrict__ raw_var, float* __restrict__ rm,
                                     float* __restrict__ probs, float* __restrict__ log_base) {
  __shared__ float partials[kWarps];
  __shared__ int used_shared;
  const int64_t line = blockIdx.x, rh = line / clusters;
  const int tid = threadIdx.x;
  const int64_t* idx = indices + line * k;
  int32_t* sl = slots + line * k;
  int32_t* pos = slot_at + line * k;
  if (tid == 0) {
    int count = 0;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t l = idx[j];
      CUDA_KERNEL_ASSERT(l >= -1 && l < n && "topk_indices must be -1 or in 0..N-1");
      if (l < 0) continue;
      sl[count] = static_cast<int32_t>(l);
      pos[count++] = static_cast<int32_t>(j);
    }
    used_shared = count;
    used[line] = count;
  }
  __syncthreads();
  const int m = used_shared;
  const T* K = keys + rh * n * dk;
  const int64_t rest_count = static_cast<int64_t>(valid_count[rh]) - m;
  const bool no_rest = rest_count <= 0;
  const float count = static_cast<float>(rest_count > 1 ? rest_count : 1);
  for (int64_t d = tid; d < dk; d += kBlock) {
    float t1 = 0.f, t2 = 0.f;
    for (int u = 0; u < m; ++u) {
      const float x = static_cast<float>(K[static_cast<int64_t>(sl[u]) * dk + d]);
      t1 += x;
      t2 = fmaf(x, x, t2);
    }
    const float m1 = (sums[rh * dk + d] - t1) / count;
    const float m2 = (squares[rh * dk + d] - t2) / count;
    mu[line * dk + d] = m1;
    raw_var[line * dk + d] = m2 - m1 * m1;
  }
  const float* c = centroids + line * dk;
  float* pr = probs + line * k;
  float top = -INFINITY;
  for (int u = tid; u < m; u += kBlock) {
    float s = 0.f;
    const T* key = K + static_cast<int64_t>(sl[u]) * dk;
    for (int64_t d = 0; d < dk; ++d) s = fmaf(c[d], static_cast<float>(key[d]), s);
    pr[u] = s * scaling;
    top = fmaxf(top, pr[u]);
  }
  top = block_max_all(top, partials);
  float e_sum = 0.f;
  for (int u = tid; u < m; u += kBlock) e_sum += expf(pr[u] - top);
  const float total = block_sum_all(e_sum, partials);
  for (int u = tid; u < m; u += kBlock) pr[u] = expf(pr[u] - top) / total;
  const float lzc = m > 0 ? top + logf(total) : -INFINITY;
  // R(c_j) = s c . (mu + s / 2 var c), var = max(raw_var, 0) (mu and raw_var written above by this block).
  float part = 0.f;
  for (int64_t d = tid; d < dk; d += kBlock) {
    const float var = fmaxf(raw_var[line * dk + d], 0.f);
    part += c[d] * (mu[line * dk + d] + 0.5f * scaling * var * c[d]);
  }
  const float crest = block_sum_all(part, partials) * scaling;
  const float mass = topk_mass[line], rest = 1.f - mass;
  const bool safe = !no_rest && rest > 0.f;
  for (int64_t d = tid; d < dv; d += kBlock)
    rm[line * dv + d] =
        no_rest ? 0.f : (centroid_values[line * dv + d] - topk_values[line * dv + d]) / (safe ? rest : 1.f);
  if (tid == 0) {
    const float log_rest = rest > 0.f ? logf(rest) : -INFINITY;
    const float log_odds = no_rest ? -INFINITY : log_rest - logf(fmaxf(mass, kTiny));
    log_base[line] = log_odds + lzc - crest;
  }
}

struct ClusterStats {
  at::Tensor sums, squares, valid_count, slots, slot_at, used, mu, raw_var, rm, probs, log_base;
};

template <typename T>
ClusterStats cluster_stats(const at::Tensor& keys, const at::Tensor& valid, const at::Tensor& indices,
                           const at::Tensor& centroids, const at::Tensor& centroid_values,
                           const at::Tensor& topk_values, const at::Tensor& topk_mass, float scaling) {
  const int64_t rows = keys.size(0), heads = keys.size(1), n = keys.size(2), dk = keys.size(3);
  const int64_t clusters = indices.size(2), k = indices.size(3), dv = centroid_values.size(3);
  const int64_t rh = rows * heads, lines = rh * clusters;
  const auto f32 = keys.options().dtype(at::kFloat), i32 = keys.options().dtype(at::kInt);
  ClusterStats s{at::empty({rh, dk}, f32),         at::empty({rh, dk}, f32),        at::empty({rh}, i32),
                 at::empty({lines, k}, i32),       at::empty({lines, k}, i32),      at::empty({lines}, i32),
                 at::empty({lines, dk}, f32),      at::empty({lines, dk}, f32),     at::empty({lines, dv}, f32),
                 at::empty({lines, k}, f32),       at::empty({lines}, f32)};
  if (lines == 0) return s;
  const auto stream = at::cuda::getCurrentCUDAStream();
  key_sums_kernel<T><<<static_cast<unsigned int>(rh), 64, 0, stream>>>(
      keys.data_ptr<T>(), valid.data_ptr<bool>(), heads, n, dk, s.sums.data_ptr<float>(),
      s.squares.data_ptr<float>(), s.valid_count.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  cluster_stats_kernel<T><<<static_cast<unsigned int>(lines), kBlock, 0, stream>>>(
      keys.data_ptr<T>(), indices.data_ptr<int64_t>(), centroids.data_ptr<float>(),
      centroid_values.data_ptr<float>(), topk_values.data_ptr<float>(), topk_mass.data_ptr<float>(),
      s.sums.data_ptr<float>(), s.squares.data_ptr<float>(), s.valid_count.data_ptr<int32_t>(), n, clusters, k, dk,
      dv, scaling, s.slots.data_ptr<int32_t>(), s.slot_at.data_ptr<int32_t>(), s.used.data_ptr<int32_t>(),
      s.mu.data_ptr<float>(), s.raw_var.data_ptr<float>(), s.rm.data_ptr<float>(), s.probs.data_ptr<float>(),
      s.log_base.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return s;
}

// ---------------------------------------------------------------------------------------------------
// refine_with_query_mass forward: one block per (row-head, cluster), the cluster's used top-k keys and values
// staged in shared memory (chunks of kc), each warp one member at a time: the online softmax over the slots
// (max, sum of exponentials, weighted values), R(q) = s q . (mu + s / 2 var q), other = exp(A_j + R(q) -
// max) (= rho_i times the sum), out = (other * RM_j + sum_T e V) / (sum + other); other = inf: RM_j.
constexpr int kPlusWarps = 4;

template <typename T, int NV>
__global__ void query_mass_kernel(const T* __restrict__ q, const T* __restrict__ keys, const T* __restrict__ values,
                                  const int32_t* __restrict__ order, const int32_t* __restrict__ start,
                                  const int32_t* __restrict__ slots, const int32_t* __restrict__ used,
                                  const float* __restrict__ mu, const float* __restrict__ raw_var,
                                  const float* __restrict__ rm, const float* __restrict__ log_base, int64_t n,
                                  int64_t clusters, int64_t k, int64_t dk, int64_t dv, int kc, float scaling,
                                  float* __restrict__ out) {
  extern __shared__ float plus_smem[];
  const int64_t line = blockIdx.x, rh = line / clusters, c = line % clusters;
  const int32_t lo = start[rh * (clusters + 1) + c], hi = start[rh * (clusters + 1) + c + 1];
  if (lo == hi) return;  // an empty cluster
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  cuda::KeyChunk chunk{plus_smem, plus_smem + kc * (dk + 1), 0};
  float* mean = plus_smem + kc * (dk + 1 + dv);
  float* half_var = mean + dk;
  float* rest_mean = half_var + dk;
  float* qs = rest_mean + dv + warp * dk;
  for (int64_t d = threadIdx.x; d < dk; d += blockDim.x) {
    mean[d] = mu[line * dk + d];
    half_var[d] = 0.5f * scaling * fmaxf(raw_var[line * dk + d], 0.f);
  }
  for (int64_t d = threadIdx.x; d < dv; d += blockDim.x) rest_mean[d] = rm[line * dv + d];
  const int m = used[line];
  const int32_t* sl = slots + line * k;
  const float base = log_base[line];
  const int64_t chunks = (m + kc - 1) / kc;
  auto load_chunk = [&](int64_t ch) {
    const int64_t u0 = ch * kc;
    const int count = static_cast<int>(m - u0 < kc ? m - u0 : kc);
    for (int64_t x = threadIdx.x; x < static_cast<int64_t>(count) * dk; x += blockDim.x) {
      const int64_t u = x / dk, d = x % dk;
      chunk.keys[u * (dk + 1) + d] = static_cast<float>(keys[(rh * n + sl[u0 + u]) * dk + d]);
    }
    for (int64_t x = threadIdx.x; x < static_cast<int64_t>(count) * dv; x += blockDim.x) {
      const int64_t u = x / dv, d = x % dv;
      chunk.values[u * dv + d] = static_cast<float>(values[(rh * n + sl[u0 + u]) * dv + d]);
    }
    chunk.kc = count;
  };
  if (chunks == 1) load_chunk(0);
  __syncthreads();
  const int32_t members = hi - lo;
  for (int32_t wave = 0; wave < members; wave += kPlusWarps) {
    const int32_t mi = wave + warp;
    const bool live = mi < members;
    const int64_t i = live ? order[rh * n + lo + mi] : 0;
    if (live)
      for (int64_t d = lane; d < dk; d += kWarp) qs[d] = static_cast<float>(q[(rh * n + i) * dk + d]);
    __syncwarp();
    cuda::OnlineRow<NV> row;
    row.reset();
    for (int64_t ch = 0; ch < chunks; ++ch) {
      if (chunks > 1) {
        __syncthreads();
        load_chunk(ch);
        __syncthreads();
      }
      if (live) cuda::warp_attend<NV>(qs, chunk, static_cast<int>(dk), static_cast<int>(dv), scaling,
                                      [](int) { return true; }, row);
    }
    if (live) {
      float* o = out + (rh * n + i) * dv;
      float coef = 0.f, rest = 1.f;  // no key to refine (m = 0), or other = inf: the centroid's row
      if (m > 0) {
        float part = 0.f;
        for (int64_t d = lane; d < dk; d += kWarp) part += qs[d] * (mean[d] + half_var[d] * qs[d]);
        const float other = expf(base + cuda::warp_sum(part) * scaling - row.max);
        if (other < INFINITY) {
          coef = 1.f / (row.sum + other);
          rest = other * coef;
        }
      }
      for (int t = 0; t < NV; ++t) {
        const int64_t d = lane + t * kWarp;
        if (d < dv) o[d] = rest * rest_mean[d] + coef * row.acc[t];
      }
    }
    __syncwarp();
  }
}

// ---------------------------------------------------------------------------------------------------
// refine_with_query_mass backward (kernels/cpu/backward.cpp, whose steps and names this follows). Per member
// i of cluster j: P = softmax over T_j of s q.K, lzq its log-sum-exp, E = sum P V, qrest = R(q_i),
// o = A_j - lzq + qrest (+inf without a used slot), M = sigmoid(-o), out = M E + (1 - M) RM_j. One block per
// cluster, members in query order; per-slot numbers in the block's rows of `slot_buf` (2 x k floats).
__global__ void query_mass_backward_kernel(
    const float* __restrict__ grad, const float* __restrict__ q, const float* __restrict__ keys,
    const float* __restrict__ values, const float* __restrict__ centroids, const float* __restrict__ topk_mass,
    const int32_t* __restrict__ order, const int32_t* __restrict__ start, const int32_t* __restrict__ slots,
    const int32_t* __restrict__ slot_at, const int32_t* __restrict__ used, const int32_t* __restrict__ valid_count,
    const float* __restrict__ mu, const float* __restrict__ raw_var, const float* __restrict__ rm,
    const float* __restrict__ probs, const float* __restrict__ log_base, int64_t n, int64_t clusters, int64_t k,
    int64_t dk, int64_t dv, float scaling, float* __restrict__ slot_buf, float* __restrict__ dq,
    float* __restrict__ dcent, float* __restrict__ dcv, float* __restrict__ dmass, float* __restrict__ dtopv,
    float* __restrict__ key_rows, float* __restrict__ value_rows, float* __restrict__ g1_out,
    float* __restrict__ g2_out) {
  extern __shared__ float qmb_smem[];
  float* qs = qmb_smem;       // dk
  float* gs = qs + dk;        // dv
  float* d_rm = gs + dv;      // dv
  float* d_mu = d_rm + dv;    // dk
  float* d_var = d_mu + dk;   // dk
  __shared__ float partials[kWarps];
  __shared__ float shared_da;
  const int64_t line = blockIdx.x, rh = line / clusters, c = line % clusters;
  const int32_t lo = start[rh * (clusters + 1) + c], hi = start[rh * (clusters + 1) + c + 1];
  if (lo == hi) return;  // no member: every gradient of the cluster is 0 (the zeros they start as)
  const int tid = threadIdx.x;
  const int m = used[line];
  const int32_t* sl = slots + line * k;
  const int32_t* pos = slot_at + line * k;
  const float* K = keys + rh * n * dk;
  const float* V = values + rh * n * dv;
  const float* muj = mu + line * dk;
  const float* rvj = raw_var + line * dk;
  const float* rmj = rm + line * dv;
  const float* cj = centroids + line * dk;
  const float a_j = log_base[line];
  const float sc = scaling;
  float* p = slot_buf + line * 2 * k;  // softmax of the member's scores
  float* h = p + k;                    // g . V_u, then dS_u
  float* dkr = key_rows + line * k * dk;    // rows at the slots' positions among the k (zeroed)
  float* dvr = value_rows + line * k * dv;
  for (int64_t d = tid; d < dk; d += kBlock) d_mu[d] = d_var[d] = 0.f;
  for (int64_t d = tid; d < dv; d += kBlock) d_rm[d] = 0.f;
  float da = 0.f;  // thread 0's sum of d_o over the members, in query order
  for (int32_t t = lo; t < hi; ++t) {
    const int64_t i = order[rh * n + t];
    const float* qi = q + (rh * n + i) * dk;
    const float* gi = grad + (rh * n + i) * dv;
    __syncthreads();  // the previous member's readers of qs and gs are done
    for (int64_t d = tid; d < dk; d += kBlock) qs[d] = qi[d];
    for (int64_t d = tid; d < dv; d += kBlock) gs[d] = gi[d];
    __syncthreads();
    float top = -INFINITY;
    for (int u = tid; u < m; u += kBlock) {
      const float* key = K + static_cast<int64_t>(sl[u]) * dk;
      const float* value = V + static_cast<int64_t>(sl[u]) * dv;
      float s = 0.f, hv = 0.f;
      for (int64_t d = 0; d < dk; ++d) s = fmaf(qs[d], key[d], s);
      for (int64_t d = 0; d < dv; ++d) hv = fmaf(gs[d], value[d], hv);
      p[u] = s * sc;
      h[u] = hv;
      top = fmaxf(top, p[u]);
    }
    top = block_max_all(top, partials);
    float e_sum = 0.f;
    for (int u = tid; u < m; u += kBlock) e_sum += expf(p[u] - top);
    const float total = block_sum_all(e_sum, partials);
    for (int u = tid; u < m; u += kBlock) p[u] = expf(p[u] - top) / total;
    const float lzq = m > 0 ? top + logf(total) : -INFINITY;
    __syncthreads();  // p complete
    // d_own = g . (E - RM_j) with E = sum_u P_u V_u; qrest = R(q_i).
    float own_part = 0.f, rest_part = 0.f;
    for (int64_t d = tid; d < dv; d += kBlock) {
      float e = 0.f;
      for (int u = 0; u < m; ++u) e = fmaf(p[u], V[static_cast<int64_t>(sl[u]) * dv + d], e);
      own_part += gs[d] * (e - rmj[d]);
    }
    for (int64_t d = tid; d < dk; d += kBlock) {
      const float var = fmaxf(rvj[d], 0.f);
      rest_part += qs[d] * (muj[d] + 0.5f * sc * var * qs[d]);
    }
    const float d_own = block_sum_all(own_part, partials);
    const float qrest = block_sum_all(rest_part, partials) * sc;
    const float o = m == 0 ? INFINITY : a_j - lzq + qrest;
    const float own = 1.f / (1.f + expf(o));  // M_i = sigmoid(-o)
    const float d_o = isfinite(o) ? -d_own * own * (1.f - own) : 0.f;
    if (tid == 0) da += d_o;
    for (int64_t d = tid; d < dv; d += kBlock) d_rm[d] += (1.f - own) * gs[d];
    // The top-k part: dP_u = M g . V_u; dS_u = s (P_u (dP_u - sum P dP) - d_o P_u) (-lzq's gradient).
    float w_part = 0.f;
    for (int u = tid; u < m; u += kBlock) w_part += p[u] * (own * h[u]);
    const float weighted = block_sum_all(w_part, partials);
    for (int u = tid; u < m; u += kBlock) h[u] = sc * (p[u] * (own * h[u] - weighted) + (-d_o) * p[u]);
    __syncthreads();  // dS complete
    float* dqi = dq + (rh * n + i) * dk;
    for (int64_t d = tid; d < dk; d += kBlock) {
      float acc = 0.f;
      for (int u = 0; u < m; ++u) acc = fmaf(h[u], K[static_cast<int64_t>(sl[u]) * dk + d], acc);
      if (d_o != 0.f) {
        const float var = fmaxf(rvj[d], 0.f);
        acc += d_o * sc * (muj[d] + sc * var * qs[d]);
        d_mu[d] += d_o * sc * qs[d];
        d_var[d] += d_o * 0.5f * sc * sc * qs[d] * qs[d];
      }
      dqi[d] = acc;
    }
    for (int64_t e = tid; e < static_cast<int64_t>(m) * dk; e += kBlock) {
      const int64_t u = e / dk, d = e % dk;
      float* row = dkr + static_cast<int64_t>(pos[u]) * dk;
      row[d] = fmaf(h[u], qs[d], row[d]);
    }
    for (int64_t e = tid; e < static_cast<int64_t>(m) * dv; e += kBlock) {
      const int64_t u = e / dv, d = e % dv;
      float* row = dvr + static_cast<int64_t>(pos[u]) * dv;
      row[d] = fmaf(own * p[u], gs[d], row[d]);
    }
  }
  if (tid == 0) shared_da = da;
  __syncthreads();
  da = shared_da;
  // Back through RM_j = (Vc_j - Vtop_j) / rest_j, rest_j = 1 - m_j.
  const float mass = topk_mass[line], rest = 1.f - mass;
  const bool no_rest = static_cast<int64_t>(valid_count[rh]) - m <= 0;
  const bool safe = !no_rest && rest > 0.f;
  float rest_grad = 0.f;
  if (!no_rest) {
    const float inv = 1.f / (safe ? rest : 1.f);
    for (int64_t d = tid; d < dv; d += kBlock) {
      dcv[line * dv + d] = d_rm[d] * inv;
      dtopv[line * dv + d] = -(d_rm[d] * inv);
      rest_grad -= d_rm[d] * rmj[d] * inv;
    }
  }
  const float d_rest = block_sum_all(rest_grad, partials);
  const bool through_a = da != 0.f && isfinite(a_j);
  if (tid == 0) {
    float dm = safe ? -d_rest : 0.f;
    if (through_a) {  // log_odds = log(rest) - log(max(m, tiny))
      if (rest > 0.f) dm -= da / rest;
      if (mass > kTiny) dm -= da / mass;
    }
    dmass[line] = dm;
  }
  if (through_a) {
    // lzc_j: the centroid's softmax over the slots; then -crest_j.
    const float* pr = probs + line * k;
    for (int64_t d = tid; d < dk; d += kBlock) {
      float acc = 0.f;
      for (int u = 0; u < m; ++u) acc = fmaf(sc * da * pr[u], K[static_cast<int64_t>(sl[u]) * dk + d], acc);
      const float var = fmaxf(rvj[d], 0.f);
      dcent[line * dk + d] = acc - da * sc * (muj[d] + sc * var * cj[d]);
      d_mu[d] -= da * sc * cj[d];
      d_var[d] -= da * 0.5f * sc * sc * cj[d] * cj[d];
    }
    for (int64_t e = tid; e < static_cast<int64_t>(m) * dk; e += kBlock) {
      const int64_t u = e / dk, d = e % dk;
      float* row = dkr + static_cast<int64_t>(pos[u]) * dk;
      row[d] = fmaf(sc * da * pr[u], cj[d], row[d]);
    }
  }
  // The key statistics: var = max(0, m2 - mu^2), mu = (S - S_T) / count, m2 = (S2 - S2_T) / count. g1, g2: the
  // gradients on S and S2 (every valid key; summed over the clusters per head by key_rows_kernel) and, with
  // the other sign, on S_T and S2_T (this cluster's slots).
  const int64_t rest_count = static_cast<int64_t>(valid_count[rh]) - m;
  const float count = static_cast<float>(rest_count > 1 ? rest_count : 1);
  __syncthreads();  // d_mu, d_var complete
  for (int64_t d = tid; d < dk; d += kBlock) {
    const float dvar = rvj[d] >= 0.f ? d_var[d] : 0.f;
    const float dmu = d_mu[d] - 2.f * muj[d] * dvar;
    const float g1 = dmu / count, g2 = dvar / count;
    g1_out[line * dk + d] = g1;
    g2_out[line * dk + d] = g2;
    d_mu[d] = g1;
    d_var[d] = g2;
  }
  __syncthreads();
  for (int64_t e = tid; e < static_cast<int64_t>(m) * dk; e += kBlock) {
    const int64_t u = e / dk, d = e % dk;
    float* row = dkr + static_cast<int64_t>(pos[u]) * dk;
    row[d] -= d_mu[d] + 2.f * K[static_cast<int64_t>(sl[u]) * dk + d] * d_var[d];
  }
}

// Per (row, head): the gradients on the sums over every valid key (S, S2), summed over the clusters in order.
__global__ void key_stat_grads_kernel(const float* __restrict__ g1, const float* __restrict__ g2, int64_t clusters,
                                      int64_t dk, float* __restrict__ sum_grad, float* __restrict__ square_grad) {
  const int64_t rh = blockIdx.x;
  for (int64_t d = threadIdx.x; d < dk; d += blockDim.x) {
    float s1 = 0.f, s2 = 0.f;
    for (int64_t c = 0; c < clusters; ++c) {
      s1 += g1[(rh * clusters + c) * dk + d];
      s2 += g2[(rh * clusters + c) * dk + d];
    }
    sum_grad[rh * dk + d] = s1;
    square_grad[rh * dk + d] = s2;
  }
}

// Each key's gradients: its rows over the slots that hold it (the head's slots sorted by key, stably: in
// (cluster, slot) order), plus, for a valid key, the key statistics' part. One block per (row, head, key).
__global__ void key_rows_kernel(const int64_t* __restrict__ slot_order, const int64_t* __restrict__ bounds,
                                const float* __restrict__ key_rows, const float* __restrict__ value_rows,
                                const float* __restrict__ keys, const bool* __restrict__ valid,
                                const float* __restrict__ sum_grad, const float* __restrict__ square_grad,
                                int64_t heads, int64_t n, int64_t slots_per_head, int64_t dk, int64_t dv,
                                float* __restrict__ dkeys, float* __restrict__ dvalues) {
  const int64_t line = blockIdx.x, rh = line / n, l = line % n, r = rh / heads;
  const int64_t first = bounds[rh * (n + 1) + l], last = bounds[rh * (n + 1) + l + 1];
  const int64_t* so = slot_order + rh * slots_per_head;
  const bool ok = valid[r * n + l];
  for (int64_t d = threadIdx.x; d < dk; d += blockDim.x) {
    float acc = 0.f;
    for (int64_t e = first; e < last; ++e) acc += key_rows[(rh * slots_per_head + so[e]) * dk + d];
    if (ok) acc += sum_grad[rh * dk + d] + 2.f * keys[line * dk + d] * square_grad[rh * dk + d];
    dkeys[line * dk + d] = acc;
  }
  for (int64_t d = threadIdx.x; d < dv; d += blockDim.x) {
    float acc = 0.f;
    for (int64_t e = first; e < last; ++e) acc += value_rows[(rh * slots_per_head + so[e]) * dv + d];
    dvalues[line * dv + d] = acc;
  }
}

template <typename T>
void launch_query_mass(int nv, unsigned int blocks, size_t smem, const at::Tensor& q, const at::Tensor& kk,
                       const at::Tensor& v, const ClusterOrder& sorted, const ClusterStats& s, int64_t n,
                       int64_t clusters, int64_t k, int64_t dk, int64_t dv, int kc, float scaling, at::Tensor& out) {
  const auto stream = at::cuda::getCurrentCUDAStream();
#define BC_PLUS(NV)                                                                                            \
  query_mass_kernel<T, NV><<<blocks, kPlusWarps * kWarp, smem, stream>>>(                                      \
      q.data_ptr<T>(), kk.data_ptr<T>(), v.data_ptr<T>(), sorted.order.data_ptr<int32_t>(),                    \
      sorted.start.data_ptr<int32_t>(), s.slots.data_ptr<int32_t>(), s.used.data_ptr<int32_t>(),               \
      s.mu.data_ptr<float>(), s.raw_var.data_ptr<float>(), s.rm.data_ptr<float>(), s.log_base.data_ptr<float>(), \
      n, clusters, k, dk, dv, kc, scaling, out.data_ptr<float>())
  switch (nv) {
    case 1: BC_PLUS(1); break;
    case 2: BC_PLUS(2); break;
    case 4: BC_PLUS(4); break;
    case 8: BC_PLUS(8); break;
    default: BC_PLUS(16); break;
  }
#undef BC_PLUS
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void check_centroids(const at::Tensor& centroids, const at::Tensor& queries, int64_t clusters) {
  check_dim(centroids, 4, "centroids", "(R, H, C, Dk)");
  check_dtype(centroids, at::kFloat, "centroids");
  const int64_t rows = queries.size(0), heads = queries.size(1), dk = queries.size(3);
  TORCH_CHECK_VALUE(centroids.size(0) == rows && centroids.size(1) == heads && centroids.size(2) == clusters &&
                        centroids.size(3) == dk,
                    "centroids must be (R, H, C, Dk) = (", rows, ", ", heads, ", ", clusters, ", ", dk, "), got ",
                    centroids.sizes());
  check_same_device(centroids, queries, "centroids", "queries");
}

void check_head_dims(int64_t dk, int64_t dv, const char* op) {
  TORCH_CHECK_VALUE(dk <= cuda::kMaxHeadDim && dv <= cuda::kMaxHeadDim, "the CUDA ", op,
                    " supports head dims up to ", cuda::kMaxHeadDim, ", got Dk=", dk, ", Dv=", dv);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> lloyd_refine_cuda(const at::Tensor& queries,
                                                                 const at::Tensor& assignments, int64_t clusters,
                                                                 int64_t iterations) {
  check_dim(queries, 4, "queries", "(R, H, N, Dk)");
  check_attention_dtype(queries, "queries");
  TORCH_CHECK_VALUE(clusters >= 1, "clusters must be >= 1, got ", clusters);
  TORCH_CHECK_VALUE(iterations >= 0, "iterations must be >= 0, got ", iterations);
  const int64_t rows = queries.size(0), heads = queries.size(1), n = queries.size(2), dk = queries.size(3);
  check_assignments(assignments, rows, heads, n, queries);
  const c10::cuda::CUDAGuard guard(queries.device());
  const at::Tensor q = queries.to(at::kFloat).contiguous();  // the widened rows, read C times per round
  at::Tensor assign = assignments.contiguous().clone();
  const auto f32 = q.options();
  at::Tensor centroids = at::zeros({rows, heads, clusters, dk}, f32);
  at::Tensor counts = at::zeros({rows, heads, clusters}, f32);
  const int64_t rh = rows * heads, lines = rh * clusters;
  if (rh == 0 || n == 0) return {assign, centroids, counts};
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int means_threads = dk >= 128 ? 128 : (dk >= 64 ? 64 : 32);
  auto update_means = [&](const int32_t* changed) {
    const ClusterOrder sorted = sort_by_cluster(assign, clusters);
    lloyd_means_kernel<<<static_cast<unsigned int>(lines), means_threads, 0, stream>>>(
        q.data_ptr<float>(), sorted.order.data_ptr<int32_t>(), sorted.start.data_ptr<int32_t>(), changed, n,
        clusters, dk, centroids.data_ptr<float>(), counts.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  update_means(nullptr);
  if (iterations == 0) return {assign, centroids, counts};
  // changed[it][rh]: round it moved a query of (row, head) rh; a round that moved none ends its rounds.
  at::Tensor changed = at::zeros({iterations, rh}, q.options().dtype(at::kInt));
  at::Tensor bias = at::empty({lines}, f32);
  constexpr int kAssignThreads = 128;
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(clusters, 8192 / std::max<int64_t>(dk + 1, 1)));
  const size_t smem = static_cast<size_t>(chunk * (dk + 1)) * sizeof(float);
  const int64_t blocks_per_head = (n + kAssignThreads - 1) / kAssignThreads;
  for (int64_t it = 0; it < iterations; ++it) {
    lloyd_bias_kernel<<<blocks_for(lines, 128), 128, 0, stream>>>(centroids.data_ptr<float>(),
                                                                   counts.data_ptr<float>(), lines, dk,
                                                                   bias.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const int32_t* active = it == 0 ? nullptr : changed[it - 1].data_ptr<int32_t>();
    int32_t* moved = changed[it].data_ptr<int32_t>();
    lloyd_assign_kernel<<<static_cast<unsigned int>(rh * blocks_per_head), kAssignThreads, smem, stream>>>(
        q.data_ptr<float>(), centroids.data_ptr<float>(), bias.data_ptr<float>(), active, n, clusters, dk,
        blocks_per_head, chunk, assign.data_ptr<int64_t>(), moved);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    update_means(moved);
  }
  return {assign, centroids, counts};
}

at::Tensor refine_with_query_mass_cuda(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
                                       const at::Tensor& valid, const at::Tensor& assignments,
                                       const at::Tensor& centroids, const at::Tensor& centroid_values,
                                       const at::Tensor& topk_indices, const at::Tensor& topk_mass,
                                       const at::Tensor& topk_values, double scaling, double dropout,
                                       int64_t /*seed*/) {
  check_no_dropout(dropout, "refine_with_query_mass");
  check_refine_args(queries, keys, values, assignments, centroid_values, topk_indices, topk_mass, topk_values);
  const int64_t rows = queries.size(0), heads = queries.size(1), n = queries.size(2);
  const int64_t dk = queries.size(3), dv = values.size(3);
  const int64_t clusters = centroid_values.size(2), k = topk_indices.size(3);
  check_valid(valid, rows, n, queries);
  check_centroids(centroids, queries, clusters);
  check_head_dims(dk, dv, "refine_with_query_mass");
  const c10::cuda::CUDAGuard guard(queries.device());
  const at::Tensor q = queries.contiguous(), kk = keys.contiguous(), v = values.contiguous();
  const at::Tensor ok = valid.contiguous(), a = assignments.contiguous(), cen = centroids.contiguous();
  const at::Tensor cv = centroid_values.contiguous(), ti = topk_indices.contiguous();
  const at::Tensor tm = topk_mass.contiguous(), tv = topk_values.contiguous();
  at::Tensor out = at::zeros({rows, heads, n, dv}, q.options().dtype(at::kFloat));  // padded queries: zeros
  const int64_t lines = rows * heads * clusters;
  if (out.numel() == 0 || lines == 0) return out;
  const float sc = static_cast<float>(scaling);
  const ClusterOrder sorted = sort_by_cluster(a, clusters);
  // Chunks of kc keys: the chunk, the cluster's mean, half variance and rest mean, and a query per warp in 48 KiB.
  const int64_t budget = 48 * 1024 / 4 - kPlusWarps * dk - 2 * dk - dv;
  const int kc = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(32, budget / (dk + 1 + dv))));
  const size_t smem = static_cast<size_t>(kc * (dk + 1 + dv) + 2 * dk + dv + kPlusWarps * dk) * sizeof(float);
  const int nv = cuda::lanes_per_dim_bucket(dv);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "refine_with_query_mass_cuda", [&] {
    const ClusterStats stats = cluster_stats<scalar_t>(kk, ok, ti, cen, cv, tv, tm, sc);
    launch_query_mass<scalar_t>(nv, static_cast<unsigned int>(lines), smem, q, kk, v, sorted, stats, n, clusters,
                                k, dk, dv, kc, sc, out);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
refine_with_query_mass_backward_cuda(const at::Tensor& grad_out, const at::Tensor& queries, const at::Tensor& keys,
                                     const at::Tensor& values, const at::Tensor& valid, const at::Tensor& assignments,
                                     const at::Tensor& centroids, const at::Tensor& centroid_values,
                                     const at::Tensor& topk_indices, const at::Tensor& topk_mass,
                                     const at::Tensor& topk_values, double scaling, double dropout,
                                     int64_t /*seed*/) {
  check_no_dropout(dropout, "refine_with_query_mass_backward");
  check_qkv(queries, keys, values);
  const int64_t rows = queries.size(0), heads = queries.size(1), n = queries.size(2);
  const int64_t dk = queries.size(3), dv = values.size(3);
  // float32 in the backward (ops.py widens fp16 / bf16 once), as the CPU kernel.
  for (auto [t, name] : {std::pair{&grad_out, "grad_out"}, {&queries, "queries"}, {&keys, "keys"},
                         {&values, "values"}, {&centroids, "centroids"}, {&centroid_values, "centroid_values"},
                         {&topk_mass, "topk_mass"}, {&topk_values, "topk_values"}})
    TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat, name, " must be float32 in the backward, got ",
                     t->scalar_type());
  TORCH_CHECK_VALUE(grad_out.sizes() == values.sizes(), "grad_out must be (R, H, N, Dv) = ", values.sizes(),
                    ", got ", grad_out.sizes());
  check_refine_args(queries, keys, values, assignments, centroid_values, topk_indices, topk_mass, topk_values);
  const int64_t clusters = centroid_values.size(2), k = topk_indices.size(3);
  check_valid(valid, rows, n, queries);
  check_centroids(centroids, queries, clusters);
  check_head_dims(dk, dv, "refine_with_query_mass_backward");
  const c10::cuda::CUDAGuard guard(queries.device());
  const at::Tensor g = grad_out.contiguous(), q = queries.contiguous(), kk = keys.contiguous();
  const at::Tensor v = values.contiguous(), ok = valid.contiguous(), a = assignments.contiguous();
  const at::Tensor cen = centroids.contiguous(), cv = centroid_values.contiguous(), ti = topk_indices.contiguous();
  const at::Tensor tm = topk_mass.contiguous(), tv = topk_values.contiguous();
  const auto f32 = q.options();
  at::Tensor dq = at::zeros({rows, heads, n, dk}, f32);
  at::Tensor dkeys = at::zeros({rows, heads, n, dk}, f32);
  at::Tensor dvalues = at::zeros({rows, heads, n, dv}, f32);
  at::Tensor dcent = at::zeros({rows, heads, clusters, dk}, f32);
  at::Tensor dcv = at::zeros({rows, heads, clusters, dv}, f32);
  at::Tensor dmass = at::zeros({rows, heads, clusters}, f32);
  at::Tensor dtopv = at::zeros({rows, heads, clusters, dv}, f32);
  const int64_t rh = rows * heads, lines = rh * clusters;
  if (lines == 0 || n == 0) return {dq, dkeys, dvalues, dcent, dcv, dmass, dtopv};
  const float sc = static_cast<float>(scaling);
  const auto stream = at::cuda::getCurrentCUDAStream();
  const ClusterStats s = cluster_stats<float>(kk, ok, ti, cen, cv, tv, tm, sc);
  const ClusterOrder sorted = sort_by_cluster(a, clusters);
  at::Tensor slot_buf = at::empty({lines, 2 * k}, f32);
  at::Tensor key_rows = at::zeros({lines, k, dk}, f32), value_rows = at::zeros({lines, k, dv}, f32);
  at::Tensor g1 = at::zeros({lines, dk}, f32), g2 = at::zeros({lines, dk}, f32);
  const size_t smem = static_cast<size_t>(3 * dk + 2 * dv) * sizeof(float);  // 30 KiB at Dk = Dv = 512
  query_mass_backward_kernel<<<static_cast<unsigned int>(lines), kBlock, smem, stream>>>(
      g.data_ptr<float>(), q.data_ptr<float>(), kk.data_ptr<float>(), v.data_ptr<float>(), cen.data_ptr<float>(),
      tm.data_ptr<float>(), sorted.order.data_ptr<int32_t>(), sorted.start.data_ptr<int32_t>(),
      s.slots.data_ptr<int32_t>(), s.slot_at.data_ptr<int32_t>(), s.used.data_ptr<int32_t>(),
      s.valid_count.data_ptr<int32_t>(), s.mu.data_ptr<float>(), s.raw_var.data_ptr<float>(), s.rm.data_ptr<float>(),
      s.probs.data_ptr<float>(), s.log_base.data_ptr<float>(), n, clusters, k, dk, dv, sc,
      slot_buf.data_ptr<float>(), dq.data_ptr<float>(), dcent.data_ptr<float>(), dcv.data_ptr<float>(),
      dmass.data_ptr<float>(), dtopv.data_ptr<float>(), key_rows.data_ptr<float>(), value_rows.data_ptr<float>(),
      g1.data_ptr<float>(), g2.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  at::Tensor sum_grad = at::empty({rh, dk}, f32), square_grad = at::empty({rh, dk}, f32);
  if (dk > 0) {
    key_stat_grads_kernel<<<static_cast<unsigned int>(rh), 64, 0, stream>>>(
        g1.data_ptr<float>(), g2.data_ptr<float>(), clusters, dk, sum_grad.data_ptr<float>(),
        square_grad.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  // Each head's C x k slots sorted by key, stably (ties keep (cluster, slot) order; -1 slots first), and where
  // each key's run starts: all on the device.
  const int64_t per_head = clusters * k;
  at::Tensor slot_order, bounds;
  if (per_head > 0) {
    const auto sorted_slots = at::sort(ti.view({rh, per_head}), /*stable=*/true, /*dim=*/-1, /*descending=*/false);
    slot_order = std::get<1>(sorted_slots).contiguous();
    const at::Tensor positions = at::arange(n + 1, ti.options()).expand({rh, n + 1}).contiguous();
    bounds = at::searchsorted(std::get<0>(sorted_slots).contiguous(), positions).contiguous();
  } else {
    slot_order = at::zeros({rh, 1}, ti.options());
    bounds = at::zeros({rh, n + 1}, ti.options());
  }
  key_rows_kernel<<<static_cast<unsigned int>(rh * n), 64, 0, stream>>>(
      slot_order.data_ptr<int64_t>(), bounds.data_ptr<int64_t>(), key_rows.data_ptr<float>(),
      value_rows.data_ptr<float>(), kk.data_ptr<float>(), ok.data_ptr<bool>(), sum_grad.data_ptr<float>(),
      square_grad.data_ptr<float>(), heads, n, per_head, dk, dv, dkeys.data_ptr<float>(), dvalues.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {dq, dkeys, dvalues, dcent, dcv, dmass, dtopv};
}

TORCH_LIBRARY_IMPL(bert_cluster, CUDA, m) {
  m.impl("lloyd_refine", &lloyd_refine_cuda);
  m.impl("refine_with_query_mass", &refine_with_query_mass_cuda);
  m.impl("refine_with_query_mass_backward", &refine_with_query_mass_backward_cuda);
}

}  // namespace bert_cluster
