// Small float loops written so that GCC vectorises them (-O3), and a polynomial exp that vectorises too
// (std::exp does not without -ffast-math). Hot functions that use them carry BC_MULTIVERSION, which
// compiles one clone per ISA level (x86-64-v4 = AVX-512, v3 = AVX2+FMA, baseline) and picks one at load time, so the wheel
// stays portable without -march=native.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

// ISA levels, not CPU models: "arch=skylake-avx512" would be chosen by CPU model (__builtin_cpu_is) and so
// never on an AMD EPYC with AVX-512; "arch=x86-64-v4" is chosen by features (GCC >= 12).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(BERT_CLUSTER_NO_MULTIVERSION) && \
    __GNUC__ >= 12
#define BC_MULTIVERSION __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#elif defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(BERT_CLUSTER_NO_MULTIVERSION)
#define BC_MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define BC_MULTIVERSION
#endif

// Helpers are force-inlined so that they compile with the ISA of the BC_MULTIVERSION clone calling them
// (a plain `inline` function may stay out of line, compiled for the baseline ISA).
#define BC_INLINE __attribute__((always_inline)) inline

namespace bert_cluster {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// e^x for x <= 0 (softmax arguments after subtracting the max), relative error ~2e-7 (Cephes expf
// polynomial); returns ~1e-38 instead of 0 below -87, which is far below fp32 softmax resolution.
BC_INLINE float fast_exp(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, sizeof(scale));
  return y * scale;
}

// Dot product with 16 independent partial sums (vectorisable without reassociation flags).
BC_INLINE float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc[16] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int j = 0; j < 16; ++j) acc[j] += a[i + j] * b[i + j];
  }
  float s = 0.f;
  for (int j = 0; j < 16; ++j) s += acc[j];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// GCC vector extension: 16 floats, lowered to the widest registers of each BC_MULTIVERSION clone
// (one AVX-512 register, two AVX2 ones, four SSE ones).
typedef float f32x16 __attribute__((vector_size(16 * sizeof(float))));

BC_INLINE f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

BC_INLINE void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof(v)); }

typedef int32_t i32x16 __attribute__((vector_size(16 * sizeof(int32_t))));

// fast_exp on 16 lanes at once (the same steps; floor by truncation and a correction).
BC_INLINE f32x16 fast_exp16(f32x16 x) {
  const f32x16 zero = {};
  const f32x16 lo = zero - 87.0f, hi = zero + 88.0f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const f32x16 t = x * 1.44269504088896341f + 0.5f;
  i32x16 i = __builtin_convertvector(t, i32x16);
  i += (__builtin_convertvector(i, f32x16) > t);  // truncation rounds up below 0: subtract 1 (mask is -1)
  const f32x16 n = __builtin_convertvector(i, f32x16);
  const f32x16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  f32x16 p = zero + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const f32x16 y = p * r * r + r + 1.0f;
  const i32x16 e = (i + 127) << 23;
  f32x16 scale;
  std::memcpy(&scale, &e, sizeof(scale));
  return y * scale;
}

// Max of x[0..n) (n >= 1), in 16 lanes then across them (a plain float max loop does not vectorise).
BC_INLINE float max_of(const float* __restrict x, int64_t n) {
  float m = x[0];
  int64_t i = 0;
  if (n >= 16) {
    f32x16 acc = load16(x);
    for (i = 16; i + 16 <= n; i += 16) {
      const f32x16 y = load16(x + i);
      acc = acc > y ? acc : y;
    }
    for (int j = 0; j < 16; ++j) m = std::max(m, acc[j]);
  }
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

// x[i] = e^(x[i] - shift), then the sum of the results (exp and sum in separate loops, both vectorised).
BC_INLINE float exp_shift_sum(float* __restrict x, int64_t n, float shift) {
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) store16(x + k, fast_exp16(load16(x + k) - shift));
  for (; k < n; ++k) x[k] = fast_exp(x[k] - shift);
  f32x16 acc = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc += load16(x + i);
  float s = 0.f;
  for (int j = 0; j < 16; ++j) s += acc[j];
  for (; i < n; ++i) s += x[i];
  return s;
}

// out += w * x
BC_INLINE void axpy(float* __restrict out, const float* __restrict x, float w, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] += w * x[i];
}

}  // namespace bert_cluster
