// The CPU ops' entry points, one per op of bert_cluster/ops.py (whose schema is its reference function's
// signature), registered with the dispatcher by register.cpp alone: torch/library.h (and ATen/ATen.h, which
// the kernels do not need) are the costly headers of a build, so the kernel sources include only ATen's
// tensor and the few ops they call.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <cstdint>
#include <tuple>

namespace bert_cluster {

// The refinements and the band take attention dropout as their last two arguments (0: none); with dropout != 0
// they run the *_dropped_cpu kernels (dropout.cpp, declared at the end).
at::Tensor banded_attention_cpu(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
                                const at::Tensor& valid, int64_t window, double scaling, double dropout,
                                int64_t seed);

at::Tensor hash_queries_cpu(const at::Tensor& queries, const at::Tensor& planes, const at::Tensor& offsets);

std::tuple<at::Tensor, at::Tensor> hamming_kmeans_cpu(const at::Tensor& hashes, const at::Tensor& valid,
                                                      int64_t clusters, int64_t iterations, int64_t bits);

std::tuple<at::Tensor, at::Tensor, at::Tensor> lloyd_refine_cpu(const at::Tensor& queries,
                                                                const at::Tensor& assignments, int64_t clusters,
                                                                int64_t iterations);

at::Tensor clustered_heads_cpu(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
                               const at::Tensor& valid, const at::Tensor& planes, const at::Tensor& offsets,
                               int64_t clusters, int64_t topk, int64_t iterations, c10::string_view mode_name,
                               int64_t lloyd_rounds, double scaling);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
clustered_heads_partition_cpu(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
                              const at::Tensor& valid, const at::Tensor& planes, const at::Tensor& offsets,
                              int64_t clusters, int64_t topk, int64_t iterations, c10::string_view mode_name,
                              int64_t lloyd_rounds, double scaling);

at::Tensor refine_with_query_mass_cpu(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
                                      const at::Tensor& valid, const at::Tensor& assignments,
                                      const at::Tensor& centroids, const at::Tensor& centroid_values,
                                      const at::Tensor& topk_indices, const at::Tensor& topk_mass,
                                      const at::Tensor& topk_values, double scaling, double dropout, int64_t seed);

std::tuple<at::Tensor, at::Tensor> group_queries_cpu(const at::Tensor& queries, const at::Tensor& assignments,
                                                     int64_t clusters);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> centroid_attention_cpu(
    const at::Tensor& centroids, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& valid,
    int64_t topk, double scaling);

at::Tensor topk_refine_cpu(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
                           const at::Tensor& assignments, const at::Tensor& centroid_values,
                           const at::Tensor& topk_indices, const at::Tensor& topk_mass, const at::Tensor& topk_values,
                           double scaling, double dropout, int64_t seed);

at::Tensor broadcast_clusters_cpu(const at::Tensor& centroid_values, const at::Tensor& assignments);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> topk_refine_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
    const at::Tensor& assignments, const at::Tensor& topk_indices, const at::Tensor& topk_mass, double scaling,
    double dropout, int64_t seed);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
refine_with_query_mass_backward_cpu(const at::Tensor& grad_out, const at::Tensor& queries, const at::Tensor& keys,
                                    const at::Tensor& values, const at::Tensor& valid, const at::Tensor& assignments,
                                    const at::Tensor& centroids, const at::Tensor& centroid_values,
                                    const at::Tensor& topk_indices, const at::Tensor& topk_mass,
                                    const at::Tensor& topk_values, double scaling, double dropout, int64_t seed);

std::tuple<at::Tensor, at::Tensor, at::Tensor> centroid_attention_backward_cpu(
    const at::Tensor& grad_centroid_values, const at::Tensor& grad_topk_mass, const at::Tensor& grad_topk_values,
    const at::Tensor& centroids, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& valid,
    const at::Tensor& topk_indices, double scaling);

// centroid_attention_backward with its key and value gradients added into grad_keys and grad_values (float32,
// contiguous, in place): returns the centroids' gradient.
at::Tensor centroid_attention_backward_into_cpu(at::Tensor& grad_keys, at::Tensor& grad_values,
                                                const at::Tensor& grad_centroid_values,
                                                const at::Tensor& grad_topk_mass, const at::Tensor& grad_topk_values,
                                                const at::Tensor& centroids, const at::Tensor& keys,
                                                const at::Tensor& values, const at::Tensor& valid,
                                                const at::Tensor& topk_indices, double scaling);

at::Tensor group_queries_backward_cpu(const at::Tensor& grad_centroids, const at::Tensor& queries,
                                      const at::Tensor& assignments);

at::Tensor broadcast_clusters_backward_cpu(const at::Tensor& grad_out, const at::Tensor& centroid_values,
                                           const at::Tensor& assignments);

std::tuple<at::Tensor, at::Tensor, at::Tensor> banded_attention_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
    const at::Tensor& valid, int64_t window, double scaling, double dropout, int64_t seed);

// Attention dropout in training (dropout.cpp): the masks are reference.dropout_uniforms', drawn from the seed.
at::Tensor centroid_rest_cpu(const at::Tensor& centroids, const at::Tensor& keys, const at::Tensor& values,
                             const at::Tensor& valid, const at::Tensor& topk_indices, double scaling, double dropout,
                             int64_t seed);

std::tuple<at::Tensor, at::Tensor, at::Tensor> centroid_rest_backward_cpu(
    const at::Tensor& grad, const at::Tensor& centroids, const at::Tensor& keys, const at::Tensor& values,
    const at::Tensor& valid, const at::Tensor& topk_indices, double scaling, double dropout, int64_t seed);

// The dropout path of the refinements and the band, forward and backward (not ops of their own: the entries
// above call them when dropout != 0).
at::Tensor topk_refine_dropped_cpu(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
                                   const at::Tensor& assignments, const at::Tensor& centroid_values,
                                   const at::Tensor& topk_indices, const at::Tensor& topk_mass,
                                   const at::Tensor& topk_values, double scaling, double dropout, int64_t seed);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> topk_refine_backward_dropped_cpu(
    const at::Tensor& grad_out, const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
    const at::Tensor& assignments, const at::Tensor& topk_indices, const at::Tensor& topk_mass, double scaling,
    double dropout, int64_t seed);

at::Tensor refine_with_query_mass_dropped_cpu(const at::Tensor& queries, const at::Tensor& keys,
                                              const at::Tensor& values, const at::Tensor& valid,
                                              const at::Tensor& assignments, const at::Tensor& centroids,
                                              const at::Tensor& centroid_values, const at::Tensor& topk_indices,
                                              const at::Tensor& topk_mass, const at::Tensor& topk_values,
                                              double scaling, double dropout, int64_t seed);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
refine_with_query_mass_backward_dropped_cpu(const at::Tensor& grad_out, const at::Tensor& queries,
                                            const at::Tensor& keys, const at::Tensor& values, const at::Tensor& valid,
                                            const at::Tensor& assignments, const at::Tensor& centroids,
                                            const at::Tensor& centroid_values, const at::Tensor& topk_indices,
                                            const at::Tensor& topk_mass, const at::Tensor& topk_values,
                                            double scaling, double dropout, int64_t seed);

at::Tensor banded_attention_dropped_cpu(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
                                        const at::Tensor& valid, int64_t window, double scaling, double dropout,
                                        int64_t seed);

std::tuple<at::Tensor, at::Tensor, at::Tensor> banded_attention_backward_dropped_cpu(
    const at::Tensor& grad_out, const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
    const at::Tensor& valid, int64_t window, double scaling, double dropout, int64_t seed);

}  // namespace bert_cluster
