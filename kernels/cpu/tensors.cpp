// New tensors for the kernels' outputs and scratch: ATen's factory functions behind two plain calls, so
// that only this source includes their headers (ATen/ops/*.h pull in half of ATen; see ops.h).
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include "common.h"

namespace bert_cluster {

at::Tensor empty_tensor(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return at::empty(sizes, options);
}

at::Tensor zeros_tensor(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return at::zeros(sizes, options);
}

}  // namespace bert_cluster
