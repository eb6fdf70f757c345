// Input checks shared by the CPU and CUDA implementations. TORCH_CHECK_VALUE / TORCH_CHECK_TYPE surface
// in Python as ValueError / TypeError, with a message saying what was wrong and what is allowed.
#pragma once

#include <ATen/core/Tensor.h>

namespace bert_cluster {

inline bool is_attention_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

inline void check_attention_dtype(const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(is_attention_dtype(t.scalar_type()), name,
                   " must be float32, float16 or bfloat16, got ", t.scalar_type());
}

inline void check_dtype(const at::Tensor& t, at::ScalarType expected, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == expected, name, " must be ", expected, ", got ", t.scalar_type());
}

inline void check_dim(const at::Tensor& t, int64_t dim, const char* name, const char* shape) {
  TORCH_CHECK_VALUE(t.dim() == dim, name, " must have shape ", shape, ", got ", t.sizes());
}

inline void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* a_name, const char* b_name) {
  TORCH_CHECK_VALUE(a.device() == b.device(), a_name, " and ", b_name, " must be on the same device, got ",
                    a.device(), " and ", b.device());
}

// The same message on every backend (reference, CPU, CUDA) for queries and keys of different head dims.
inline void check_same_head_dim(int64_t dq, int64_t dk) {
  TORCH_CHECK_VALUE(dq == dk, "query and key must have the same head dim, got Dq=", dq, " and Dk=", dk);
}

// Every input of one op on one device, with one dtype: the kernels read q, k and v in their own dtype.
inline void check_same_dtype(const at::Tensor& a, const at::Tensor& b, const char* a_name, const char* b_name) {
  TORCH_CHECK_TYPE(a.scalar_type() == b.scalar_type(), a_name, " and ", b_name, " must have the same dtype, got ",
                   a.scalar_type(), " and ", b.scalar_type());
}

// A kernel without attention dropout (the CUDA ones): bert_cluster.dispatch runs dropout on a backend that
// has it, so this only guards a direct call of the op.
inline void check_no_dropout(double dropout, const char* op) {
  TORCH_CHECK_VALUE(dropout == 0.0, op, ": this device's kernels have no attention dropout, got dropout=",
                    dropout, " (the reference backend has it)");
}

// (R, H, N, Dk) queries or keys with a matching (R, H, N, Dv) values tensor.
inline void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  check_dim(q, 4, "queries", "(R, H, N, Dk)");
  check_dim(k, 4, "keys", "(R, H, N, Dk)");
  check_dim(v, 4, "values", "(R, H, N, Dv)");
  check_attention_dtype(q, "queries");
  check_attention_dtype(k, "keys");
  check_attention_dtype(v, "values");
  check_same_head_dim(q.size(3), k.size(3));
  TORCH_CHECK_VALUE(q.sizes() == k.sizes(), "queries and keys must have the same shape (R, H, N, Dk), got ",
                    q.sizes(), " and ", k.sizes());
  check_same_dtype(q, k, "queries", "keys");
  check_same_dtype(q, v, "queries", "values");
  TORCH_CHECK_VALUE(v.sizes().slice(0, 3) == k.sizes().slice(0, 3),
                    "values must be (R, H, N, Dv) with the keys' R, H, N, got ", v.sizes(), " vs ", k.sizes());
  check_same_device(q, k, "queries", "keys");
  check_same_device(q, v, "queries", "values");
}

inline void check_valid(const at::Tensor& valid, int64_t rows, int64_t n, const at::Tensor& like) {
  check_dtype(valid, at::kBool, "valid");
  TORCH_CHECK_VALUE(valid.dim() == 2 && valid.size(0) == rows && valid.size(1) == n,
                    "valid must have shape (R, N) = (", rows, ", ", n, "), got ", valid.sizes());
  check_same_device(valid, like, "valid", "the attention inputs");
}

inline void check_assignments(const at::Tensor& a, int64_t rows, int64_t heads, int64_t n, const at::Tensor& like) {
  check_dtype(a, at::kLong, "assignments");
  TORCH_CHECK_VALUE(a.dim() == 3 && a.size(0) == rows && a.size(1) == heads && a.size(2) == n,
                    "assignments must have shape (R, H, N) = (", rows, ", ", heads, ", ", n, "), got ", a.sizes());
  check_same_device(a, like, "assignments", "the attention inputs");
}

inline void check_kmeans_args(const at::Tensor& hashes, const at::Tensor& valid, int64_t clusters,
                              int64_t iterations, int64_t bits) {
  check_dim(hashes, 3, "hashes", "(R, H, N)");
  check_dtype(hashes, at::kLong, "hashes");
  check_valid(valid, hashes.size(0), hashes.size(2), hashes);
  TORCH_CHECK_VALUE(clusters >= 1, "clusters must be >= 1, got ", clusters);
  TORCH_CHECK_VALUE(iterations >= 0, "iterations must be >= 0, got ", iterations);
  TORCH_CHECK_VALUE(bits >= 1 && bits <= 63, "bits must be in 1..63, got ", bits);
}

inline void check_hash_args(const at::Tensor& queries, const at::Tensor& planes, const at::Tensor& offsets) {
  check_dim(queries, 4, "queries", "(R, H, N, Dk)");
  check_attention_dtype(queries, "queries");
  check_dim(planes, 2, "planes", "(B, Dk)");
  check_dim(offsets, 1, "offsets", "(B,)");
  check_attention_dtype(planes, "planes");
  check_attention_dtype(offsets, "offsets");
  TORCH_CHECK_VALUE(planes.size(1) == queries.size(3), "planes must be (B, Dk) with the queries' Dk = ",
                    queries.size(3), ", got ", planes.sizes());
  TORCH_CHECK_VALUE(offsets.size(0) == planes.size(0), "offsets must be (B,) with B = ", planes.size(0),
                    ", got ", offsets.sizes());
  TORCH_CHECK_VALUE(planes.size(0) >= 1 && planes.size(0) <= 63, "B (hash bits) must be in 1..63, got ",
                    planes.size(0));
  check_same_device(queries, planes, "queries", "planes");
  check_same_device(queries, offsets, "queries", "offsets");
}

inline void check_centroid_args(const at::Tensor& centroids, const at::Tensor& keys, const at::Tensor& values,
                                const at::Tensor& valid, int64_t topk) {
  check_dim(centroids, 4, "centroids", "(R, H, C, Dk)");
  check_dtype(centroids, at::kFloat, "centroids");
  check_dim(keys, 4, "keys", "(R, H, N, Dk)");
  check_dim(values, 4, "values", "(R, H, N, Dv)");
  check_attention_dtype(keys, "keys");
  check_attention_dtype(values, "values");
  check_same_head_dim(centroids.size(3), keys.size(3));
  check_same_dtype(keys, values, "keys", "values");
  TORCH_CHECK_VALUE(centroids.size(0) == keys.size(0) && centroids.size(1) == keys.size(1),
                    "centroids (R, H, C, Dk) must match keys (R, H, N, Dk), got ", centroids.sizes(), " and ",
                    keys.sizes());
  TORCH_CHECK_VALUE(values.sizes().slice(0, 3) == keys.sizes().slice(0, 3),
                    "values must be (R, H, N, Dv) with the keys' R, H, N, got ", values.sizes(), " vs ", keys.sizes());
  check_valid(valid, keys.size(0), keys.size(2), keys);
  TORCH_CHECK_VALUE(topk >= 0, "topk must be >= 0, got ", topk);
  check_same_device(centroids, keys, "centroids", "keys");
  check_same_device(values, keys, "values", "keys");
}

inline void check_refine_args(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
                              const at::Tensor& assignments, const at::Tensor& centroid_values,
                              const at::Tensor& topk_indices, const at::Tensor& topk_mass,
                              const at::Tensor& topk_values) {
  check_qkv(queries, keys, values);
  const int64_t rows = queries.size(0), heads = queries.size(1), n = queries.size(2), dv = values.size(3);
  check_assignments(assignments, rows, heads, n, queries);
  check_dim(centroid_values, 4, "centroid_values", "(R, H, C, Dv)");
  check_dtype(centroid_values, at::kFloat, "centroid_values");
  const int64_t clusters = centroid_values.size(2);
  TORCH_CHECK_VALUE(centroid_values.size(0) == rows && centroid_values.size(1) == heads &&
                        centroid_values.size(3) == dv,
                    "centroid_values must be (R, H, C, Dv) = (", rows, ", ", heads, ", C, ", dv, "), got ",
                    centroid_values.sizes());
  check_dim(topk_indices, 4, "topk_indices", "(R, H, C, k)");
  check_dtype(topk_indices, at::kLong, "topk_indices");
  TORCH_CHECK_VALUE(topk_indices.size(0) == rows && topk_indices.size(1) == heads && topk_indices.size(2) == clusters,
                    "topk_indices must be (R, H, C, k) = (", rows, ", ", heads, ", ", clusters, ", k), got ",
                    topk_indices.sizes());
  check_dtype(topk_mass, at::kFloat, "topk_mass");
  TORCH_CHECK_VALUE(topk_mass.dim() == 3 && topk_mass.sizes() == centroid_values.sizes().slice(0, 3),
                    "topk_mass must be (R, H, C), got ", topk_mass.sizes());
  check_dtype(topk_values, at::kFloat, "topk_values");
  TORCH_CHECK_VALUE(topk_values.sizes() == centroid_values.sizes(), "topk_values must be (R, H, C, Dv) like centroid_values, got ",
                    topk_values.sizes());
  check_same_device(centroid_values, queries, "centroid_values", "queries");
  check_same_device(topk_indices, queries, "topk_indices", "queries");
  check_same_device(topk_mass, queries, "topk_mass", "queries");
  check_same_device(topk_values, queries, "topk_values", "queries");
}

inline void check_group_args(const at::Tensor& queries, const at::Tensor& assignments, int64_t clusters) {
  check_dim(queries, 4, "queries", "(R, H, N, Dk)");
  check_attention_dtype(queries, "queries");
  TORCH_CHECK_VALUE(clusters >= 1, "clusters must be >= 1, got ", clusters);
  check_assignments(assignments, queries.size(0), queries.size(1), queries.size(2), queries);
}

inline void check_banded_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& valid,
                              int64_t window) {
  check_qkv(q, k, v);
  check_valid(valid, q.size(0), q.size(2), q);
  TORCH_CHECK_VALUE(window >= 0, "window must be >= 0 (the band's half width), got ", window);
}

inline void check_broadcast_args(const at::Tensor& centroid_values, const at::Tensor& assignments) {
  check_dim(centroid_values, 4, "centroid_values", "(R, H, C, Dv)");
  check_attention_dtype(centroid_values, "centroid_values");
  check_assignments(assignments, centroid_values.size(0), centroid_values.size(1), assignments.dim() == 3 ? assignments.size(2) : -1,
                    centroid_values);
}

}  // namespace bert_cluster
