// group_queries, centroid_attention, topk_refine, broadcast_clusters and exact_attention on CUDA, on the
// current stream. Softmax and accumulation in float32; see bert_cluster/reference.py for the rules.
// Dense products go through cuBLAS (at::matmul, the reference's own calls, so the scores that rank the
// keys are the reference's); top-k uses ATen's stable segmented sort (ties to the lowest index, as the
// reference); refinement is one warp per query with an online softmax over the cluster's top-k keys.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>

#include "../checks.h"

namespace bert_cluster {
namespace {

constexpr int kThreads = 256;
constexpr int kWarp = 32;
constexpr int kMaxPerLane = 8;  // refine keeps Dk and Dv in registers: at most 32 * 8 = 256 features

inline unsigned int blocks_for(int64_t count, int threads) {
  return static_cast<unsigned int>((count + threads - 1) / threads);
}

__device__ inline float warp_sum(float x) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

__device__ inline float warp_max(float x) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

// Block-wide reduction (sum or max) through shared memory; every thread gets the result.
template <bool kMax>
__device__ float block_reduce(float x, float* shared) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  x = kMax ? warp_max(x) : warp_sum(x);
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  const int warps = (blockDim.x + kWarp - 1) / kWarp;
  float y = threadIdx.x < warps ? shared[threadIdx.x] : (kMax ? -INFINITY : 0.f);
  if (warp == 0) y = kMax ? warp_max(y) : warp_sum(y);
  if (threadIdx.x == 0) shared[0] = y;
  __syncthreads();
  const float result = shared[0];
  __syncthreads();
  return result;
}

// One thread per (row-head, cluster, feature): a deterministic sum over the queries in index order.
template <typename scalar_t>
__global__ void group_kernel(const scalar_t* __restrict__ q, const int64_t* __restrict__ assign, int64_t n,
                             int64_t clusters, int64_t dk, int64_t total, float* __restrict__ sums,
                             float* __restrict__ counts) {
  const int64_t x = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (x >= total) return;
  const int64_t d = x % dk, c = (x / dk) % clusters, rh = x / (dk * clusters);
  const int64_t* a = assign + rh * n;
  const scalar_t* qr = q + rh * n * dk;
  float sum = 0.f, count = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    if (a[i] == c) {
      sum += static_cast<float>(qr[i * dk + d]);
      count += 1.f;
    }
  }
  sums[x] = sum / fmaxf(count, 1.f);
  if (d == 0) counts[rh * clusters + c] = count;
}

// One block per (row-head, cluster) row of scores: scale, mask padded keys, softmax in place; the scaled
// scores (padded keys at -inf) go to `scaled` for ranking when it is not null.
__global__ void softmax_rows_kernel(float* __restrict__ scores, float* __restrict__ scaled,
                                    const bool* __restrict__ valid, int64_t rows_per_batch_row, int64_t n,
                                    float scaling, const bool* __restrict__ query_valid, int64_t queries_per_row) {
  __shared__ float shared[kWarp];
  const int64_t row = blockIdx.x;
  const int64_t r = row / rows_per_batch_row;
  float* s = scores + row * n;
  const bool* ok = valid + r * n;
  // exact attention: a padded query's row is all zeros
  const bool live = query_valid == nullptr || query_valid[r * queries_per_row + row % queries_per_row];
  float mx = -INFINITY;
  for (int64_t l = threadIdx.x; l < n; l += blockDim.x) {
    const float x = ok[l] ? s[l] * scaling : -INFINITY;
    s[l] = x;
    if (scaled != nullptr) scaled[row * n + l] = x;
    mx = fmaxf(mx, x);
  }
  mx = block_reduce<true>(mx, shared);
  if (mx == -INFINITY || !live) {
    for (int64_t l = threadIdx.x; l < n; l += blockDim.x) s[l] = 0.f;
    return;
  }
  float sum = 0.f;
  for (int64_t l = threadIdx.x; l < n; l += blockDim.x) {
    const float e = ok[l] ? expf(s[l] - mx) : 0.f;
    s[l] = e;
    sum += e;
  }
  sum = block_reduce<false>(sum, shared);
  const float inv = 1.f / sum;
  for (int64_t l = threadIdx.x; l < n; l += blockDim.x) s[l] *= inv;
}

// One block per (row-head, cluster): the first k keys of the stable descending sort, -1 for padded
// ones; their total weight (mass) and weighted value sum (topk_values), features over threads.
__global__ void topk_gather_kernel(const float* __restrict__ weights, const int64_t* __restrict__ order,
                                   const float* __restrict__ sorted_scores, const float* __restrict__ values,
                                   int64_t clusters, int64_t n, int64_t k, int64_t dv, int64_t* __restrict__ indices,
                                   float* __restrict__ mass, float* __restrict__ top_values) {
  __shared__ float shared[kWarp];
  const int64_t row = blockIdx.x;
  const int64_t rh = row / clusters;
  const float* w = weights + row * n;
  const int64_t* o = order + row * n;
  const float* ss = sorted_scores + row * n;
  float m = 0.f;
  for (int64_t j = threadIdx.x; j < k; j += blockDim.x) {
    const bool picked = ss[j] != -INFINITY;
    indices[row * k + j] = picked ? o[j] : -1;
    if (picked) m += w[o[j]];
  }
  m = block_reduce<false>(m, shared);
  if (threadIdx.x == 0) mass[row] = m;
  for (int64_t d = threadIdx.x; d < dv; d += blockDim.x) {
    float acc = 0.f;
    for (int64_t j = 0; j < k; ++j) {
      if (ss[j] == -INFINITY) break;  // padded keys sort last
      const int64_t l = o[j];
      acc += w[l] * values[(rh * n + l) * dv + d];
    }
    top_values[row * dv + d] = acc;
  }
}

// One warp per query: exact scores against its cluster's top-k keys, an online softmax, and the combine
// V_hat = (Vc - Vtop) + m * sum_l softmax_l V_l. Lane t holds features t, t + 32, ... in registers.
template <typename scalar_t>
__global__ void refine_kernel(const scalar_t* __restrict__ q, const scalar_t* __restrict__ keys,
                              const scalar_t* __restrict__ values, const int64_t* __restrict__ assign,
                              const float* __restrict__ centroid_values, const int64_t* __restrict__ topk_indices,
                              const float* __restrict__ topk_mass, const float* __restrict__ topk_values,
                              int64_t total, int64_t n, int64_t clusters, int64_t k, int64_t dk, int64_t dv,
                              float scaling, float* __restrict__ out) {
  const int64_t query = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (query >= total) return;  // whole warps exit together: total is per warp
  const int64_t rh = query / n;
  float* o = out + query * dv;
  const int64_t c = assign[query];
  if (c < 0 || c >= clusters) {
    for (int64_t d = lane; d < dv; d += kWarp) o[d] = 0.f;
    return;
  }
  float qr[kMaxPerLane];
  for (int t = 0; t < kMaxPerLane; ++t) {
    const int64_t d = lane + t * kWarp;
    qr[t] = d < dk ? static_cast<float>(q[query * dk + d]) : 0.f;
  }
  float acc[kMaxPerLane];
  for (int t = 0; t < kMaxPerLane; ++t) acc[t] = 0.f;
  float running_max = -INFINITY, running_sum = 0.f;
  const int64_t* idx = topk_indices + (rh * clusters + c) * k;
  for (int64_t j = 0; j < k; ++j) {
    const int64_t l = idx[j];
    if (l < 0 || l >= n) continue;
    const scalar_t* key = keys + (rh * n + l) * dk;
    float partial = 0.f;
    for (int t = 0; t < kMaxPerLane; ++t) {
      const int64_t d = lane + t * kWarp;
      if (d < dk) partial += qr[t] * static_cast<float>(key[d]);
    }
    const float s = warp_sum(partial) * scaling;
    const float new_max = fmaxf(running_max, s);
    const float rescale = expf(running_max - new_max);  // 0 on the first key (running_max = -inf)
    const float e = expf(s - new_max);
    running_sum = running_sum * rescale + e;
    const scalar_t* value = values + (rh * n + l) * dv;
    for (int t = 0; t < kMaxPerLane; ++t) {
      const int64_t d = lane + t * kWarp;
      acc[t] = acc[t] * rescale + (d < dv ? e * static_cast<float>(value[d]) : 0.f);
    }
    running_max = new_max;
  }
  const int64_t cluster_row = rh * clusters + c;
  const float coef = running_sum > 0.f ? topk_mass[cluster_row] / running_sum : 0.f;
  for (int t = 0; t < kMaxPerLane; ++t) {
    const int64_t d = lane + t * kWarp;
    if (d < dv)
      o[d] = (centroid_values[cluster_row * dv + d] - topk_values[cluster_row * dv + d]) + coef * acc[t];
  }
}

template <typename scalar_t>
__global__ void broadcast_kernel(const scalar_t* __restrict__ centroid_values, const int64_t* __restrict__ assign,
                                 int64_t n, int64_t clusters, int64_t dv, int64_t total, scalar_t* __restrict__ out) {
  const int64_t x = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (x >= total) return;
  const int64_t d = x % dv, i = x / dv, rh = i / n;
  const int64_t c = assign[i];
  out[x] = (c < 0 || c >= clusters) ? scalar_t(0) : centroid_values[(rh * clusters + c) * dv + d];
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> group_queries_cuda(const at::Tensor& queries, const at::Tensor& assignments,
                                                      int64_t clusters) {
  check_dim(queries, 4, "queries", "(R, H, N, Dk)");
  check_attention_dtype(queries, "queries");
  TORCH_CHECK_VALUE(clusters >= 1, "clusters must be >= 1, got ", clusters);
  const int64_t rows = queries.size(0), heads = queries.size(1), n = queries.size(2), dk = queries.size(3);
  check_assignments(assignments, rows, heads, n, queries);
  const c10::cuda::CUDAGuard guard(queries.device());
  const at::Tensor q = queries.contiguous(), a = assignments.contiguous();
  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor sums = at::empty({rows, heads, clusters, dk}, f32);
  at::Tensor counts = at::zeros({rows, heads, clusters}, f32);
  const int64_t total = sums.numel();
  if (total == 0) return {sums, counts};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "group_queries_cuda", [&] {
    group_kernel<scalar_t><<<blocks_for(total, kThreads), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        q.data_ptr<scalar_t>(), a.data_ptr<int64_t>(), n, clusters, dk, total, sums.data_ptr<float>(),
        counts.data_ptr<float>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {sums, counts};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> centroid_attention_cuda(
    const at::Tensor& centroids, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& valid,
    int64_t topk, double scaling) {
  check_centroid_args(centroids, keys, values, valid, topk);
  const c10::cuda::CUDAGuard guard(keys.device());
  const int64_t rows = keys.size(0), heads = keys.size(1), n = keys.size(2), dv = values.size(3);
  const int64_t clusters = centroids.size(2);
  const int64_t k = std::min(topk, n);
  const auto stream = at::cuda::getCurrentCUDAStream();
  at::Tensor weights = at::matmul(centroids, keys.to(at::kFloat).transpose(-1, -2)).contiguous();
  const at::Tensor v = values.to(at::kFloat).contiguous();
  const at::Tensor ok = valid.contiguous();
  const int64_t lines = rows * heads * clusters;
  at::Tensor scaled = k > 0 ? at::empty_like(weights) : at::Tensor();
  if (lines > 0 && n > 0) {
    softmax_rows_kernel<<<static_cast<unsigned int>(lines), kThreads, 0, stream>>>(
        weights.data_ptr<float>(), k > 0 ? scaled.data_ptr<float>() : nullptr, ok.data_ptr<bool>(),
        heads * clusters, n, static_cast<float>(scaling), nullptr, 1);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  at::Tensor centroid_values = at::matmul(weights, v);
  const auto f32 = weights.options();
  at::Tensor indices = at::full({rows, heads, clusters, k}, -1, keys.options().dtype(at::kLong));
  at::Tensor mass = at::zeros({rows, heads, clusters}, f32);
  at::Tensor top_values = at::zeros({rows, heads, clusters, dv}, f32);
  if (k == 0 || lines == 0) return {centroid_values, indices, mass, top_values};
  // Stable descending sort of the scaled scores: ties keep the lowest key index first, padded keys
  // (-inf) go last, as in the reference.
  const auto sorted = at::sort(scaled, /*stable=*/true, /*dim=*/-1, /*descending=*/true);
  const at::Tensor sorted_scores = std::get<0>(sorted).contiguous();
  const at::Tensor order = std::get<1>(sorted).contiguous();
  topk_gather_kernel<<<static_cast<unsigned int>(lines), 128, 0, stream>>>(
      weights.data_ptr<float>(), order.data_ptr<int64_t>(), sorted_scores.data_ptr<float>(), v.data_ptr<float>(),
      clusters, n, k, dv, indices.data_ptr<int64_t>(), mass.data_ptr<float>(), top_values.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {centroid_values, indices, mass, top_values};
}

at::Tensor topk_refine_cuda(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& assignments, const at::Tensor& centroid_values,
                            const at::Tensor& topk_indices, const at::Tensor& topk_mass, const at::Tensor& topk_values,
                            double scaling) {
  check_refine_args(queries, keys, values, assignments, centroid_values, topk_indices, topk_mass, topk_values);
  const int64_t rows = queries.size(0), heads = queries.size(1), n = queries.size(2);
  const int64_t dk = queries.size(3), dv = values.size(3);
  TORCH_CHECK_VALUE(dk <= kWarp * kMaxPerLane && dv <= kWarp * kMaxPerLane,
                    "the CUDA topk_refine supports head dims up to ", kWarp * kMaxPerLane, ", got Dk=", dk, ", Dv=", dv);
  TORCH_CHECK_TYPE(queries.scalar_type() == keys.scalar_type() && keys.scalar_type() == values.scalar_type(),
                   "queries, keys and values must share one dtype, got ", queries.scalar_type(), ", ",
                   keys.scalar_type(), ", ", values.scalar_type());
  const c10::cuda::CUDAGuard guard(queries.device());
  const at::Tensor q = queries.contiguous(), kk = keys.contiguous(), v = values.contiguous();
  const at::Tensor a = assignments.contiguous(), cv = centroid_values.contiguous();
  const at::Tensor ti = topk_indices.contiguous(), tm = topk_mass.contiguous(), tv = topk_values.contiguous();
  at::Tensor out = at::empty({rows, heads, n, dv}, q.options().dtype(at::kFloat));
  const int64_t total = rows * heads * n;
  if (total == 0 || dv == 0) return out.zero_();
  const int64_t clusters = cv.size(2), k = ti.size(3);
  const int warps_per_block = kThreads / kWarp;
  const auto blocks = static_cast<unsigned int>((total + warps_per_block - 1) / warps_per_block);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "topk_refine_cuda", [&] {
    refine_kernel<scalar_t><<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        q.data_ptr<scalar_t>(), kk.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), a.data_ptr<int64_t>(),
        cv.data_ptr<float>(), ti.data_ptr<int64_t>(), tm.data_ptr<float>(), tv.data_ptr<float>(), total, n, clusters,
        k, dk, dv, static_cast<float>(scaling), out.data_ptr<float>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor broadcast_clusters_cuda(const at::Tensor& centroid_values, const at::Tensor& assignments) {
  check_broadcast_args(centroid_values, assignments);
  const c10::cuda::CUDAGuard guard(centroid_values.device());
  const at::Tensor cv = centroid_values.contiguous(), a = assignments.contiguous();
  const int64_t rows = a.size(0), heads = a.size(1), n = a.size(2);
  const int64_t clusters = cv.size(2), dv = cv.size(3);
  at::Tensor out = at::empty({rows, heads, n, dv}, cv.options());
  const int64_t total = out.numel();
  if (total == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, cv.scalar_type(), "broadcast_clusters_cuda", [&] {
    broadcast_kernel<scalar_t><<<blocks_for(total, kThreads), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        cv.data_ptr<scalar_t>(), a.data_ptr<int64_t>(), n, clusters, dv, total, out.data_ptr<scalar_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor exact_attention_cuda(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
                                const at::Tensor& valid, double scaling) {
  check_qkv(queries, keys, values);
  const int64_t rows = queries.size(0), heads = queries.size(1), n = queries.size(2);
  check_valid(valid, rows, n, queries);
  const c10::cuda::CUDAGuard guard(queries.device());
  at::Tensor weights = at::matmul(queries.to(at::kFloat), keys.to(at::kFloat).transpose(-1, -2)).contiguous();
  const at::Tensor ok = valid.contiguous();
  const int64_t lines = rows * heads * n;
  if (lines > 0) {
    softmax_rows_kernel<<<static_cast<unsigned int>(lines), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        weights.data_ptr<float>(), nullptr, ok.data_ptr<bool>(), heads * n, n, static_cast<float>(scaling),
        ok.data_ptr<bool>(), n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return at::matmul(weights, values.to(at::kFloat));
}

TORCH_LIBRARY_IMPL(bert_cluster, CUDA, m) {
  m.impl("group_queries", &group_queries_cuda);
  m.impl("centroid_attention", &centroid_attention_cuda);
  m.impl("topk_refine", &topk_refine_cuda);
  m.impl("broadcast_clusters", &broadcast_clusters_cuda);
  m.impl("exact_attention", &exact_attention_cuda);
}

}  // namespace bert_cluster
