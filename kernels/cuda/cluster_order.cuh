// The members of each cluster in index order, on the device: a stable counting sort of each (row, head)'s
// queries by cluster (shared-memory histogram, then a warp-by-warp scatter), with no host synchronisation.
// Used by sparse.cu (group_queries, topk_refine) and plus.cu (lloyd_refine, refine_with_query_mass and its
// backward): each cluster's members summed or visited in query order, so the sums are deterministic.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <cstdint>

#include "common.cuh"

namespace bert_cluster {
namespace cuda {

constexpr int kSortThreads = 256;
constexpr int64_t kMaxClusters = 6144;  // the counting sort's two int32 arrays of C in 48 KiB of shared memory

// Stable counting sort of each (row, head)'s queries by cluster: order[start[c] .. start[c + 1]) are the
// members of cluster c in index order. One block per (row, head).
static __global__ void cluster_sort_kernel(const int64_t* __restrict__ assign, int64_t n, int64_t clusters,
                                    int32_t* __restrict__ order, int32_t* __restrict__ start) {
  extern __shared__ int32_t sort_smem[];
  int32_t* count = sort_smem;
  int32_t* cursor = sort_smem + clusters;
  const int64_t rh = blockIdx.x;
  const int64_t* a = assign + rh * n;
  const int tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp, warps = blockDim.x / kWarp;
  for (int64_t c = tid; c < clusters; c += blockDim.x) count[c] = 0;
  __syncthreads();
  for (int64_t i = tid; i < n; i += blockDim.x) {
    const int64_t c = a[i];
    CUDA_KERNEL_ASSERT(c >= -1 && c < clusters && "assignments must be -1 or in 0..C-1");
    if (c >= 0) atomicAdd(count + c, 1);
  }
  __syncthreads();
  if (tid == 0) {
    int32_t running = 0;
    for (int64_t c = 0; c < clusters; ++c) {
      cursor[c] = running;
      start[rh * (clusters + 1) + c] = running;
      running += count[c];
    }
    start[rh * (clusters + 1) + clusters] = running;
  }
  __syncthreads();
  for (int64_t base = 0; base < n; base += blockDim.x) {
    const int64_t i = base + tid;
    const int64_t c = i < n ? a[i] : -1;
    const unsigned peers = __match_any_sync(kFull, static_cast<unsigned long long>(c));
    const int leader = __ffs(peers) - 1;
    const int rank = __popc(peers & ((1u << lane) - 1u));
    int32_t pos = 0;
    for (int w = 0; w < warps; ++w) {  // warps in order: earlier indices first
      if (warp == w && lane == leader && c >= 0) {
        pos = cursor[c];
        cursor[c] += __popc(peers);
      }
      __syncthreads();
    }
    pos = __shfl_sync(kFull, pos, leader);
    if (c >= 0) order[rh * n + pos + rank] = static_cast<int32_t>(i);
  }
}

struct ClusterOrder {
  at::Tensor order, start;
};

inline ClusterOrder sort_by_cluster(const at::Tensor& assignments, int64_t clusters) {
  TORCH_CHECK_VALUE(clusters <= kMaxClusters, "the CUDA kernels support up to ", kMaxClusters, " clusters, got ",
                    clusters);
  const int64_t rh = assignments.size(0) * assignments.size(1), n = assignments.size(2);
  const auto i32 = assignments.options().dtype(at::kInt);
  ClusterOrder out{at::empty({rh, std::max<int64_t>(n, 1)}, i32), at::empty({rh, clusters + 1}, i32)};
  if (rh == 0) return out;
  const size_t smem = 2 * static_cast<size_t>(clusters) * sizeof(int32_t);
  cluster_sort_kernel<<<static_cast<unsigned int>(rh), kSortThreads, smem, at::cuda::getCurrentCUDAStream()>>>(
      assignments.data_ptr<int64_t>(), n, clusters, out.order.data_ptr<int32_t>(), out.start.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace cuda
}  // namespace bert_cluster
