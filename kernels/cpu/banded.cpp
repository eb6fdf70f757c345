// banded_attention on the CPU: exact softmax attention inside a band, query i seeing key j iff |i - j| <=
// window and j is valid (see reference.banded_attention). One task per (row, head, block of 16 or 32
// consecutive queries): the queries are the vector lanes (lanes.h), the keys those of the block's band,
// in tiles with an online softmax, so time and memory are O(N * window): no (N, N) scores anywhere.
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../checks.h"
#include "common.h"
#include "lanes.h"
#include "ops.h"
#include "parallel.h"
#include "vec.h"

namespace bert_cluster {
namespace {

struct BandJob {
  Rows q, keys, values;
  InputType type;
  const bool* valid;
  const int64_t *span_lo, *span_hi;
  int64_t heads, n, window, dk, dv, block, blocks;
  float scaling;
  float* out;
};

struct BandScratch {
  Floats qt, s, kbuf, vbuf, acc, row;
  std::vector<int32_t> first, last;
  BandScratch(int64_t dk, int64_t dv)
      : qt(std::max<int64_t>(dk, 1) * kLaneCount),
        s(kKeyTile * kLaneCount),
        kbuf(kKeyTile * std::max<int64_t>(dk, 1)),
        vbuf(kKeyTile * pad16(std::max<int64_t>(dv, 1))),
        acc(kLaneCount * pad16(std::max<int64_t>(dv, 1))),
        row(std::max<int64_t>(dk, 1)),
        first(kKeyTile),
        last(kKeyTile) {}
};

void band_task(const BandJob& job, int64_t task, BandScratch& sc) {
  const int64_t rh = task / job.blocks, b = task % job.blocks;
  const int64_t r = rh / job.heads, h = rh % job.heads;
  const int64_t n = job.n, dk = job.dk, dv = job.dv, dvp = pad16(dv), w = job.window;
  const int64_t i0 = b * job.block, lanes = std::min(job.block, n - i0);
  const int lane_vectors = job.block <= 16 ? 1 : 2;
  const bool* ok = job.valid + r * n;
  float* out = job.out + (rh * n + i0) * dv;
  // Keys any query of the block can see, clipped to the row's valid span.
  const int64_t lo = std::max({int64_t{0}, i0 - w, job.span_lo[r]});
  const int64_t hi = std::min({n, i0 + lanes + w, job.span_hi[r]});
  bool any_query = false;
  for (int64_t i = 0; i < lanes; ++i) any_query |= ok[i0 + i];
  if (!any_query || lo >= hi) {
    std::fill(out, out + lanes * dv, 0.f);
    return;
  }
  float* qt = sc.qt.data();
  std::fill(sc.qt.begin(), sc.qt.end(), 0.f);
  for (int64_t i = 0; i < lanes; ++i) {
    widen_row(job.type, job.q.ptr(r, h, i0 + i), sc.row.data(), dk);
    for (int64_t d = 0; d < dk; ++d) qt[d * kLaneCount + i] = sc.row[d];
  }
  float* acc = sc.acc.data();
  std::fill(acc, acc + kLaneCount * dvp, 0.f);
  float m[kLaneCount], z[kLaneCount];
  for (int c = 0; c < kLaneCount; ++c) {
    m[c] = kNegInf;
    z[c] = 0.f;
  }
  float* s = sc.s.data();
  for (int64_t j0 = lo; j0 < hi; j0 += kKeyTile) {
    const int64_t rows = std::min(kKeyTile, hi - j0);
    int64_t ks = 0, vs = 0;
    const float* kp = float_rows(job.keys, job.type, r, h, j0, rows, dk, dk, true, sc.kbuf.data(), &ks);
    score_tile(qt, kp, ks, rows, dk, job.scaling, lane_vectors, s);
    for (int64_t t = 0; t < rows; ++t) {
      // Lane i (query i0 + i) sees key j iff j - w <= i0 + i <= j + w, i < lanes, and j is valid.
      const int64_t j = j0 + t;
      sc.first[t] = static_cast<int32_t>(std::max<int64_t>(j - w - i0, 0));
      sc.last[t] = ok[j] ? static_cast<int32_t>(std::min<int64_t>(j + w - i0, lanes - 1)) : -1;
    }
    mask_tile(s, rows, sc.first.data(), sc.last.data(), lane_vectors);
    softmax_tile(s, rows, lanes, lane_vectors, m, z, acc, dvp);
    const float* vp = value_rows(job.values, job.type, r, h, j0, rows, dv, ok, sc.vbuf.data(), &vs);
    accumulate_tile(s, vp, vs, rows, lanes, acc, dvp);
  }
  for (int64_t i = 0; i < lanes; ++i) {
    float* o = out + i * dv;
    const float inv = (ok[i0 + i] && z[i] > 0.f) ? 1.f / z[i] : 0.f;  // padded query or empty band: zeros
    for (int64_t d = 0; d < dv; ++d) o[d] = acc[i * dvp + d] * inv;
  }
}

void band_tasks(const BandJob& job, int64_t begin, int64_t end) {
  BandScratch sc(job.dk, job.dv);
  for (int64_t task = begin; task < end; ++task) band_task(job, task, sc);
}

}  // namespace

at::Tensor banded_attention_cpu(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
                                const at::Tensor& valid, int64_t window, double scaling, double dropout,
                                int64_t seed) {
  if (dropout != 0.0)
    return banded_attention_dropped_cpu(float_rows(queries), float_rows(keys), float_rows(values), valid.contiguous(),
                                        window, scaling, dropout, seed);
  check_banded_args(queries, keys, values, valid, window);
  const int64_t rows = queries.size(0), heads = queries.size(1), n = queries.size(2);
  const int64_t dk = queries.size(3), dv = values.size(3);
  const at::Tensor q = last_dim_contiguous(queries), kk = last_dim_contiguous(keys), vv = last_dim_contiguous(values);
  const at::Tensor ok = valid.contiguous();
  at::Tensor out = empty_tensor({rows, heads, n, dv}, queries.options().dtype(at::kFloat));
  if (out.numel() == 0) return out;
  std::vector<int64_t> lo(rows), hi(rows);
  valid_spans(ok.data_ptr<bool>(), rows, n, lo.data(), hi.data());
  // 32 queries per task for bands of 16+ keys each side (the block's extra keys cost <= 50% more), else 16.
  const int64_t w = std::min(window, n);
  const int64_t block = w >= 16 ? 32 : 16;
  const int64_t blocks = (n + block - 1) / block;
  BandJob job{Rows::of(q), Rows::of(kk), Rows::of(vv), input_type(q), ok.data_ptr<bool>(), lo.data(), hi.data(),
              heads, n, w, dk, dv, block, blocks, static_cast<float>(scaling), out.data_ptr<float>()};
  const int64_t span = std::min(n, block + 2 * w);
  parallel_for(0, rows * heads * blocks, grain_for(span * (dk + dv + 16) * block / 16),
               [&](int64_t begin, int64_t end) { band_tasks(job, begin, end); });
  return out;
}

}  // namespace bert_cluster
