// The work of each step for a range of (row, head)s: what the ops of hash.cpp, sparse.cpp, lloyd.cpp and
// query_mass.cpp run in their parallel loops, and what clustered_heads (pipeline.cpp) runs for one (row,
// head) after another in a single task, so that a whole attention call is one parallel region with every
// step of a head in cache. The same functions in both: the fused op gives the steps' results bit for bit.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "common.h"

namespace bert_cluster {

// Where a step writes its float32 output rows: row i of (row, head) rh's Dv values at head(rh) + i * s2.
// The separate ops write (R, H, N, Dv) contiguous; clustered_heads writes (R, N, H, Dv) memory, the layout
// transformers wants after attention, returned as an (R, H, N, Dv) view (no transposing copy after it).
struct OutRows {
  float* data = nullptr;
  int64_t heads = 1, s0 = 0, s1 = 0, s2 = 0;

  static OutRows of(const at::Tensor& t) {
    return OutRows{t.data_ptr<float>(), t.size(1), t.stride(0), t.stride(1), t.stride(2)};
  }
  float* head(int64_t rh) const { return data + (rh / heads) * s0 + (rh % heads) * s1; }
};

// --- hash_queries (hash.cpp)

struct HashJob {
  Rows q;
  InputType type;
  const float *planes_t, *offsets;  // (max(dk, 1), 64) and (64): see padded_planes
  int64_t heads, n, dk, bits;
  int64_t* out;  // (R, H, N) contiguous
};

// The planes transposed and zero-padded to 64 columns, and the offsets zero-padded to 64, as float32: plain
// buffers filled by loops (two zero tensors and a strided copy through ATen cost several microseconds a
// call, as much as a head's hashing at 128 tokens).
struct PaddedPlanes {
  Floats planes_t, offsets;
};
PaddedPlanes padded_planes(const at::Tensor& planes, const at::Tensor& offsets, int64_t dk);

// Hashes of the flattened (R * H * N) query rows [begin, end).
void hash_rows(const HashJob& job, int64_t begin, int64_t end);

// --- hamming_kmeans (hash.cpp): one (row, head)

void hamming_kmeans_head(const int64_t* hashes, const bool* valid, int64_t n, int64_t clusters, int64_t iterations,
                         int64_t bits, int64_t* assign, int64_t* centroids);

// --- group_queries (sparse.cpp)

struct GroupJob {
  Rows q;
  InputType type;
  const int64_t* assign;
  int64_t heads, n, clusters, dk;
  float* sums;    // (R, H, C, Dk): each head's cleared, then its sums, then its means
  float* counts;  // (R, H, C): each head's cleared, then its counts
};

void group_query_heads(const GroupJob& job, int64_t begin, int64_t end);

// --- centroid_attention (sparse.cpp): tasks of (row, head, 32 clusters), a head's `groups` tasks adjacent

struct CentroidJob {
  const float* centroids;  // (R, H, C, Dk) contiguous
  Rows keys, values;
  InputType type;
  const bool* valid;
  const int64_t *span_lo, *span_hi;  // each row's valid span (valid_spans)
  int64_t heads, n, clusters, groups, dk, dv, k;
  float scaling;
  // (R, H, C, Dv), (R, H, C), (R, H, C, Dv): every cluster's written; with k = 0 mass and top_values are
  // not touched (the caller passes zeros, which the refinement reads)
  float *centroid_values, *mass, *top_values;
  int64_t* indices;  // (R, H, C, k)
};

void centroid_attention_tasks(const CentroidJob& job, int64_t begin, int64_t end);

// --- topk_refine (sparse.cpp)

struct RefineJob {
  Rows q, keys, values;
  InputType type;
  const int64_t* assign;
  const float *centroid_values, *mass, *top_values;
  const int64_t* indices;
  int64_t heads, n, clusters, k, dk, dv;
  float scaling;
  OutRows out;  // (R, H, N, Dv)
};

void topk_refine_heads(const RefineJob& job, int64_t begin, int64_t end);

// --- broadcast_clusters (sparse.cpp), float32

void broadcast_cluster_heads(const float* centroid_values, const int64_t* assign, int64_t n, int64_t clusters,
                             int64_t dv, int64_t begin, int64_t end, const OutRows& out);

// --- lloyd_refine (lloyd.cpp): one (row, head), float32 queries

struct LloydScratch {
  Floats qt, chunk, sums, next, next_counts, bias, upper, lower, qnorm, moved, zeros, means_t;
  std::vector<const float*> rows, mean_rows;
  std::vector<int64_t> todo;
  std::vector<uint8_t> recompute;
};

void lloyd_refine_head(const float* q, int64_t stride, int64_t n, int64_t dk, int64_t clusters, int64_t iterations,
                       int64_t* assign, float* means, float* counts, LloydScratch& scratch);

// --- refine_with_query_mass (query_mass.cpp), float32 inputs

struct QueryMassJob {
  Rows q, keys, values;  // float32
  const bool* valid;
  const int64_t* assign;
  const float *centroids, *centroid_values, *mass, *top_values;
  const int64_t* indices;
  int64_t heads, n, clusters, k, dk, dv;
  float scaling;
  OutRows out;  // (R, H, N, Dv)
};

void query_mass_heads(const QueryMassJob& job, int64_t begin, int64_t end);

}  // namespace bert_cluster
