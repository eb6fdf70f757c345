// lloyd_refine on the CPU (i-clustered+, issue 13): Lloyd rounds on the real query vectors, started from
// the Hamming K-means partition. See bert_cluster/reference.py (lloyd_refine) for the rules reproduced:
// distances ||c||^2 - 2 q.c in float32, ties to the lowest cluster index, empty clusters never win,
// padded queries (-1) stay -1, stop at a fixed point. Means are summed in query order, as the reference's
// index_add_, so the centroids of one partition agree bit for bit; the dot products are summed in
// another order than the reference's GEMM, so a query within a few ulps of a tie may pick the other side.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "../checks.h"
#include "lanes.h"
#include "parallel.h"
#include "vec.h"

namespace bert_cluster {
namespace {

constexpr int64_t kLanes = 16;  // the width of f32x16 (vec.h)
constexpr float kInf = std::numeric_limits<float>::infinity();

constexpr int64_t kChunk = 64;  // queries assigned together (four vectors of 16 lanes)

// sums[c] += q_i and counts[c] += 1 for the valid queries i in [begin, end), in query order (the order of
// the reference's index_add_, so that the sums agree bit for bit); with `norms`, also norms[i] = ||q_i||^2
// (16 partial sums: a plain float sum does not vectorise) in the same pass over the rows.
BC_MULTIVERSION
void accumulate(const float* __restrict q, const int64_t* __restrict assign, int64_t begin, int64_t end,
                int64_t dk, float* __restrict sums, float* __restrict counts, float* __restrict norms = nullptr) {
  for (int64_t i = begin; i < end; ++i) {
    const int64_t c = assign[i];
    if (c < 0) continue;
    counts[c] += 1.f;
    float* m = sums + c * dk;
    const float* qi = q + i * dk;
    for (int64_t d = 0; d < dk; ++d) m[d] += qi[d];
    if (norms != nullptr) norms[i] = dot(qi, qi, dk);
  }
}

// means = sums / max(counts, 1).
void divide(const float* __restrict sums, const float* __restrict counts, int64_t clusters, int64_t dk,
            float* __restrict means) {
  for (int64_t c = 0; c < clusters; ++c) {
    const float divisor = counts[c] > 1.f ? counts[c] : 1.f;
    for (int64_t d = 0; d < dk; ++d) means[c * dk + d] = sums[c * dk + d] / divisor;
  }
}

// The nearest and second nearest centroid of up to kChunk queries. qt: (dk, kChunk) the queries transposed
// (query j in lane j % 16 of vector j / 16; unused lanes hold zeros); means: (clusters, dk); bias: ||c||^2,
// +inf for an empty cluster (it never wins). Distances are ||c||^2 - 2 q.c (||q||^2 left out), summed over
// dk in order. 16 queries per vector, four vectors and four centroids at a time (sixteen FMA chains, each
// query vector loaded once for four centroids); the minimum runs down the centroids in index order with a
// strict <, so the lowest index wins ties.
BC_MULTIVERSION
void nearest_two(const float* __restrict qt, int64_t dk, const float* __restrict means, const float* __restrict bias,
                 int64_t clusters, int64_t* __restrict best, float* __restrict first, float* __restrict second) {
  constexpr int V = kChunk / kLanes;
  constexpr int kCentroids = 4;
  const f32x16 inf = f32x16{} + kInf;
  f32x16 f[V], s[V];
  i32x16 b[V];
  for (int v = 0; v < V; ++v) {
    f[v] = inf;
    s[v] = inf;
    b[v] = i32x16{} - 1;
  }
  for (int64_t c = 0; c < clusters; c += kCentroids) {
    const int count = static_cast<int>(std::min<int64_t>(kCentroids, clusters - c));
    const float* m[kCentroids];
    for (int j = 0; j < kCentroids; ++j) m[j] = means + (c + std::min(j, count - 1)) * dk;  // repeats are unused
    f32x16 a[kCentroids][V] = {};
    for (int64_t d = 0; d < dk; ++d) {
      f32x16 column[V];
      for (int v = 0; v < V; ++v) column[v] = load16(qt + d * kChunk + v * kLanes);
      for (int j = 0; j < kCentroids; ++j) {
        const float x = m[j][d];
        for (int v = 0; v < V; ++v) a[j][v] += x * column[v];
      }
    }
    for (int j = 0; j < count; ++j) {
      const i32x16 index = i32x16{} + static_cast<int32_t>(c + j);
      for (int v = 0; v < V; ++v) {
        const f32x16 distance = bias[c + j] - 2.f * a[j][v];
        const auto closer = distance < f[v];
        s[v] = closer ? f[v] : (distance < s[v] ? distance : s[v]);
        b[v] = closer ? index : b[v];
        f[v] = closer ? distance : f[v];
      }
    }
  }
  for (int v = 0; v < V; ++v)
    for (int j = 0; j < kLanes; ++j) {
      best[v * kLanes + j] = b[v][j];
      first[v * kLanes + j] = f[v][j];
      second[v * kLanes + j] = s[v][j];
    }
}

// Lloyd rounds of one (row, head): assign the queries that may move (in chunks of kChunk, transposed for
// nearest_two), then sum the new partition in query order.
//
// Hamerly's bounds skip most distance computations after the first round: a query keeps an upper bound u
// on the distance to its own centroid and a lower bound l on the distance to any other; when the
// centroids move, u grows by how far its own moved and l shrinks by the farthest move. A query with
// l^2 - u^2 above 1e-5 (||q||^2 + max ||c||^2), far more than float rounding, cannot change cluster and
// is not recomputed; ties and near ties always are.
void lloyd_one(const float* __restrict q, int64_t n, int64_t dk, int64_t clusters, int64_t iterations,
               int64_t* __restrict assign, float* __restrict means, float* __restrict counts) {
  std::vector<float> sums(clusters * dk, 0.f), next(clusters * dk), next_counts(clusters), bias(clusters),
      qt(dk * kChunk), zeros(dk, 0.f), upper(n), lower(n), qnorm(n), moved(clusters, 0.f);
  int64_t todo[kChunk], best[kChunk];
  float first[kChunk], second[kChunk];
  float farthest = 0.f;
  std::fill(counts, counts + clusters, 0.f);
  accumulate(q, assign, 0, n, dk, sums.data(), counts, qnorm.data());
  divide(sums.data(), counts, clusters, dk, means);
  for (int64_t it = 0; it < iterations; ++it) {
    float largest = 0.f;
    for (int64_t c = 0; c < clusters; ++c) {
      bias[c] = kInf;
      if (counts[c] == 0.f) continue;  // an empty cluster never wins
      float norm = 0.f;
      for (int64_t d = 0; d < dk; ++d) norm += means[c * dk + d] * means[c * dk + d];
      bias[c] = norm;
      largest = std::max(largest, norm);
    }
    // The queries that may move, in chunks of kChunk; after each chunk, the sums of the new partition up to
    // its last query, in query order (those rows were just read: one pass over the queries per round).
    bool changed = false;
    int64_t count = 0, summed = 0;
    std::fill(next.begin(), next.end(), 0.f);
    std::fill(next_counts.begin(), next_counts.end(), 0.f);
    auto flush = [&]() {
      const float* rows[kChunk];
      for (int64_t j = 0; j < kChunk; ++j) rows[j] = j < count ? q + todo[j] * dk : zeros.data();
      transpose_rows(rows, kChunk, dk, qt.data());
      nearest_two(qt.data(), dk, means, bias.data(), clusters, best, first, second);
      for (int64_t j = 0; j < count; ++j) {
        const int64_t i = todo[j];
        upper[i] = std::sqrt(std::max(first[j] + qnorm[i], 0.f));
        lower[i] = second[j] == kInf ? kInf : std::sqrt(std::max(second[j] + qnorm[i], 0.f));
        if (best[j] >= 0 && best[j] != assign[i]) {
          assign[i] = best[j];
          changed = true;
        }
      }
      const int64_t last = todo[count - 1] + 1;
      accumulate(q, assign, summed, last, dk, next.data(), next_counts.data());
      summed = last;
      count = 0;
    };
    for (int64_t i = 0; i < n; ++i) {
      if (assign[i] < 0) continue;
      if (it > 0) {
        const float u = upper[i] + moved[assign[i]], l = lower[i] - farthest;
        upper[i] = u;
        lower[i] = l;
        if (l > u && (l - u) * (l + u) > 1e-5f * (qnorm[i] + largest)) continue;  // cannot move
      }
      todo[count++] = i;
      if (count == kChunk) flush();
    }
    if (count > 0) flush();
    accumulate(q, assign, summed, n, dk, next.data(), next_counts.data());
    if (!changed) break;  // a fixed point: the same sums, and further rounds change nothing
    farthest = 0.f;  // how far the centroids moved: the bounds widen by it in the next round
    for (int64_t c = 0; c < clusters; ++c) {
      const float divisor = next_counts[c] > 1.f ? next_counts[c] : 1.f;
      float s = 0.f;
      for (int64_t d = 0; d < dk; ++d) {
        const float updated = next[c * dk + d] / divisor;
        const float delta = updated - means[c * dk + d];
        s += delta * delta;
        means[c * dk + d] = updated;
      }
      counts[c] = next_counts[c];
      moved[c] = std::sqrt(s);
      if (counts[c] > 0.f) farthest = std::max(farthest, moved[c]);
    }
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> lloyd_refine_cpu(const at::Tensor& queries,
                                                                const at::Tensor& assignments, int64_t clusters,
                                                                int64_t iterations) {
  check_dim(queries, 4, "queries", "(R, H, N, Dk)");
  check_attention_dtype(queries, "queries");
  TORCH_CHECK_VALUE(clusters >= 1, "clusters must be >= 1, got ", clusters);
  TORCH_CHECK_VALUE(iterations >= 0, "iterations must be >= 0, got ", iterations);
  const int64_t rows = queries.size(0), heads = queries.size(1), n = queries.size(2), dk = queries.size(3);
  check_assignments(assignments, rows, heads, n, queries);
  const at::Tensor q = queries.to(at::kFloat).contiguous();
  at::Tensor assign = assignments.contiguous().clone();
  at::Tensor centroids = at::empty({rows, heads, clusters, dk}, q.options());
  at::Tensor counts = at::empty({rows, heads, clusters}, q.options());
  const float* qp = q.data_ptr<float>();
  int64_t* ap = assign.data_ptr<int64_t>();
  float* cp_ = centroids.data_ptr<float>();
  float* np_ = counts.data_ptr<float>();
  for (int64_t i = 0; i < assign.numel(); ++i)
    TORCH_CHECK_VALUE(ap[i] >= -1 && ap[i] < clusters, "assignments must be -1 or in 0..", clusters - 1, ", got ",
                      ap[i]);
  // Cost per (row, head): ~n * clusters * dk multiply-adds per round.
  parallel_for(0, rows * heads, grain_for(n * clusters * dk * std::max<int64_t>(iterations, 1)),
               [&](int64_t begin, int64_t end) {
                 for (int64_t rh = begin; rh < end; ++rh)
                   lloyd_one(qp + rh * n * dk, n, dk, clusters, iterations, ap + rh * n, cp_ + rh * clusters * dk,
                             np_ + rh * clusters);
               });
  return {assign, centroids, counts};
}

TORCH_LIBRARY_IMPL(bert_cluster, CPU, m) { m.impl("lloyd_refine", &lloyd_refine_cpu); }

}  // namespace bert_cluster
