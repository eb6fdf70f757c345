// group_queries, centroid_attention, topk_refine and broadcast_clusters on CUDA, on the current stream, with
// no host synchronisation. Softmax and accumulation in float32; see bert_cluster/reference.py for the rules.
//
// - A stable counting sort per (row, head) puts each cluster's members in index order (shared-memory
//   histogram, then a warp-by-warp scatter): group_queries sums each cluster's members in that order (each
//   query read once, a deterministic sum), topk_refine gives one block to each cluster.
// - centroid_attention: scores and Vc through cuBLAS (at::matmul, as the reference); the top-k is torch.topk
//   on one int64 per key (order key of the score, then ~index): all distinct, so the answer is the
//   reference's order and tie rule, without sorting N scores.
// - topk_refine: one block per cluster stages the cluster's top-k keys and values in shared memory once;
//   each warp takes one member at a time (warp_attend in common.cuh).
// Assignments and top-k indices out of range fail a device-side assertion (as torch's own index checks),
// where the CPU kernels raise ValueError; checking them on the host would need a synchronisation.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>

#include "../checks.h"
#include "cluster_order.cuh"
#include "common.cuh"

namespace bert_cluster {
namespace {

using cuda::blocks_for;
using cuda::ClusterOrder;
using cuda::kWarp;
using cuda::sort_by_cluster;

constexpr int kThreads = 256;
// ---------------------------------------------------------------------------------------------------
// group_queries: one block per (row-head, cluster), threads over features, members in index order.
template <typename scalar_t>
__global__ void group_kernel(const scalar_t* __restrict__ q, const int32_t* __restrict__ order,
                             const int32_t* __restrict__ start, int64_t n, int64_t clusters, int64_t dk,
                             float* __restrict__ sums, float* __restrict__ counts) {
  const int64_t line = blockIdx.x, rh = line / clusters, c = line % clusters;
  const int32_t lo = start[rh * (clusters + 1) + c], hi = start[rh * (clusters + 1) + c + 1];
  const float count = static_cast<float>(hi - lo);
  for (int64_t d = threadIdx.x; d < dk; d += blockDim.x) {
    float sum = 0.f;
    for (int32_t m = lo; m < hi; ++m) sum += static_cast<float>(q[(rh * n + order[rh * n + m]) * dk + d]);
    sums[line * dk + d] = sum / fmaxf(count, 1.f);
  }
  if (threadIdx.x == 0) counts[line] = count;
}

// ---------------------------------------------------------------------------------------------------
// centroid_attention: one block per centroid row. Scales and masks the scores, writes the rank keys, and
// turns the row into softmax weights in place (a row with no valid key: all zeros).
__global__ void softmax_rank_kernel(float* __restrict__ scores, int64_t* __restrict__ keys,
                                    const bool* __restrict__ valid, int64_t rows_per_batch_row, int64_t n,
                                    float scaling) {
  __shared__ float shared[kWarp];
  const int64_t row = blockIdx.x;
  const int64_t r = row / rows_per_batch_row;
  float* s = scores + row * n;
  const bool* ok = valid + r * n;
  float mx = -INFINITY;
  for (int64_t l = threadIdx.x; l < n; l += blockDim.x) {
    const float x = ok[l] ? s[l] * scaling : -INFINITY;
    s[l] = x;
    if (keys != nullptr) keys[row * n + l] = cuda::rank_key(x, l);
    mx = fmaxf(mx, x);
  }
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = (blockDim.x + kWarp - 1) / kWarp;
  mx = cuda::warp_max(mx);
  if (lane == 0) shared[warp] = mx;
  __syncthreads();
  mx = threadIdx.x < warps ? shared[threadIdx.x] : -INFINITY;
  mx = cuda::warp_max(mx);
  __syncthreads();
  if (threadIdx.x == 0) shared[0] = mx;
  __syncthreads();
  mx = shared[0];
  __syncthreads();
  if (mx == -INFINITY) {
    for (int64_t l = threadIdx.x; l < n; l += blockDim.x) s[l] = 0.f;
    return;
  }
  float sum = 0.f;
  for (int64_t l = threadIdx.x; l < n; l += blockDim.x) {
    const float e = s[l] == -INFINITY ? 0.f : expf(s[l] - mx);
    s[l] = e;
    sum += e;
  }
  sum = cuda::warp_sum(sum);
  if (lane == 0) shared[warp] = sum;
  __syncthreads();
  sum = threadIdx.x < warps ? shared[threadIdx.x] : 0.f;
  sum = cuda::warp_sum(sum);
  __syncthreads();
  if (threadIdx.x == 0) shared[0] = sum;
  __syncthreads();
  const float inv = 1.f / shared[0];
  for (int64_t l = threadIdx.x; l < n; l += blockDim.x) s[l] *= inv;
}

// One block per centroid row: decode the top-k rank keys (a -inf score: a padded key, index -1), their
// total weight and weighted value sum.
__global__ void topk_gather_kernel(const float* __restrict__ weights, const int64_t* __restrict__ top_keys,
                                   const float* __restrict__ values, int64_t clusters, int64_t n, int64_t k,
                                   int64_t dv, int64_t* __restrict__ indices, float* __restrict__ mass,
                                   float* __restrict__ top_values) {
  __shared__ float shared[kWarp];
  const int64_t row = blockIdx.x;
  const int64_t rh = row / clusters;
  const float* w = weights + row * n;
  const int64_t* keys = top_keys + row * k;
  float m = 0.f;
  for (int64_t j = threadIdx.x; j < k; j += blockDim.x) {
    const bool picked = cuda::rank_key_score(keys[j]) != -INFINITY;
    const int64_t l = cuda::rank_key_index(keys[j]);
    indices[row * k + j] = picked ? l : -1;
    if (picked) m += w[l];
  }
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = (blockDim.x + kWarp - 1) / kWarp;
  m = cuda::warp_sum(m);
  if (lane == 0) shared[warp] = m;
  __syncthreads();
  m = threadIdx.x < warps ? shared[threadIdx.x] : 0.f;
  m = cuda::warp_sum(m);
  if (threadIdx.x == 0) mass[row] = m;
  for (int64_t d = threadIdx.x; d < dv; d += blockDim.x) {
    float acc = 0.f;
    for (int64_t j = 0; j < k; ++j) {
      if (cuda::rank_key_score(keys[j]) == -INFINITY) break;  // padded keys rank last
      const int64_t l = cuda::rank_key_index(keys[j]);
      acc += w[l] * values[(rh * n + l) * dv + d];
    }
    top_values[row * dv + d] = acc;
  }
}

// ---------------------------------------------------------------------------------------------------
// topk_refine: one block per (row-head, cluster); the cluster's top-k keys and values staged in shared
// memory (in chunks of kc keys when k or the head dims are large), each warp one member at a time.
constexpr int kRefineWarps = 4;

template <typename scalar_t, int NV>
__global__ void refine_kernel(const scalar_t* __restrict__ q, const scalar_t* __restrict__ keys,
                              const scalar_t* __restrict__ values, const int32_t* __restrict__ order,
                              const int32_t* __restrict__ start, const float* __restrict__ centroid_values,
                              const int64_t* __restrict__ topk_indices, const float* __restrict__ topk_mass,
                              const float* __restrict__ topk_values, int64_t n, int64_t clusters, int64_t k,
                              int64_t dk, int64_t dv, int kc, float scaling, float* __restrict__ out) {
  extern __shared__ float refine_smem[];
  const int64_t line = blockIdx.x, rh = line / clusters, c = line % clusters;
  const int32_t lo = start[rh * (clusters + 1) + c], hi = start[rh * (clusters + 1) + c + 1];
  if (lo == hi) return;  // an empty cluster
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  cuda::KeyChunk chunk{refine_smem, refine_smem + kc * (dk + 1), 0};
  float* qs = refine_smem + kc * (dk + 1 + dv) + warp * dk;
  const int64_t* idx = topk_indices + line * k;
  for (int64_t j = threadIdx.x; j < k; j += blockDim.x)
    CUDA_KERNEL_ASSERT(idx[j] >= -1 && idx[j] < n && "topk_indices must be -1 or in 0..N-1");
  const float mass = topk_mass[line];
  const float* cv = centroid_values + line * dv;
  const float* tv = topk_values + line * dv;
  const int64_t chunks = (k + kc - 1) / kc;
  auto load_chunk = [&](int64_t ch) {
    const int64_t j0 = ch * kc;
    const int count = static_cast<int>(k - j0 < kc ? k - j0 : kc);
    for (int64_t x = threadIdx.x; x < static_cast<int64_t>(count) * dk; x += blockDim.x) {
      const int64_t j = x / dk, d = x % dk, l = idx[j0 + j];
      chunk.keys[j * (dk + 1) + d] = l >= 0 ? static_cast<float>(keys[(rh * n + l) * dk + d]) : 0.f;
    }
    for (int64_t x = threadIdx.x; x < static_cast<int64_t>(count) * dv; x += blockDim.x) {
      const int64_t j = x / dv, d = x % dv, l = idx[j0 + j];
      chunk.values[j * dv + d] = l >= 0 ? static_cast<float>(values[(rh * n + l) * dv + d]) : 0.f;
    }
    chunk.kc = count;
  };
  if (chunks == 1) load_chunk(0);
  __syncthreads();
  const int32_t members = hi - lo;
  for (int32_t wave = 0; wave < members; wave += kRefineWarps) {
    const int32_t m = wave + warp;
    const bool live = m < members;
    const int64_t i = live ? order[rh * n + lo + m] : 0;
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
      const int64_t j0 = ch * kc;
      if (live) cuda::warp_attend<NV>(qs, chunk, static_cast<int>(dk), static_cast<int>(dv), scaling,
                                      [&](int j) { return idx[j0 + j] >= 0; }, row);
    }
    if (live) {
      const float coef = row.sum > 0.f ? mass / row.sum : 0.f;
      float* o = out + (rh * n + i) * dv;
      for (int t = 0; t < NV; ++t) {
        const int64_t d = lane + t * kWarp;
        if (d < dv) o[d] = (cv[d] - tv[d]) + coef * row.acc[t];
      }
    }
    __syncwarp();
  }
}

// Padded queries (cluster -1) of topk_refine get zeros.
__global__ void zero_padded_kernel(const int64_t* __restrict__ assign, int64_t total, int64_t dv,
                                   float* __restrict__ out) {
  const int64_t x = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (x >= total * dv) return;
  if (assign[x / dv] < 0) out[x] = 0.f;
}

template <typename scalar_t>
__global__ void broadcast_kernel(const scalar_t* __restrict__ centroid_values, const int64_t* __restrict__ assign,
                                 int64_t n, int64_t clusters, int64_t dv, int64_t total, scalar_t* __restrict__ out) {
  const int64_t x = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (x >= total) return;
  const int64_t d = x % dv, i = x / dv, rh = i / n;
  const int64_t c = assign[i];
  CUDA_KERNEL_ASSERT(c >= -1 && c < clusters && "assignments must be -1 or in 0..C-1");
  out[x] = c < 0 ? scalar_t(0) : centroid_values[(rh * clusters + c) * dv + d];
}

template <typename scalar_t>
void launch_refine(int nv, unsigned int blocks, size_t smem, const at::Tensor& q, const at::Tensor& kk,
                   const at::Tensor& v, const ClusterOrder& sorted, const at::Tensor& cv, const at::Tensor& ti,
                   const at::Tensor& tm, const at::Tensor& tv, int64_t n, int64_t clusters, int64_t k, int64_t dk,
                   int64_t dv, int kc, float scaling, at::Tensor& out) {
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int threads = kRefineWarps * kWarp;
#define BC_REFINE(NV)                                                                                          \
  refine_kernel<scalar_t, NV><<<blocks, threads, smem, stream>>>(                                              \
      q.data_ptr<scalar_t>(), kk.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), sorted.order.data_ptr<int32_t>(), \
      sorted.start.data_ptr<int32_t>(), cv.data_ptr<float>(), ti.data_ptr<int64_t>(), tm.data_ptr<float>(),     \
      tv.data_ptr<float>(), n, clusters, k, dk, dv, kc, scaling, out.data_ptr<float>())
  switch (nv) {
    case 1: BC_REFINE(1); break;
    case 2: BC_REFINE(2); break;
    case 4: BC_REFINE(4); break;
    case 8: BC_REFINE(8); break;
    default: BC_REFINE(16); break;
  }
#undef BC_REFINE
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> group_queries_cuda(const at::Tensor& queries, const at::Tensor& assignments,
                                                      int64_t clusters) {
  check_group_args(queries, assignments, clusters);
  const int64_t rows = queries.size(0), heads = queries.size(1), n = queries.size(2), dk = queries.size(3);
  const c10::cuda::CUDAGuard guard(queries.device());
  const at::Tensor q = queries.contiguous(), a = assignments.contiguous();
  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor sums = at::empty({rows, heads, clusters, dk}, f32);
  at::Tensor counts = at::empty({rows, heads, clusters}, f32);
  if (rows * heads * clusters == 0) return {sums.zero_(), counts.zero_()};
  const ClusterOrder sorted = sort_by_cluster(a, clusters);
  const int threads = dk >= 128 ? 128 : (dk >= 64 ? 64 : 32);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "group_queries_cuda", [&] {
    group_kernel<scalar_t><<<static_cast<unsigned int>(rows * heads * clusters), threads, 0,
                             at::cuda::getCurrentCUDAStream()>>>(q.data_ptr<scalar_t>(),
                                                                 sorted.order.data_ptr<int32_t>(),
                                                                 sorted.start.data_ptr<int32_t>(), n, clusters, dk,
                                                                 sums.data_ptr<float>(), counts.data_ptr<float>());
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
  // The reference's own expression (centroids @ keys.float().T): the same cuBLAS call, the same scores.
  at::Tensor weights = at::matmul(centroids, keys.to(at::kFloat).transpose(-1, -2)).contiguous();
  const at::Tensor v = values.to(at::kFloat).contiguous();
  const at::Tensor ok = valid.contiguous();
  const int64_t lines = rows * heads * clusters;
  at::Tensor rank = k > 0 && lines > 0 && n > 0 ? at::empty(weights.sizes(), weights.options().dtype(at::kLong))
                                                 : at::Tensor();
  if (lines > 0 && n > 0) {
    softmax_rank_kernel<<<static_cast<unsigned int>(lines), kThreads, 0, stream>>>(
        weights.data_ptr<float>(), rank.defined() ? rank.data_ptr<int64_t>() : nullptr, ok.data_ptr<bool>(),
        heads * clusters, n, static_cast<float>(scaling));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  at::Tensor centroid_values = at::matmul(weights, v);
  const auto f32 = weights.options();
  at::Tensor indices = at::full({rows, heads, clusters, k}, -1, keys.options().dtype(at::kLong));
  at::Tensor mass = at::zeros({rows, heads, clusters}, f32);
  at::Tensor top_values = at::zeros({rows, heads, clusters, dv}, f32);
  if (!rank.defined()) return {centroid_values, indices, mass, top_values};
  // The k largest rank keys per row, largest first: the top-k by score, ties to the lowest index.
  const at::Tensor top_keys = std::get<0>(at::topk(rank, k, -1, /*largest=*/true, /*sorted=*/true)).contiguous();
  rank.reset();
  topk_gather_kernel<<<static_cast<unsigned int>(lines), 128, 0, stream>>>(
      weights.data_ptr<float>(), top_keys.data_ptr<int64_t>(), v.data_ptr<float>(), clusters, n, k, dv,
      indices.data_ptr<int64_t>(), mass.data_ptr<float>(), top_values.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {centroid_values, indices, mass, top_values};
}

at::Tensor topk_refine_cuda(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& assignments, const at::Tensor& centroid_values,
                            const at::Tensor& topk_indices, const at::Tensor& topk_mass, const at::Tensor& topk_values,
                            double scaling, double dropout, int64_t /*seed*/) {
  check_no_dropout(dropout, "topk_refine");
  check_refine_args(queries, keys, values, assignments, centroid_values, topk_indices, topk_mass, topk_values);
  const int64_t rows = queries.size(0), heads = queries.size(1), n = queries.size(2);
  const int64_t dk = queries.size(3), dv = values.size(3);
  TORCH_CHECK_VALUE(dk <= cuda::kMaxHeadDim && dv <= cuda::kMaxHeadDim, "the CUDA topk_refine supports head dims up to ",
                    cuda::kMaxHeadDim, ", got Dk=", dk, ", Dv=", dv);
  const c10::cuda::CUDAGuard guard(queries.device());
  const at::Tensor q = queries.contiguous(), kk = keys.contiguous(), v = values.contiguous();
  const at::Tensor a = assignments.contiguous(), cv = centroid_values.contiguous();
  const at::Tensor ti = topk_indices.contiguous(), tm = topk_mass.contiguous(), tv = topk_values.contiguous();
  at::Tensor out = at::empty({rows, heads, n, dv}, q.options().dtype(at::kFloat));
  const int64_t total = rows * heads * n;
  if (total == 0 || dv == 0) return out.zero_();
  const int64_t clusters = cv.size(2), k = ti.size(3);
  const auto stream = at::cuda::getCurrentCUDAStream();
  const ClusterOrder sorted = sort_by_cluster(a, clusters);
  zero_padded_kernel<<<blocks_for(total * dv, kThreads), kThreads, 0, stream>>>(a.data_ptr<int64_t>(), total, dv,
                                                                                out.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (k == 0) {  // no top-k keys: each member takes its centroid's output, Vc - Vtop
    const at::Tensor base = (cv - tv).contiguous();
    broadcast_kernel<float><<<blocks_for(total * dv, kThreads), kThreads, 0, stream>>>(
        base.data_ptr<float>(), a.data_ptr<int64_t>(), n, clusters, dv, total * dv, out.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return out;
  }
  const int kc = cuda::chunk_keys(dk, dv, kRefineWarps);
  const size_t smem = cuda::chunk_smem_bytes(dk, dv, kRefineWarps, kc);
  const int nv = cuda::lanes_per_dim_bucket(dv);
  const auto blocks = static_cast<unsigned int>(rows * heads * clusters);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "topk_refine_cuda", [&] {
    launch_refine<scalar_t>(nv, blocks, smem, q, kk, v, sorted, cv, ti, tm, tv, n, clusters, k, dk, dv, kc,
                            static_cast<float>(scaling), out);
  });
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

TORCH_LIBRARY_IMPL(bert_cluster, CUDA, m) {
  m.impl("group_queries", &group_queries_cuda);
  m.impl("centroid_attention", &centroid_attention_cuda);
  m.impl("topk_refine", &topk_refine_cuda);
  m.impl("broadcast_clusters", &broadcast_clusters_cuda);
}

}  // namespace bert_cluster
