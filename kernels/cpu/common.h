// What the CPU kernels share besides vec.h: reading (R, H, N, D) tensors in place (any strides except
// the last dim, so HF's (B, L, H, D)-transposed layout costs no copy) and the input dtype as a small code
// that one function switches on, calling the kernel's template for that dtype.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <tuple>
#include <vector>

#include "../checks.h"

namespace bert_cluster {

// at::empty and at::zeros (tensors.cpp): the kernels' only factory calls.
at::Tensor empty_tensor(at::IntArrayRef sizes, const at::TensorOptions& options);
at::Tensor zeros_tensor(at::IntArrayRef sizes, const at::TensorOptions& options);

// An allocator on cache lines (64 bytes), for the kernels' scratch: a 16-float vector read at a multiple
// of 16 floats from it never straddles two lines, as in torch's own 64-byte aligned tensors (malloc aligns
// to 16 bytes only: a bf16 call at 128 tokens that read its widened heads across lines took about 20%
// longer).
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  static constexpr std::align_val_t kAlignment{64};

  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) noexcept {}
  T* allocate(size_t count) { return static_cast<T*>(::operator new(count * sizeof(T), kAlignment)); }
  void deallocate(T* p, size_t) noexcept { ::operator delete(p, kAlignment); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const noexcept {
    return true;
  }
  template <typename U>
  bool operator!=(const CacheLineAllocator<U>&) const noexcept {
    return false;
  }
};

// The kernels' scratch: std::vectors whose data start on a cache line.
using Floats = std::vector<float, CacheLineAllocator<float>>;
using Bytes = std::vector<char, CacheLineAllocator<char>>;

enum class InputType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

inline InputType input_type(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return InputType::kFloat32;
    case at::kBFloat16:
      return InputType::kBFloat16;
    case at::kHalf:
      return InputType::kFloat16;
    default:
      TORCH_CHECK_TYPE(false, "expected float32, float16 or bfloat16, got ", t.scalar_type());
  }
}

// A float input as the attention-dropout kernels (dropout.cpp) read it: float32 and contiguous, an fp16/bf16
// tensor widened once (no copy for one that is so already); other dtypes pass, for the kernels' checks to name.
inline at::Tensor float_rows(const at::Tensor& t) {
  const bool half = t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16;
  return (half ? t.to(at::kFloat) : t).contiguous();
}

// `t` itself when its last dim is contiguous, else a contiguous copy.
inline at::Tensor last_dim_contiguous(const at::Tensor& t) {
  return (t.dim() == 0 || t.size(-1) <= 1 || t.stride(-1) == 1) ? t : t.contiguous();
}

// One (row, head) of a Rows: its row i at base + i * step bytes, with no index arithmetic left per row.
struct HeadRows {
  const char* base = nullptr;
  int64_t step = 0;

  const void* ptr(int64_t i) const { return base + i * step; }
  template <typename T>
  const T* at(int64_t i) const {
    return reinterpret_cast<const T*>(base + i * step);
  }
};

// One (R, H, N, D) tensor read in place: element (r, h, i, d) at data + r*s0 + h*s1 + i*s2 + d.
struct Rows {
  const void* data = nullptr;
  int64_t s0 = 0, s1 = 0, s2 = 0, itemsize = 0;

  static Rows of(const at::Tensor& t) {
    Rows v;
    v.data = t.data_ptr();
    v.s0 = t.stride(0);
    v.s1 = t.stride(1);
    v.s2 = t.stride(2);
    v.itemsize = static_cast<int64_t>(t.element_size());
    return v;
  }
  const void* ptr(int64_t r, int64_t h, int64_t i) const {
    return static_cast<const char*>(data) + (r * s0 + h * s1 + i * s2) * itemsize;
  }
  template <typename T>
  const T* at(int64_t r, int64_t h, int64_t i = 0) const {
    return static_cast<const T*>(data) + r * s0 + h * s1 + i * s2;
  }
  HeadRows head(int64_t r, int64_t h) const { return {static_cast<const char*>(ptr(r, h, 0)), s2 * itemsize}; }
};

// This thread's scratch object of type T built from `args`, kept for its next call with the same args. For
// scratch whose every element the kernel writes before reading it: a reused object needs no clearing.
// clustered_heads runs centroid attention and refinement once per (row, head), and building their
// scratch (tiles, top-k buffers: ~170 KB, zero-filled) each time took half of a call at 128 tokens.
template <typename T, typename... Args>
T& thread_scratch(Args... args) {
  thread_local std::unique_ptr<T> cached;
  thread_local std::tuple<Args...> built;
  const std::tuple<Args...> wanted(args...);
  if (!cached || built != wanted) {
    cached = std::make_unique<T>(args...);
    built = wanted;
  }
  return *cached;
}

// One (row, head) of `src` (n rows of d elements) packed densely into `buf`, as a Rows that resolves every
// (r, h) to that copy; `src` itself when the head's rows are already adjacent. transformers hands q, k and
// v over as views whose rows lie a whole hidden state apart; centroid attention, where every 32 centroids
// scan all of a head's keys and values, packs them first: at 8k tokens (MiniLM, 12 heads x 32) that step
// took ~20% longer on the spread rows, and the copy costs n * d elements per thread where a copy of the
// whole tensors would cost their size again. (The refinement reads each query once and gathers top-k
// rows; packing there did not pay for its copy.)
inline Rows packed_head(const Rows& src, int64_t r, int64_t h, int64_t n, int64_t d, Bytes& buf) {
  if (src.s2 == d) return src;
  const int64_t bytes = d * src.itemsize;
  buf.resize(static_cast<size_t>(n * bytes));
  for (int64_t i = 0; i < n; ++i) std::memcpy(buf.data() + i * bytes, src.ptr(r, h, i), bytes);
  Rows packed = src;
  packed.data = buf.data();
  packed.s0 = packed.s1 = 0;
  packed.s2 = d;
  return packed;
}

// The valid span [first, last + 1) of each row of a (R, N) bool mask ([0, 0) when a row has none): keys
// outside it are padding, so right- and left-padded rows cost their valid length only.
inline void valid_spans(const bool* valid, int64_t rows, int64_t n, int64_t* lo, int64_t* hi) {
  for (int64_t r = 0; r < rows; ++r) {
    const bool* v = valid + r * n;
    int64_t a = 0, b = n;
    while (a < n && !v[a]) ++a;
    while (b > a && !v[b - 1]) --b;
    lo[r] = a;
    hi[r] = b;
  }
}

}  // namespace bert_cluster
