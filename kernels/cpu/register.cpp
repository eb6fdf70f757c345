// The CPU kernels' registration with torch's dispatcher, for the ops bert_cluster/ops.py declares: the one
// source of this library that includes torch/library.h (see ops.h).
#include <torch/library.h>

#include "ops.h"

namespace bert_cluster {

TORCH_LIBRARY_IMPL(bert_cluster, CPU, m) {
  m.impl("banded_attention", &banded_attention_cpu);
  m.impl("hash_queries", &hash_queries_cpu);
  m.impl("hamming_kmeans", &hamming_kmeans_cpu);
  m.impl("lloyd_refine", &lloyd_refine_cpu);
  m.impl("clustered_heads", &clustered_heads_cpu);
  m.impl("clustered_heads_partition", &clustered_heads_partition_cpu);
  m.impl("refine_with_query_mass", &refine_with_query_mass_cpu);
  m.impl("group_queries", &group_queries_cpu);
  m.impl("centroid_attention", &centroid_attention_cpu);
  m.impl("topk_refine", &topk_refine_cpu);
  m.impl("broadcast_clusters", &broadcast_clusters_cpu);
  m.impl("topk_refine_backward", &topk_refine_backward_cpu);
  m.impl("refine_with_query_mass_backward", &refine_with_query_mass_backward_cpu);
  m.impl("centroid_attention_backward", &centroid_attention_backward_cpu);
  m.impl("centroid_attention_backward_into", &centroid_attention_backward_into_cpu);
  m.impl("group_queries_backward", &group_queries_backward_cpu);
  m.impl("broadcast_clusters_backward", &broadcast_clusters_backward_cpu);
  m.impl("banded_attention_backward", &banded_attention_backward_cpu);
  m.impl("centroid_rest", &centroid_rest_cpu);
  m.impl("centroid_rest_backward", &centroid_rest_backward_cpu);
}

}  // namespace bert_cluster
