// hash_queries and hamming_kmeans on CUDA, on the current stream, with no host synchronisation (see
// bert_cluster/reference.py for the rules reproduced). K-means runs one thread block per (row, head), all L
// rounds inside one launch: the initial centroids (distinct hashes by first occurrence) in O(N) through a
// hash table with atomicMin of the first index, then per round an assignment and a majority vote counted in
// shared memory (warp-aggregated integer atomics: the result does not depend on thread scheduling).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>

#include "../checks.h"
#include "common.cuh"

namespace bert_cluster {
namespace {

constexpr int kThreads = 256;
// Shared memory a block may take without opting in (every GPU since sm_20): the kernel's whole footprint,
// which is all dynamic (kmeans_kernel declares no __shared__ variable), must fit in it.
constexpr size_t kSharedLimit = 48 * 1024;
// Dynamic shared memory of kmeans_kernel: two flags (8 B, keeping the centroids 8-byte aligned), then per
// cluster its centroid (8 B) and presence (4 B), the scan (4 B per thread), and, when they fit, the counts
// (65 x 4 B per cluster; else in global scratch).
constexpr size_t kKmeansFlagBytes = 2 * sizeof(int32_t);
constexpr size_t kmeans_fixed_bytes(int64_t clusters) {
  return kKmeansFlagBytes + static_cast<size_t>(clusters) * 12 + kThreads * sizeof(int32_t);
}
constexpr size_t kmeans_count_bytes(int64_t clusters) { return static_cast<size_t>(clusters) * 65 * sizeof(int32_t); }
// The most clusters the kernel launches with (4010); C = 177 is the first whose counts go to global memory.
constexpr int64_t kKmeansMaxClusters = (kSharedLimit - kmeans_fixed_bytes(0)) / 12;
static_assert(kmeans_fixed_bytes(kKmeansMaxClusters) <= kSharedLimit, "kKmeansMaxClusters must launch");
static_assert(kmeans_fixed_bytes(kKmeansMaxClusters + 1) > kSharedLimit, "kKmeansMaxClusters is the largest");
static_assert(kmeans_fixed_bytes(176) + kmeans_count_bytes(176) <= kSharedLimit &&
                  kmeans_fixed_bytes(177) + kmeans_count_bytes(177) > kSharedLimit,
              "C >= 177 keeps the counts in global memory (gpu_checks.py checks C = 200)");

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

constexpr unsigned long long kEmptySlot = ~0ULL;  // hashes are < 2^63: never a hash

__device__ __forceinline__ unsigned long long table_slot(unsigned long long h, int shift) {
  return (h * 0x9E3779B97F4A7C15ULL) >> shift;
}

// Shared memory per (row, head), all of it dynamic (kmeans_fixed_bytes): two flags, centroid hashes,
// presence, the scan of the compaction, then member counts and per-bit counts of ones (C x 64). `ones` and `members` may live in global scratch instead when C is
// too large for shared memory (global atomics then; the counts are integers either way).
__global__ void kmeans_kernel(const int64_t* __restrict__ hashes, const bool* __restrict__ valid, int64_t heads,
                              int64_t n, int64_t clusters, int64_t iterations, int64_t bits, int table_shift,
                              unsigned long long* __restrict__ table_keys, int32_t* __restrict__ table_first,
                              int32_t* __restrict__ slot_scratch, int32_t* __restrict__ flag_scratch,
                              int32_t* __restrict__ position_scratch, int32_t* __restrict__ global_counts,
                              int64_t* __restrict__ assign_out, int64_t* __restrict__ centroids_out) {
  extern __shared__ unsigned long long kmeans_smem[];
  const int64_t rh = blockIdx.x;
  const int64_t r = rh / heads;
  const int64_t capacity = int64_t{1} << (64 - table_shift);
  const unsigned long long* h = reinterpret_cast<const unsigned long long*>(hashes) + rh * n;
  const bool* ok = valid + r * n;
  unsigned long long* keys = table_keys + rh * capacity;
  int32_t* first = table_first + rh * capacity;
  int32_t* slot_of = slot_scratch + rh * n;
  int32_t* flag = flag_scratch + rh * n;
  int32_t* position = position_scratch + rh * n;
  int64_t* assign = assign_out + rh * n;
  int32_t* flags_smem = reinterpret_cast<int32_t*>(kmeans_smem);  // distinct count, changed
  unsigned long long* cent = kmeans_smem + 1;
  int32_t* present = reinterpret_cast<int32_t*>(cent + clusters);
  int32_t* chunk_start = present + clusters;  // blockDim.x entries
  int32_t* small = chunk_start + blockDim.x;    // members (C) then ones (C x 64), unless global_counts
  int32_t* members = global_counts != nullptr ? global_counts + rh * clusters * 65 : small;
  int32_t* ones = members + clusters;
  const unsigned long long mask = (1ULL << bits) - 1ULL;
  const int tid = threadIdx.x, lane = tid % cuda::kWarp;
  int32_t& distinct_shared = flags_smem[0];
  int32_t& changed = flags_smem[1];

  // 1. Initial centroids: the distinct hashes of the valid queries in order of first occurrence, in O(N):
  //    insert every hash into an open-addressing table keeping the lowest index that carries it ...
  for (int64_t x = tid; x < capacity; x += blockDim.x) {
    keys[x] = kEmptySlot;
    first[x] = INT32_MAX;
  }
  __syncthreads();
  for (int64_t i = tid; i < n; i += blockDim.x) {
    if (!ok[i]) continue;
    unsigned long long slot = table_slot(h[i], table_shift);
    for (;;) {
      const unsigned long long seen = atomicCAS(keys + slot, kEmptySlot, h[i]);
      if (seen == kEmptySlot || seen == h[i]) break;
      slot = (slot + 1) & static_cast<unsigned long long>(capacity - 1);
    }
    atomicMin(first + slot, static_cast<int32_t>(i));
    slot_of[i] = static_cast<int32_t>(slot);
  }
  __syncthreads();
  // ... a query is a first occurrence iff it is the lowest index of its slot ...
  for (int64_t i = tid; i < n; i += blockDim.x) flag[i] = ok[i] && first[slot_of[i]] == static_cast<int32_t>(i);
  __syncthreads();
  // ... compacted in index order: one contiguous chunk per thread + a scan.
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
  const int64_t padded_n = (n + blockDim.x - 1) / blockDim.x * blockDim.x;  // whole warps in every step
  for (int64_t it = 0; it < iterations; ++it) {
    assign_queries(h, ok, n, cent, present, clusters, mask, assign);
    for (int64_t x = tid; x < clusters * 65; x += blockDim.x) members[x] = 0;  // members and ones
    if (tid == 0) changed = 0;
    __syncthreads();
    for (int64_t i = tid; i < padded_n; i += blockDim.x) {
      const int64_t c = i < n ? assign[i] : -1;
      const unsigned long long bitset = c >= 0 ? h[i] & mask : 0ULL;
      // One atomic per (cluster, bit) per warp: lanes of the same cluster count their bits together.
      const unsigned peers = __match_any_sync(cuda::kFull, static_cast<unsigned long long>(c));
      const bool leader = lane == __ffs(peers) - 1;
      if (leader && c >= 0) atomicAdd(members + c, __popc(peers));
      for (int b = 0; b < bits; ++b) {
        const unsigned set = __ballot_sync(cuda::kFull, (bitset >> b) & 1ULL) & peers;
        if (leader && c >= 0 && set != 0) atomicAdd(ones + c * 64 + b, __popc(set));
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
  // The first-occurrence table: a power of two >= 2N slots per (row, head).
  int table_shift = 63;
  while ((int64_t{1} << (64 - table_shift)) < 2 * std::max<int64_t>(n, 1)) --table_shift;
  const int64_t capacity = int64_t{1} << (64 - table_shift);
  const auto i32 = h.options().dtype(at::kInt);
  const int64_t rh = rows * heads, nn = std::max<int64_t>(n, 1);
  at::Tensor table_keys = at::empty({rh, capacity}, h.options());
  at::Tensor table_first = at::empty({rh, capacity}, i32);
  at::Tensor slots = at::empty({rh, nn}, i32), flags = at::empty({rh, nn}, i32), positions = at::empty({rh, nn}, i32);
  const size_t fixed = kmeans_fixed_bytes(clusters);
  const size_t counts = kmeans_count_bytes(clusters);
  const bool counts_in_smem = fixed + counts <= kSharedLimit;
  TORCH_CHECK_VALUE(clusters <= kKmeansMaxClusters, "the CUDA hamming_kmeans supports up to ", kKmeansMaxClusters,
                    " clusters (", kSharedLimit, " B of shared memory), got ", clusters);
  // The launch fails when static and dynamic shared memory exceed the limit: the kernel must declare none.
  static const size_t static_bytes = [] {
    cudaFuncAttributes attributes{};
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kmeans_kernel));
    return attributes.sharedSizeBytes;
  }();
  TORCH_CHECK(static_bytes == 0, "kmeans_kernel declares ", static_bytes, " B of static shared memory");
  at::Tensor global_counts = counts_in_smem ? at::Tensor() : at::empty({rh, clusters * 65}, i32);
  kmeans_kernel<<<static_cast<unsigned int>(rh), kThreads, fixed + (counts_in_smem ? counts : 0),
                  at::cuda::getCurrentCUDAStream()>>>(
      h.data_ptr<int64_t>(), v.data_ptr<bool>(), heads, n, clusters, iterations, bits, table_shift,
      reinterpret_cast<unsigned long long*>(table_keys.data_ptr<int64_t>()), table_first.data_ptr<int32_t>(),
      slots.data_ptr<int32_t>(), flags.data_ptr<int32_t>(), positions.data_ptr<int32_t>(),
      counts_in_smem ? nullptr : global_counts.data_ptr<int32_t>(), assignments.data_ptr<int64_t>(),
      centroids.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {assignments, centroids};
}

TORCH_LIBRARY_IMPL(bert_cluster, CUDA, m) {
  m.impl("hash_queries", &hash_queries_cuda);
  m.impl("hamming_kmeans", &hamming_kmeans_cuda);
}

}  // namespace bert_cluster
