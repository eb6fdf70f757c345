// Device helpers shared by the CUDA kernels: warp reductions, order-preserving float keys, and the attention
// of one query (one warp) against a chunk of keys staged in shared memory, with an online softmax (used by
// topk_refine: a cluster's top-k keys; and banded_attention: the keys of a block's band).
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/macros/Macros.h>

#include <cstdint>

namespace bert_cluster {
namespace cuda {

constexpr int kWarp = 32;
constexpr unsigned kFull = 0xffffffffu;

inline unsigned int blocks_for(int64_t count, int threads) {
  return static_cast<unsigned int>((count + threads - 1) / threads);
}

__device__ __forceinline__ float warp_sum(float x) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(kFull, x, offset);
  return x;
}

__device__ __forceinline__ float warp_max(float x) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(kFull, x, offset));
  return x;
}

// a < b as floats (no NaN; -0 == +0 after adding 0) iff key(a) < key(b) as int32.
__device__ __forceinline__ int32_t order_key(float x) {
  const int32_t b = __float_as_int(x + 0.0f);
  return b ^ ((b >> 31) & 0x7FFFFFFF);
}

__device__ __forceinline__ float from_order_key(int32_t k) { return __int_as_float(k ^ ((k >> 31) & 0x7FFFFFFF)); }

// One int64 per (score, key index): larger = higher score, then lower index. All distinct, so a top-k on
// them (torch.topk) has one answer: the reference's order and tie rule.
__device__ __forceinline__ int64_t rank_key(float score, int64_t index) {
  return static_cast<int64_t>(order_key(score)) * 4294967296LL + static_cast<int64_t>(0xFFFFFFFFLL - index);
}
__device__ __forceinline__ int64_t rank_key_index(int64_t key) { return 0xFFFFFFFFLL - (key & 0xFFFFFFFFLL); }
__device__ __forceinline__ float rank_key_score(int64_t key) {
  return from_order_key(static_cast<int32_t>(key >> 32));
}

// Shared-memory layout of a key chunk for warp_attend: kc keys (rows of dk + 1 floats: the padding keeps the
// lanes of a warp, one key each, on distinct banks) and their values (rows of dv floats).
struct KeyChunk {
  float* keys;    // [chunk][dk + 1]
  float* values;  // [chunk][dv]
  int kc;         // keys in this chunk
};

// Running state of one query (one warp): max and sum of the exponentials so far, and in each lane the
// weighted value sums of dims lane, lane + 32, ... (NV of them).
template <int NV>
struct OnlineRow {
  float max = -INFINITY;
  float sum = 0.f;
  float acc[NV];
  __device__ void reset() {
    max = -INFINITY;
    sum = 0.f;
    for (int t = 0; t < NV; ++t) acc[t] = 0.f;
  }
};

// One warp: the query q (dk floats in shared memory) against the chunk's keys; lane j scores key j, and
// visible(j) says whether it counts. Scores are scaled by `scaling`. Then lanes switch to value dims.
template <int NV, typename Visible>
__device__ __forceinline__ void warp_attend(const float* __restrict__ q, const KeyChunk& chunk, int dk, int dv,
                                            float scaling, Visible visible, OnlineRow<NV>& row) {
  const int lane = threadIdx.x % kWarp;
  float s = -INFINITY;
  if (lane < chunk.kc && visible(lane)) {
    const float* key = chunk.keys + lane * (dk + 1);
    float dot = 0.f;
    for (int d = 0; d < dk; ++d) dot = fmaf(q[d], key[d], dot);
    s = dot * scaling;
  }
  const float chunk_max = warp_max(s);
  if (chunk_max == -INFINITY) return;  // nothing visible in this chunk
  const float updated = fmaxf(row.max, chunk_max);
  const float alpha = row.max == -INFINITY ? 0.f : expf(row.max - updated);
  const float p = s == -INFINITY ? 0.f : expf(s - updated);
  row.sum = row.sum * alpha + warp_sum(p);
  row.max = updated;
  for (int t = 0; t < NV; ++t) row.acc[t] *= alpha;
  for (int j = 0; j < chunk.kc; ++j) {
    const float w = __shfl_sync(kFull, p, j);
    if (w == 0.f) continue;  // warp-uniform: w is the same in every lane
    const float* value = chunk.values + j * dv;
    for (int t = 0; t < NV; ++t) {
      const int d = lane + t * kWarp;
      if (d < dv) row.acc[t] = fmaf(w, value[d], row.acc[t]);
    }
  }
}

// Dims per lane for a head dim: 1, 2, 4, 8 or 16 (head dims up to 512).
inline int lanes_per_dim_bucket(int64_t dv) {
  const int64_t per_lane = (dv + kWarp - 1) / kWarp;
  return per_lane <= 1 ? 1 : per_lane <= 2 ? 2 : per_lane <= 4 ? 4 : per_lane <= 8 ? 8 : 16;
}

constexpr int64_t kMaxHeadDim = 512;  // the largest Dv warp_attend keeps in registers (16 per lane)

// Keys per shared-memory chunk: up to 32 (a warp's lanes), fewer when the head dims are large, so that the
// chunk and `warps` query rows fit in 48 KiB.
inline int chunk_keys(int64_t dk, int64_t dv, int warps) {
  const int64_t budget = 48 * 1024 / 4 - warps * dk;
  const int64_t fit = budget / (dk + 1 + dv);
  return static_cast<int>(fit < 1 ? 1 : (fit > 32 ? 32 : fit));
}

inline size_t chunk_smem_bytes(int64_t dk, int64_t dv, int warps, int kc) {
  return static_cast<size_t>(kc * (dk + 1 + dv) + warps * dk) * sizeof(float);
}

}  // namespace cuda
}  // namespace bert_cluster
