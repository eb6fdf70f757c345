// hash_queries and hamming_kmeans on CUDA, on the current stream (see bert_cluster/reference.py for the
// rules reproduced). K-means runs one thread block per (row, head), all L rounds inside one launch, with
// integer atomics only, so its result does not depend on thread scheduling.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>

#include "../checks.h"

namespace bert_cluster {
namespace {

constexpr int kThreads = 256;

__global__ void pack_bits_kernel(const float* __restrict__ proj, const float* __restrict__ offsets, int64_t count,
                                 int64_t bits, int64_t* __restrict__ out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count) return;
  const float* p = proj + i * bits;
  unsigned long long h = 0;
  for (int64_t b = 0; b < bits; ++b) h |= static_cast<unsigned long long>(__fadd_rn(p[b], offsets[b]) > 0.f) << b;
  out[i] = static_cast<int64_t>(h);
}

__device__ void assign_queries(const unsigned long long* __restrict__ h, const bool* __restrict__ ok, int64_t n,
                               const unsigned long long* __restrict__ cent, const int32_t* __restrict__ present,
                               int64_t clusters, unsigned long long mask, int64_t* __restrict__ assign) {
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    if (!ok[i]) {
      assign[i] = -1;
      continue;
    }
    int best_distance = 1 << 30;
    int64_t best = -1;
    for (int64_t c = 0; c < clusters; ++c) {
      if (!present[c]) continue;
      const int d = __popcll((h[i] ^ cent[c]) & mask);
      if (d < best_distance) {  // strict: the lowest index wins ties
        best_distance = d;
        best = c;
      }
    }
    assign[i] = best;
  }
}

// Scratch per (row, head), in global memory: first-occurrence flags and positions (N each), centroid
// hashes and presence (C), member counts (C) and per-bit counts of ones (C x 64).
__global__ void kmeans_kernel(const int64_t* __restrict__ hashes, const bool* __restrict__ valid, int64_t heads,
                              int64_t n, int64_t clusters, int64_t iterations, int64_t bits,
                              int32_t* __restrict__ flag_scratch, int32_t* __restrict__ position_scratch,
                              unsigned long long* __restrict__ cent_scratch, int32_t* __restrict__ present_scratch,
                              int32_t* __restrict__ members_scratch, int32_t* __restrict__ ones_scratch,
                              int64_t* __restrict__ assign_out, int64_t* __restrict__ centroids_out) {
  const int64_t rh = blockIdx.x;
  const int64_t r = rh / heads;
  const unsigned long long* h = reinterpret_cast<const unsigned long long*>(hashes) + rh * n;
  const bool* ok = valid + r * n;
  int32_t* flag = flag_scratch + rh * n;
  int32_t* position = position_scratch + rh * n;
  unsigned long long* cent = cent_scratch + rh * clusters;
  int32_t* present = present_scratch + rh * clusters;
  int32_t* members = members_scratch + rh * clusters;
  int32_t* ones = ones_scratch + rh * clusters * 64;
  int64_t* assign = assign_out + rh * n;
  const unsigned long long mask = (1ULL << bits) - 1ULL;
  const int tid = threadIdx.x;

  __shared__ int32_t chunk_start[kThreads];
  __shared__ int32_t distinct_shared;
  __shared__ int32_t changed;

  // 1. Initial centroids: first occurrences of each valid hash (O(N^2 / threads) comparisons) ...
  for (int64_t i = tid; i < n; i += blockDim.x) {
    int32_t is_first = ok[i] ? 1 : 0;
    for (int64_t j = 0; j < i && is_first; ++j) is_first = !(ok[j] && h[j] == h[i]);
    flag[i] = is_first;
  }
  __syncthreads();
  // ... compacted in index order (= order of first occurrence): one contiguous chunk per thread + a scan.
  const int64_t chunk = (n + blockDim.x - 1) / blockDim.x;
  const int64_t lo = min(n, tid * chunk), hi = min(n, lo + chunk);
  int32_t mine = 0;
  for (int64_t i = lo; i < hi; ++i) mine += flag[i];
  chunk_start[tid] = mine;
  __syncthreads();
  if (tid == 0) {
    int32_t total = 0;
    for (int t = 0; t < static_cast<int>(blockDim.x); ++t) {
      const int32_t count = chunk_start[t];
      chunk_start[t] = total;
      total += count;
    }
    distinct_shared = total;
  }
  __syncthreads();
  int32_t write = chunk_start[tid];
  for (int64_t i = lo; i < hi; ++i)
    if (flag[i]) position[write++] = static_cast<int32_t>(i);
  __syncthreads();
  const int64_t distinct = distinct_shared;
  for (int64_t s = tid; s < clusters; s += blockDim.x) {
    const bool is_present = s < distinct || distinct > clusters;
    const int64_t pick = distinct > clusters ? (s * distinct) / clusters : s;
    present[s] = is_present ? 1 : 0;
    cent[s] = is_present ? h[position[pick]] : 0ULL;
  }
  __syncthreads();

  // 2. L rounds of (assign, majority update); stop early at a fixed point (the rest would repeat it).
  for (int64_t it = 0; it < iterations; ++it) {
    assign_queries(h, ok, n, cent, present, clusters, mask, assign);
    for (int64_t x = tid; x < clusters * 64; x += blockDim.x) ones[x] = 0;
    for (int64_t c = tid; c < clusters; c += blockDim.x) members[c] = 0;
    if (tid == 0) changed = 0;
    __syncthreads();
    for (int64_t i = tid; i < n; i += blockDim.x) {
      const int64_t c = assign[i];
      if (c < 0) continue;
      atomicAdd(members + c, 1);
      unsigned long long bitset = h[i] & mask;
      while (bitset) {
        const int b = __ffsll(static_cast<long long>(bitset)) - 1;
        atomicAdd(ones + c * 64 + b, 1);
        bitset &= bitset - 1ULL;
      }
    }
    __syncthreads();
    for (int64_t c = tid; c < clusters; c += blockDim.x) {
      unsigned long long updated = 0;
      for (int64_t b = 0; b < bits; ++b) {
        const int32_t twice = 2 * ones[c * 64 + b];
        const unsigned long long old_bit = (cent[c] >> b) & 1ULL;
        const unsigned long long bit = twice > members[c] ? 1ULL : (twice < members[c] ? 0ULL : old_bit);
        updated |= bit << b;
      }
      if (updated != cent[c]) changed = 1;
      cent[c] = updated;
    }
    __syncthreads();
    const bool stop = changed == 0;
    __syncthreads();
    if (stop) break;
  }
  assign_queries(h, ok, n, cent, present, clusters, mask, assign);
  for (int64_t c = tid; c < clusters; c += blockDim.x) centroids_out[rh * clusters + c] = static_cast<int64_t>(cent[c]);
}

}  // namespace

at::Tensor hash_queries_cuda(const at::Tensor& queries, const at::Tensor& planes, const at::Tensor& offsets) {
  check_hash_args(queries, planes, offsets);
  const c10::cuda::CUDAGuard guard(queries.device());
  // Same expression as the reference (queries.float() @ planes.float().T): same cuBLAS call, same bits.
  const at::Tensor proj = at::matmul(queries.to(at::kFloat), planes.to(at::kFloat).t()).contiguous();
  const at::Tensor off = offsets.to(at::kFloat).contiguous();
  const int64_t bits = planes.size(0);
  at::Tensor out = at::empty(queries.sizes().slice(0, 3), queries.options().dtype(at::kLong));
  const int64_t count = out.numel();
  if (count == 0) return out;
  const at::Tensor p = queries.size(3) == 0 ? at::zeros({count, bits}, off.options()) : proj;
  const int blocks = static_cast<int>((count + kThreads - 1) / kThreads);
  pack_bits_kernel<<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      p.data_ptr<float>(), off.data_ptr<float>(), count, bits, out.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

std::tuple<at::Tensor, at::Tensor> hamming_kmeans_cuda(const at::Tensor& hashes, const at::Tensor& valid,
                                                       int64_t clusters, int64_t iterations, int64_t bits) {
  check_kmeans_args(hashes, valid, clusters, iterations, bits);
  const c10::cuda::CUDAGuard guard(hashes.device());
  const at::Tensor h = hashes.contiguous();
  const at::Tensor v = valid.contiguous();
  const int64_t rows = h.size(0), heads = h.size(1), n = h.size(2);
  at::Tensor assignments = at::empty({rows, heads, n}, h.options());
  at::Tensor centroids = at::empty({rows, heads, clusters}, h.options());
  if (rows * heads == 0) return {assignments, centroids};
  const auto i32 = h.options().dtype(at::kInt);
  at::Tensor flags = at::empty({rows * heads, std::max<int64_t>(n, 1)}, i32);
  at::Tensor positions = at::empty({rows * heads, std::max<int64_t>(n, 1)}, i32);
  at::Tensor cent = at::empty({rows * heads, clusters}, h.options());
  at::Tensor present = at::empty({rows * heads, clusters}, i32);
  at::Tensor members = at::empty({rows * heads, clusters}, i32);
  at::Tensor ones = at::empty({rows * heads, clusters, 64}, i32);
  kmeans_kernel<<<static_cast<unsigned int>(rows * heads), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      h.data_ptr<int64_t>(), v.data_ptr<bool>(), heads, n, clusters, iterations, bits, flags.data_ptr<int32_t>(),
      positions.data_ptr<int32_t>(), reinterpret_cast<unsigned long long*>(cent.data_ptr<int64_t>()),
      present.data_ptr<int32_t>(), members.data_ptr<int32_t>(), ones.data_ptr<int32_t>(),
      assignments.data_ptr<int64_t>(), centroids.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {assignments, centroids};
}

TORCH_LIBRARY_IMPL(bert_cluster, CUDA, m) {
  m.impl("hash_queries", &hash_queries_cuda);
  m.impl("hamming_kmeans", &hamming_kmeans_cuda);
}

}  // namespace bert_cluster
