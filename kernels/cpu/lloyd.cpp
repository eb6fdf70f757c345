// lloyd_refine on the CPU (i-clustered+, issue 13): Lloyd rounds on the real query vectors, started from
// the Hamming K-means partition. See bert_cluster/reference.py (lloyd_refine) for the rules reproduced:
// distances ||c||^2 - 2 q.c in float32, ties to the lowest cluster index, empty clusters never win,
// padded queries (-1) stay -1, stop at a fixed point. Means are summed in query order, as the reference's
// index_add_, so the centroids of one partition agree bit for bit; the dot products are summed in
// another order than the reference's GEMM, so a query within a few ulps of a tie may pick the other side.
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "../checks.h"
#include "common.h"
#include "lanes.h"
#include "ops.h"
#include "parallel.h"
#include "steps.h"
#include "vec.h"

namespace bert_cluster {
namespace {

constexpr int64_t kLanes = 16;  // the width of f32x16 (vec.h)
constexpr float kInf = std::numeric_limits<float>::infinity();

constexpr int64_t kGroup = 16;  // queries per vector (one lane each)
constexpr int kBatch = 4;        // vectors of queries per distance pass (sixteen FMA chains with four centroids)

// sums[c] += q_i and counts[c] += 1 for the valid queries i in [begin, end) (rows `stride` floats apart), in query
// order (the order of the reference's index_add_, so that the sums agree bit for bit); with `norms`, also
// norms[i] = ||q_i||^2 (16 partial sums: a plain float sum does not vectorise) in the same pass.
void accumulate(const float* __restrict q, int64_t stride, const int64_t* __restrict assign, int64_t begin,
                int64_t end, int64_t dk, float* __restrict sums, float* __restrict counts,
                float* __restrict norms = nullptr) {
  for (int64_t i = begin; i < end; ++i) {
    const int64_t c = assign[i];
    if (c < 0) continue;
    counts[c] += 1.f;
    float* m = sums + c * dk;
    const float* qi = q + i * stride;
    int64_t d = 0;
    for (; d + 16 <= dk; d += 16) store16(m + d, load16(m + d) + load16(qi + d));
    for (; d < dk; ++d) m[d] += qi[d];
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

// norms[c] = ||means[c]||^2, summed over d in order as one FMA chain per centroid (the CUDA kernel's fmaf
// chain), 16 centroids to a vector: the centroids transposed first. One centroid at a time the chain was a
// scalar add after each product, 64 dependent adds per centroid (about 2 us of a head's ~7 us of Lloyd at
// 128 tokens, 25 clusters).
void squared_norms(const float* __restrict means, int64_t clusters, int64_t dk, LloydScratch& sc,
                   float* __restrict norms) {
  const int64_t cp = pad16(clusters);
  sc.mean_rows.resize(clusters);
  for (int64_t c = 0; c < clusters; ++c) sc.mean_rows[c] = means + c * dk;
  sc.means_t.resize(std::max<int64_t>(dk, 1) * cp);
  transpose_rows(sc.mean_rows.data(), clusters, dk, sc.means_t.data());
  for (int64_t c0 = 0; c0 < cp; c0 += kLanes) {
    f32x16 norm = {};
    for (int64_t d = 0; d < dk; ++d) {
      const f32x16 x = load16(sc.means_t.data() + d * cp + c0);
      norm += x * x;
    }
    float lanes[kLanes];
    store16(lanes, norm);
    for (int64_t j = 0; j < kLanes && c0 + j < clusters; ++j) norms[c0 + j] = lanes[j];
  }
}

// The nearest and second nearest centroid of kBatch x 16 queries, lane j of vector v being query lane j of
// the columns at qt + offset[v]: qt holds queries transposed, feature d of those 16 at qt + d * stride +
// offset[v]. means: (clusters, dk); bias: ||c||^2, +inf for an empty cluster (it never wins). Distances are
// ||c||^2 - 2 q.c (||q||^2 left out), summed over dk in order. Four centroids at a time with AVX-512 (each
// query vector loaded once for four centroids), one below it; the minimum runs down the centroids in index
// order with a strict <, so the lowest index wins ties. Results for lane j of vector v at [v * 16 + j].
void nearest_two(const float* __restrict qt, int64_t stride, const int64_t* offset, int64_t dk,
                 const float* __restrict means, const float* __restrict bias, int64_t clusters,
                 int64_t* __restrict best, float* __restrict first, float* __restrict second) {
  constexpr int V = kBatch;
  // Centroids per pass: kCentroids x V accumulators, which must stay in registers with the V query vectors
  // (32 with AVX-512; with AVX2 each takes 2 of 16, so one centroid per pass).
  constexpr int kCentroids = kNativeBytes == 64 ? 4 : 1;
  const f32x16 inf = f32x16{} + kInf;
  f32x16 f[V], s[V];
  i32x16 b[V];
  const float* columns[V];
  for (int v = 0; v < V; ++v) {
    f[v] = inf;
    s[v] = inf;
    b[v] = i32x16{} - 1;
    columns[v] = qt + offset[v];
  }
  for (int64_t c = 0; c < clusters; c += kCentroids) {
    const int count = static_cast<int>(std::min<int64_t>(kCentroids, clusters - c));
    const float* m[kCentroids];
    for (int j = 0; j < kCentroids; ++j) m[j] = means + (c + std::min(j, count - 1)) * dk;  // repeats are unused
    f32x16 a[kCentroids][V] = {};
    for (int64_t d = 0; d < dk; ++d) {
      f32x16 column[V];
      for (int v = 0; v < V; ++v) column[v] = load16(columns[v] + d * stride);
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
        s[v] = select(closer, f[v], select(distance < s[v], distance, s[v]));
        b[v] = select(closer, index, b[v]);
        f[v] = select(closer, distance, f[v]);
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

// What one thread reuses from one (row, head) to the next.
// Lloyd rounds of one (row, head): q holds its n query rows `stride` floats apart. Each round assigns the
// queries that may move, then sums the new partition in query order.
//
// Distance passes take queries transposed, 16 to a vector. A round gathers the queries it recomputes into
// a transposed chunk of 64 and sums the rows up to the chunk's last one right after (they were just read:
// one pass over the queries per round). When a later round recomputes most of a head that fits in cache,
// the head is transposed once instead (qt: group g of 16 queries a (dk x 16) block at g * dk * 16), and
// those rounds run over the groups that hold a query to recompute, four groups per pass.
//
// Hamerly's bounds skip most distance computations after the first round: a query keeps an upper bound u
// on the distance to its own centroid and a lower bound l on the distance to any other; when the
// centroids move, u grows by how far its own moved and l shrinks by the farthest move. A query with
// l^2 - u^2 above 1e-5 (||q||^2 + max ||c||^2), far more than float rounding, cannot change cluster and
// is not recomputed; ties and near ties always are. The last round needs no bounds.
void lloyd_one(const float* __restrict q, int64_t stride, int64_t n, int64_t dk, int64_t clusters,
               int64_t iterations, int64_t* __restrict assign, float* __restrict means, float* __restrict counts,
               LloydScratch& sc) {
  constexpr int64_t kChunk = kBatch * kGroup;
  constexpr int64_t kCachedHead = 256 * 1024;  // bytes of transposed queries kept across rounds
  const int64_t np = pad16(n);
  const bool bounded = iterations > 1;
  sc.chunk.resize(dk * kChunk);
  sc.sums.assign(clusters * dk, 0.f);
  sc.next.resize(clusters * dk);
  sc.next_counts.resize(clusters);
  sc.bias.resize(clusters);
  sc.moved.assign(clusters, 0.f);
  sc.zeros.assign(dk, 0.f);
  sc.rows.resize(std::max(n, kChunk));
  sc.todo.resize(n);
  sc.recompute.assign(np, 0);
  if (bounded) {
    sc.upper.resize(n);
    sc.lower.resize(n);
    sc.qnorm.resize(n);
  }
  float* upper = sc.upper.data();
  float* lower = sc.lower.data();
  const float* qnorm = sc.qnorm.data();
  int64_t best[kChunk];
  float first[kChunk], second[kChunk];
  float farthest = 0.f;
  bool transposed = false;  // sc.qt holds this head
  std::fill(counts, counts + clusters, 0.f);
  accumulate(q, stride, assign, 0, n, dk, sc.sums.data(), counts, bounded ? sc.qnorm.data() : nullptr);
  divide(sc.sums.data(), counts, clusters, dk, means);
  for (int64_t it = 0; it < iterations; ++it) {
    const bool last = it + 1 == iterations;
    squared_norms(means, clusters, dk, sc, sc.bias.data());
    float largest = 0.f;
    for (int64_t c = 0; c < clusters; ++c) {
      if (counts[c] == 0.f) {
        sc.bias[c] = kInf;  // an empty cluster never wins
        continue;
      }
      largest = std::max(largest, sc.bias[c]);
    }
    // The queries that may move.
    int64_t count = 0;
    for (int64_t i = 0; i < n; ++i) {
      sc.recompute[i] = 0;
      if (assign[i] < 0) continue;
      if (it > 0) {
        const float u = upper[i] + sc.moved[assign[i]], l = lower[i] - farthest;
        upper[i] = u;
        lower[i] = l;
        if (l > u && (l - u) * (l + u) > 1e-5f * (qnorm[i] + largest)) continue;  // cannot move
      }
      sc.todo[count++] = i;
      sc.recompute[i] = 1;
    }
    // The new cluster (and bounds) of query i from lane j of the last distance pass.
    bool changed = false;
    auto take = [&](int64_t i, int64_t j) {
      if (!last) {
        upper[i] = std::sqrt(std::max(first[j] + qnorm[i], 0.f));
        lower[i] = second[j] == kInf ? kInf : std::sqrt(std::max(second[j] + qnorm[i], 0.f));
      }
      if (best[j] >= 0 && best[j] != assign[i]) {
        assign[i] = best[j];
        changed = true;
      }
    };
    std::fill(sc.next.begin(), sc.next.end(), 0.f);
    std::fill(sc.next_counts.begin(), sc.next_counts.end(), 0.f);
    if (it > 0 && count * 4 >= n && np * dk * static_cast<int64_t>(sizeof(float)) <= kCachedHead) {
      // Most of a small head: the groups that hold a query to recompute, four to a pass.
      if (!transposed) {
        sc.qt.resize(dk * np);
        for (int64_t i = 0; i < n; ++i) sc.rows[i] = q + i * stride;
        for (int64_t g = 0; g * kGroup < n; ++g)
          transpose_rows(sc.rows.data() + g * kGroup, std::min(kGroup, n - g * kGroup), dk,
                         sc.qt.data() + g * dk * kGroup);
        transposed = true;
      }
      int64_t offset[kBatch], group[kBatch];
      int filled = 0;
      auto pass = [&]() {
        for (int v = filled; v < kBatch; ++v) offset[v] = offset[0];  // repeats are unused
        nearest_two(sc.qt.data(), kGroup, offset, dk, means, sc.bias.data(), clusters, best, first, second);
        for (int v = 0; v < filled; ++v)
          for (int64_t j = 0; j < kGroup; ++j) {
            const int64_t i = group[v] * kGroup + j;
            if (i < n && sc.recompute[i]) take(i, v * kGroup + j);
          }
        filled = 0;
      };
      for (int64_t g = 0; g * kGroup < n; ++g) {
        bool any = false;
        for (int64_t j = 0; j < kGroup; ++j) any |= sc.recompute[g * kGroup + j] != 0;
        if (!any) continue;
        group[filled] = g;
        offset[filled++] = g * dk * kGroup;
        if (filled == kBatch) pass();
      }
      if (filled > 0) pass();
      accumulate(q, stride, assign, 0, n, dk, sc.next.data(), sc.next_counts.data());
    } else {
      // Gathered and transposed kChunk at a time; the sums follow each chunk.
      const int64_t offset[kBatch] = {0, kGroup, 2 * kGroup, 3 * kGroup};
      int64_t summed = 0;
      for (int64_t t0 = 0; t0 < count; t0 += kChunk) {
        const int64_t rows = std::min(kChunk, count - t0);
        for (int64_t j = 0; j < kChunk; ++j) sc.rows[j] = j < rows ? q + sc.todo[t0 + j] * stride : sc.zeros.data();
        transpose_rows(sc.rows.data(), kChunk, dk, sc.chunk.data());
        nearest_two(sc.chunk.data(), kChunk, offset, dk, means, sc.bias.data(), clusters, best, first, second);
        for (int64_t j = 0; j < rows; ++j) take(sc.todo[t0 + j], j);
        const int64_t end = sc.todo[t0 + rows - 1] + 1;
        accumulate(q, stride, assign, summed, end, dk, sc.next.data(), sc.next_counts.data());
        summed = end;
      }
      accumulate(q, stride, assign, summed, n, dk, sc.next.data(), sc.next_counts.data());
    }
    if (!changed) break;  // a fixed point: the same sums, and further rounds change nothing
    if (last) {  // the means of the final partition; no later round needs the bounds' moves
      std::copy(sc.next_counts.begin(), sc.next_counts.end(), counts);
      divide(sc.next.data(), counts, clusters, dk, means);
      break;
    }
    farthest = 0.f;  // how far the centroids moved: the bounds widen by it in the next round
    for (int64_t c = 0; c < clusters; ++c) {
      const float divisor = sc.next_counts[c] > 1.f ? sc.next_counts[c] : 1.f;
      float s = 0.f;
      for (int64_t d = 0; d < dk; ++d) {
        const float updated = sc.next[c * dk + d] / divisor;
        const float delta = updated - means[c * dk + d];
        s += delta * delta;
        means[c * dk + d] = updated;
      }
      counts[c] = sc.next_counts[c];
      sc.moved[c] = std::sqrt(s);
      if (counts[c] > 0.f) farthest = std::max(farthest, sc.moved[c]);
    }
  }
}

}  // namespace

void lloyd_refine_head(const float* q, int64_t stride, int64_t n, int64_t dk, int64_t clusters, int64_t iterations,
                       int64_t* assign, float* means, float* counts, LloydScratch& scratch) {
  lloyd_one(q, stride, n, dk, clusters, iterations, assign, means, counts, scratch);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lloyd_refine_cpu(const at::Tensor& queries,
                                                                const at::Tensor& assignments, int64_t clusters,
                                                                int64_t iterations) {
  check_dim(queries, 4, "queries", "(R, H, N, Dk)");
  check_attention_dtype(queries, "queries");
  TORCH_CHECK_VALUE(clusters >= 1, "clusters must be >= 1, got ", clusters);
  TORCH_CHECK_VALUE(iterations >= 0, "iterations must be >= 0, got ", iterations);
  const int64_t rows = queries.size(0), heads = queries.size(1), n = queries.size(2), dk = queries.size(3);
  check_assignments(assignments, rows, heads, n, queries);
  // float32 rows are read where they are (HF layout: a head's rows a hidden state apart); others widened.
  const at::Tensor q =
      queries.scalar_type() == at::kFloat ? last_dim_contiguous(queries) : queries.to(at::kFloat).contiguous();
  const Rows qrows = Rows::of(q);
  at::Tensor assign = assignments.contiguous().clone();
  at::Tensor centroids = empty_tensor({rows, heads, clusters, dk}, q.options());
  at::Tensor counts = empty_tensor({rows, heads, clusters}, q.options());
  int64_t* ap = assign.data_ptr<int64_t>();
  float* cp_ = centroids.data_ptr<float>();
  float* np_ = counts.data_ptr<float>();
  for (int64_t i = 0; i < assign.numel(); ++i)
    TORCH_CHECK_VALUE(ap[i] >= -1 && ap[i] < clusters, "assignments must be -1 or in 0..", clusters - 1, ", got ",
                      ap[i]);
  if (assign.numel() == 0) return {assign, centroids.zero_(), counts.zero_()};
  // Cost per (row, head): ~n * clusters * dk multiply-adds per round.
  parallel_for(0, rows * heads, grain_for(n * clusters * dk * std::max<int64_t>(iterations, 1)),
               [&](int64_t begin, int64_t end) {
                 LloydScratch scratch;
                 for (int64_t rh = begin; rh < end; ++rh)
                   lloyd_one(qrows.at<float>(rh / heads, rh % heads), qrows.s2, n, dk, clusters, iterations,
                             ap + rh * n, cp_ + rh * clusters * dk, np_ + rh * clusters, scratch);
               });
  return {assign, centroids, counts};
}

}  // namespace bert_cluster
