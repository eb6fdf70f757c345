// banded_attention on CUDA: exact softmax attention inside a band, query i seeing key j iff |i - j| <= window
// and j is valid (see reference.banded_attention), on the current stream. One block per (row, head, block of
// kBandWarps consecutive queries): the keys of the block's band go through shared memory in chunks, each
// warp owns one query (warp_attend in common.cuh), so time and memory are O(N * window).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>

#include "../checks.h"
#include "common.cuh"

namespace bert_cluster {
namespace {

using cuda::kWarp;

constexpr int kBandWarps = 8;

template <typename scalar_t, int NV>
__global__ void band_kernel(const scalar_t* __restrict__ q, const scalar_t* __restrict__ keys,
                            const scalar_t* __restrict__ values, const bool* __restrict__ valid, int64_t heads,
                            int64_t n, int64_t window, int64_t dk, int64_t dv, int kc, int64_t blocks_per_head,
                            float scaling, float* __restrict__ out) {
  extern __shared__ float band_smem[];
  const int64_t rh = blockIdx.x / blocks_per_head, b = blockIdx.x % blocks_per_head;
  const int64_t r = rh / heads;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t i0 = b * kBandWarps, i = i0 + warp;
  const bool* ok = valid + r * n;
  const bool live = i < n && ok[i];
  cuda::KeyChunk chunk{band_smem, band_smem + kc * (dk + 1), 0};
  float* qs = band_smem + kc * (dk + 1 + dv) + warp * dk;
  if (live)
    for (int64_t d = lane; d < dk; d += kWarp) qs[d] = static_cast<float>(q[(rh * n + i) * dk + d]);
  const int64_t lo = i0 - window > 0 ? i0 - window : 0;
  const int64_t last = i0 + kBandWarps - 1 + window;
  const int64_t hi = last + 1 < n ? last + 1 : n;  // keys [lo, hi) are in some query's band
  cuda::OnlineRow<NV> row;
  row.reset();
  for (int64_t j0 = lo; j0 < hi; j0 += kc) {
    const int count = static_cast<int>(hi - j0 < kc ? hi - j0 : kc);
    __syncthreads();
    for (int64_t x = threadIdx.x; x < static_cast<int64_t>(count) * dk; x += blockDim.x) {
      const int64_t j = x / dk, d = x % dk;
      chunk.keys[j * (dk + 1) + d] = static_cast<float>(keys[(rh * n + j0 + j) * dk + d]);
    }
    for (int64_t x = threadIdx.x; x < static_cast<int64_t>(count) * dv; x += blockDim.x) {
      const int64_t j = x / dv, d = x % dv;
      chunk.values[j * dv + d] = static_cast<float>(values[(rh * n + j0 + j) * dv + d]);
    }
    chunk.kc = count;
    __syncthreads();
    if (live) {
      auto visible = [&](int j) {
        const int64_t key = j0 + j;
        return ok[key] && key >= i - window && key <= i + window;
      };
      cuda::warp_attend<NV>(qs, chunk, static_cast<int>(dk), static_cast<int>(dv), scaling, visible, row);
    }
  }
  if (i < n) {
    float* o = out + (rh * n + i) * dv;
    const float inv = (live && row.sum > 0.f) ? 1.f / row.sum : 0.f;  // padded query or empty band: zeros
    for (int t = 0; t < NV; ++t) {
      const int64_t d = lane + t * kWarp;
      if (d < dv) o[d] = row.acc[t] * inv;
    }
  }
}

template <typename scalar_t>
void launch_band(int nv, unsigned int blocks, size_t smem, const at::Tensor& q, const at::Tensor& k,
                 const at::Tensor& v, const at::Tensor& ok, int64_t heads, int64_t n, int64_t window, int64_t dk,
                 int64_t dv, int kc, int64_t blocks_per_head, float scaling, at::Tensor& out) {
  const auto stream = at::cuda::getCurrentCUDAStream();
#define BC_BAND(NV)                                                                                            \
  band_kernel<scalar_t, NV><<<blocks, kBandWarps * kWarp, smem, stream>>>(                                     \
      q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), ok.data_ptr<bool>(), heads, n, \
      window, dk, dv, kc, blocks_per_head, scaling, out.data_ptr<float>())
  switch (nv) {
    case 1: BC_BAND(1); break;
    case 2: BC_BAND(2); break;
    case 4: BC_BAND(4); break;
    case 8: BC_BAND(8); break;
    default: BC_BAND(16); break;
  }
#undef BC_BAND
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

at::Tensor banded_attention_cuda(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
                                 const at::Tensor& valid, int64_t window, double scaling, double dropout,
                                 int64_t /*seed*/) {
  check_no_dropout(dropout, "banded_attention");
  check_banded_args(queries, keys, values, valid, window);
  const int64_t rows = queries.size(0), heads = queries.size(1), n = queries.size(2);
  const int64_t dk = queries.size(3), dv = values.size(3);
  TORCH_CHECK_VALUE(dk <= cuda::kMaxHeadDim && dv <= cuda::kMaxHeadDim,
                    "the CUDA banded_attention supports head dims up to ", cuda::kMaxHeadDim, ", got Dk=", dk,
                    ", Dv=", dv);
  const c10::cuda::CUDAGuard guard(queries.device());
  const at::Tensor q = queries.contiguous(), k = keys.contiguous(), v = values.contiguous(), ok = valid.contiguous();
  at::Tensor out = at::empty({rows, heads, n, dv}, q.options().dtype(at::kFloat));
  if (out.numel() == 0) return out;
  const int64_t w = window < n ? window : n;
  const int64_t blocks_per_head = (n + kBandWarps - 1) / kBandWarps;
  const int kc = cuda::chunk_keys(dk, dv, kBandWarps);
  const size_t smem = cuda::chunk_smem_bytes(dk, dv, kBandWarps, kc);
  const auto blocks = static_cast<unsigned int>(rows * heads * blocks_per_head);
  const int nv = cuda::lanes_per_dim_bucket(dv);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "banded_attention_cuda", [&] {
    launch_band<scalar_t>(nv, blocks, smem, q, k, v, ok, heads, n, w, dk, dv, kc, blocks_per_head,
                          static_cast<float>(scaling), out);
  });
  return out;
}

TORCH_LIBRARY_IMPL(bert_cluster, CUDA, m) { m.impl("banded_attention", &banded_attention_cuda); }

}  // namespace bert_cluster
