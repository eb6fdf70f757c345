// clustered_heads on the CPU: every step of clustered, i-clustered or i-clustered+ attention in one op.
//
// The steps are the ops' own functions (steps.h), so the result is theirs bit for bit. What changes is the
// schedule: with at least as many (row, head)s as threads and heads that fit in cache, one task runs every
// step of a head after another (hash, K-means, centroids, centroid attention, refinement), so a call is
// one parallel region instead of five, its steps stay in the head's cache, and no step is too small to
// split across threads (at 512 tokens the separate centroid step stayed on one thread). Otherwise (one
// long row of few heads, or heads too large for the cache) each step runs its own parallel loop, as the
// separate ops do, without their Python round trips.
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "../checks.h"
#include "common.h"
#include "lanes.h"
#include "ops.h"
#include "parallel.h"
#include "steps.h"

namespace bert_cluster {
namespace {

enum class Mode { kClustered, kImproved, kImprovedPlus };

constexpr int64_t kPerHeadBytes = int64_t{1} << 20;
// i-clustered+ on fp16/bf16 heads up to this size widened (float32 queries, keys and values) also runs per
// head: see run_clustered_heads.
constexpr int64_t kPerHeadWidenedBytes = int64_t{8} << 20;

// The jobs of every step of one call.
struct StepJobs {
  HashJob hash;
  GroupJob group;
  CentroidJob centroid;
  RefineJob refine;
  QueryMassJob mass;

  // The same jobs on float32 rows q, k, v that resolve every (row, head) to one widened head.
  StepJobs reading(const Rows& q, const Rows& k, const Rows& v) const {
    StepJobs head = *this;
    head.hash.q = head.group.q = head.refine.q = head.mass.q = q;
    head.centroid.keys = head.refine.keys = head.mass.keys = k;
    head.centroid.values = head.refine.values = head.mass.values = v;
    head.hash.type = head.group.type = head.centroid.type = head.refine.type = InputType::kFloat32;
    return head;
  }
};

Mode parse_mode(c10::string_view name) {
  const std::string mode(name.data(), name.size());
  if (mode == "clustered") return Mode::kClustered;
  if (mode == "i-clustered") return Mode::kImproved;
  TORCH_CHECK_VALUE(mode == "i-clustered+", "mode must be clustered, i-clustered or i-clustered+, got ", mode);
  return Mode::kImprovedPlus;
}

}  // namespace

namespace {

// A call's output and its partition: what clustered_heads_partition returns (the partition is every step's
// result before the last: (R, H, N) assignments, then centroids, centroid values, top-k indices, mass and
// values, as the separate ops give them), kept by a pass that records gradients for its backward.
using HeadsAndPartition = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

HeadsAndPartition run_clustered_heads(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
                                      const at::Tensor& valid, const at::Tensor& planes, const at::Tensor& offsets,
                                      int64_t clusters, int64_t topk, int64_t iterations, c10::string_view mode_name,
                                      int64_t lloyd_rounds, double scaling) {
  const Mode mode = parse_mode(mode_name);
  check_qkv(queries, keys, values);
  check_hash_args(queries, planes, offsets);
  const int64_t rows = queries.size(0), heads = queries.size(1), n = queries.size(2);
  const int64_t dk = queries.size(3), dv = values.size(3), bits = planes.size(0);
  check_valid(valid, rows, n, queries);
  TORCH_CHECK_VALUE(clusters >= 1, "clusters must be >= 1, got ", clusters);
  TORCH_CHECK_VALUE(iterations >= 0, "iterations must be >= 0, got ", iterations);
  TORCH_CHECK_VALUE(topk >= 0, "topk must be >= 0, got ", topk);
  TORCH_CHECK_VALUE(lloyd_rounds >= 0, "lloyd_rounds must be >= 0, got ", lloyd_rounds);
  const int64_t k = mode == Mode::kClustered ? 0 : std::min(topk, n);
  const int64_t rh_count = rows * heads;

  const at::Tensor q = last_dim_contiguous(queries), kk = last_dim_contiguous(keys), vv = last_dim_contiguous(values);
  const at::Tensor ok = valid.contiguous();
  // A head whose queries, keys and values fit in about half of a core's L2 runs all its steps in one task;
  // a larger one gains nothing from that and runs step by step (12 heads, 2 threads, Xeon with 2 MiB of L2
  // per core: per head 1.7x faster at 128 tokens and 1.45x at 512, equal at 2,048 x 32 dims, 5% slower
  // at 8,192 x 32 and 7% at 4,096 x 64).
  const int64_t head_bytes = n * (2 * dk + dv) * static_cast<int64_t>(q.element_size());
  // fp16/bf16 inputs: a head run in one task is widened to float32 once, into the worker's buffers, and
  // every step reads those rows (the same values, so the same bits: the steps widen in registers exactly
  // so). Read in place, each step widened its own rows again (hashing every query, centroid attention its
  // key and value tiles, the refinement each cluster's top-k rows: at 128 tokens each key about C * k / N
  // times), and a bf16 call took 1.35x an fp32 one (12 heads x 128 x 64, i-clustered). Run step by step,
  // i-clustered+ still reads float32 queries (Lloyd rounds, refinement) and keys and values (refinement),
  // as its ops do: its heads are widened one at a time for those steps (the values a widened copy of the
  // whole tensors would hold, without allocating three float32 tensors per call: at 4,096 tokens in bf16
  // their page faults made a call take 15 to 27 ms from run to run, against 13 ms).
  const bool plus = mode == Mode::kImprovedPlus;
  const bool narrow = q.scalar_type() != at::kFloat;
  const bool widen_heads = plus && narrow;
  // Step by step, i-clustered+ widens a fp16/bf16 head twice (its queries for the Lloyd rounds, then its
  // queries, keys and values for the refinement); per head, once. Up to 8 MiB widened the one widening
  // pays for the lost step-by-step schedule (12 heads x 64, 2 threads, Xeon with AMX, bf16, interleaved
  // runs: 14.0 -> 12.4 ms at 4,096 tokens, 27.3 -> 24.4 at 8,192); at 16,384 (12 MiB) it did not
  // (57 -> 68 ms, medians of 5 noisy runs).
  const int64_t widened_bytes = n * (2 * dk + dv) * static_cast<int64_t>(sizeof(float));
  const bool per_head = rh_count >= at::get_num_threads() &&
                        (head_bytes <= kPerHeadBytes || (widen_heads && widened_bytes <= kPerHeadWidenedBytes));
  const auto i64 = queries.options().dtype(at::kLong);
  const auto f32 = queries.options().dtype(at::kFloat);
  // (R, H, N, Dv) as a view of (R, N, H, Dv) memory: transformers takes attention's output as (B, L, H, D), and
  // written so it needs no transposing copy (at 4,096 tokens x 12 heads x 64 that copy took 3.7 ms of 18).
  at::Tensor out = empty_tensor({rows, n, heads, dv}, f32).transpose(1, 2);
  const OutRows out_rows = OutRows::of(out);
  if (out.numel() == 0 || n == 0) {
    return {out.zero_(), zeros_tensor({rows, heads, n}, i64), zeros_tensor({rows, heads, clusters, dk}, f32),
            zeros_tensor({rows, heads, clusters, dv}, f32), zeros_tensor({rows, heads, clusters, k}, i64),
            zeros_tensor({rows, heads, clusters}, f32), zeros_tensor({rows, heads, clusters, dv}, f32)};
  }
  const PaddedPlanes padded = padded_planes(planes, offsets, dk);
  at::Tensor hashes = empty_tensor({rows, heads, n}, i64);
  at::Tensor assign = empty_tensor({rows, heads, n}, i64);
  at::Tensor centroid_hashes = empty_tensor({rows, heads, clusters}, i64);
  // Not zero-filled here (a memset of every head on the calling thread): each head's task writes its own
  // centroids and counts (group_heads clears them first, Lloyd's rounds write them), and centroid
  // attention its mass and top-k values, except with k = 0, whose refinement still reads them as zeros.
  at::Tensor centroids = empty_tensor({rows, heads, clusters, dk}, f32);
  at::Tensor counts = empty_tensor({rows, heads, clusters}, f32);
  at::Tensor centroid_values = empty_tensor({rows, heads, clusters, dv}, f32);
  at::Tensor indices = empty_tensor({rows, heads, clusters, k}, i64);
  at::Tensor mass = k > 0 ? empty_tensor({rows, heads, clusters}, f32) : zeros_tensor({rows, heads, clusters}, f32);
  at::Tensor top_values =
      k > 0 ? empty_tensor({rows, heads, clusters, dv}, f32) : zeros_tensor({rows, heads, clusters, dv}, f32);

  const bool* okp = ok.data_ptr<bool>();
  int64_t* hp = hashes.data_ptr<int64_t>();
  int64_t* ap = assign.data_ptr<int64_t>();
  int64_t* chp = centroid_hashes.data_ptr<int64_t>();
  float* cenp = centroids.data_ptr<float>();
  float* cntp = counts.data_ptr<float>();
  std::vector<int64_t> lo(rows), hi(rows);
  valid_spans(okp, rows, n, lo.data(), hi.data());
  const int64_t groups = (clusters + kLaneCount - 1) / kLaneCount;

  StepJobs jobs{};
  jobs.hash = HashJob{Rows::of(q), input_type(q), padded.planes_t.data(), padded.offsets.data(), heads, n, dk, bits, hp};
  jobs.group = GroupJob{Rows::of(q), input_type(q), ap, heads, n, clusters, dk, cenp, cntp};
  jobs.centroid = CentroidJob{cenp, Rows::of(kk), Rows::of(vv), input_type(kk), okp, lo.data(), hi.data(), heads, n,
                              clusters, groups, dk, dv, k, static_cast<float>(scaling),
                              centroid_values.data_ptr<float>(), mass.data_ptr<float>(),
                              top_values.data_ptr<float>(), indices.data_ptr<int64_t>()};
  jobs.refine = RefineJob{Rows::of(q), Rows::of(kk), Rows::of(vv), input_type(q), ap,
                          centroid_values.data_ptr<float>(), mass.data_ptr<float>(), top_values.data_ptr<float>(),
                          indices.data_ptr<int64_t>(), heads, n, clusters, k, dk, dv, static_cast<float>(scaling),
                          out_rows};
  if (plus) {
    jobs.mass = QueryMassJob{widen_heads ? Rows{} : Rows::of(q), widen_heads ? Rows{} : Rows::of(kk),
                             widen_heads ? Rows{} : Rows::of(vv), okp, ap, cenp, centroid_values.data_ptr<float>(),
                             mass.data_ptr<float>(), top_values.data_ptr<float>(), indices.data_ptr<int64_t>(), heads,
                             n, clusters, k, dk, dv, static_cast<float>(scaling), out_rows};
  }
  auto kmeans = [&](int64_t rh) {
    hamming_kmeans_head(hp + rh * n, okp + (rh / heads) * n, n, clusters, iterations, bits, ap + rh * n,
                        chp + rh * clusters);
  };
  // Lloyd rounds of head rh on the float32 query rows of `job`.
  auto lloyd = [&](const QueryMassJob& job, int64_t rh, LloydScratch& scratch) {
    lloyd_refine_head(job.q.at<float>(rh / heads, rh % heads), job.q.s2, n, dk, clusters, lloyd_rounds, ap + rh * n,
                      cenp + rh * clusters * dk, cntp + rh * clusters, scratch);
  };
  auto finish = [&](const StepJobs& job, int64_t begin, int64_t end) {
    switch (mode) {
      case Mode::kClustered:
        broadcast_cluster_heads(centroid_values.data_ptr<float>(), ap, n, clusters, dv, begin, end, out_rows);
        break;
      case Mode::kImproved: topk_refine_heads(job.refine, begin, end); break;
      case Mode::kImprovedPlus: query_mass_heads(job.mass, begin, end); break;
    }
  };
  // Head rh of `src` (n rows of d values) as float32 in `buf`, as Rows that resolve every (row, head) to it.
  const InputType type = input_type(q);
  auto widened = [&](const at::Tensor& src, int64_t rh, int64_t d, Floats& buf) {
    const Rows rows_in = Rows::of(src);
    buf.resize(static_cast<size_t>(n * d));
    for (int64_t i = 0; i < n; ++i) widen_row(type, rows_in.ptr(rh / heads, rh % heads, i), buf.data() + i * d, d);
    Rows rows_out;
    rows_out.data = buf.data();
    rows_out.s2 = d;
    rows_out.itemsize = static_cast<int64_t>(sizeof(float));
    return rows_out;
  };

  const int64_t vectors = (bits + 15) / 16;
  // Work of one (row, head) in the units of grain_for, per query: hashing (dk x 64 planes), K-means rounds,
  // centroid scores and values over all keys, the refinement's k keys, Lloyd rounds.
  const int64_t head_cost =
      n * (std::max<int64_t>(dk, 1) * 16 * vectors + clusters * iterations * 4 + groups * kLaneCount * (dk + dv + 16) +
           2 * k * (dk + dv) + lloyd_rounds * clusters * dk);
  if (per_head) {
    // Heads taken one at a time from a shared counter: K-means stops at a fixed point, so heads cost
    // unequal time and equal static shares would leave a thread idle. Each head's result is the same
    // whichever thread computes it.
    std::atomic<int64_t> next{0};
    const int64_t workers = std::min<int64_t>(at::get_num_threads(), rh_count);
    // One item per worker; the grain keeps a call too small to pay for a parallel region on one thread.
    parallel_for(0, workers, grain_for(head_cost * rh_count / workers), [&](int64_t, int64_t) {
                   LloydScratch scratch;
                   Floats wq, wk, wv;  // a fp16/bf16 head widened to float32
                   for (int64_t rh = next.fetch_add(1); rh < rh_count; rh = next.fetch_add(1)) {
                     const StepJobs head = narrow ? jobs.reading(widened(q, rh, dk, wq), widened(kk, rh, dk, wk),
                                                                 widened(vv, rh, dv, wv))
                                                  : jobs;
                     hash_rows(head.hash, rh * n, (rh + 1) * n);
                     kmeans(rh);
                     if (plus) {
                       lloyd(head.mass, rh, scratch);
                     } else {
                       group_query_heads(head.group, rh, rh + 1);
                     }
                     centroid_attention_tasks(head.centroid, rh * groups, (rh + 1) * groups);
                     finish(head, rh, rh + 1);
                   }
                 });
    return {out, assign, centroids, centroid_values, indices, mass, top_values};
  }
  // Few or large (row, head)s: each step parallel on its own, with the grains of the separate ops.
  parallel_for(0, rh_count * n, grain_for(std::max<int64_t>(dk, 1) * vectors * 16),
               [&](int64_t begin, int64_t end) { hash_rows(jobs.hash, begin, end); });
  parallel_for(0, rh_count, grain_for(n * clusters * iterations * 32), [&](int64_t begin, int64_t end) {
    for (int64_t rh = begin; rh < end; ++rh) kmeans(rh);
  });
  if (plus) {
    parallel_for(0, rh_count, grain_for(n * clusters * dk * std::max<int64_t>(lloyd_rounds, 1)),
                 [&](int64_t begin, int64_t end) {
                   LloydScratch scratch;
                   Floats wq;
                   for (int64_t rh = begin; rh < end; ++rh) {
                     QueryMassJob job = jobs.mass;
                     if (widen_heads) job.q = widened(q, rh, dk, wq);
                     lloyd(job, rh, scratch);
                   }
                 });
  } else {
    parallel_for(0, rh_count, grain_for(n * dk),
                 [&](int64_t begin, int64_t end) { group_query_heads(jobs.group, begin, end); });
  }
  parallel_for(0, rh_count * groups, grain_for(n * (dk + dv + 16) * kLaneCount / 16),
               [&](int64_t begin, int64_t end) { centroid_attention_tasks(jobs.centroid, begin, end); });
  parallel_for(0, rh_count, grain_for(n * std::max<int64_t>(k, 1) * (dk + dv) / 8),
               [&](int64_t begin, int64_t end) {
                 if (!widen_heads) return finish(jobs, begin, end);
                 Floats wq, wk, wv;
                 for (int64_t rh = begin; rh < end; ++rh)
                   finish(jobs.reading(widened(q, rh, dk, wq), widened(kk, rh, dk, wk), widened(vv, rh, dv, wv)),
                          rh, rh + 1);
               });
  return {out, assign, centroids, centroid_values, indices, mass, top_values};
}

}  // namespace

at::Tensor clustered_heads_cpu(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
                               const at::Tensor& valid, const at::Tensor& planes, const at::Tensor& offsets,
                               int64_t clusters, int64_t topk, int64_t iterations, c10::string_view mode_name,
                               int64_t lloyd_rounds, double scaling) {
  return std::get<0>(run_clustered_heads(queries, keys, values, valid, planes, offsets, clusters, topk, iterations,
                                         mode_name, lloyd_rounds, scaling));
}

HeadsAndPartition clustered_heads_partition_cpu(const at::Tensor& queries, const at::Tensor& keys,
                                                const at::Tensor& values, const at::Tensor& valid,
                                                const at::Tensor& planes, const at::Tensor& offsets, int64_t clusters,
                                                int64_t topk, int64_t iterations, c10::string_view mode_name,
                                                int64_t lloyd_rounds, double scaling) {
  return run_clustered_heads(queries, keys, values, valid, planes, offsets, clusters, topk, iterations, mode_name,
                             lloyd_rounds, scaling);
}

}  // namespace bert_cluster
