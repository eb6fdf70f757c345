// Small float loops written so that GCC vectorises them (-O3), and a polynomial exp that vectorises too
// (std::exp does not without -ffast-math). Hot functions that use them carry BC_MULTIVERSION, which
// compiles one clone per ISA level (x86-64-v4 = AVX-512, v3 = AVX2+FMA, baseline) and picks one at load time, so the wheel
// stays portable without -march=native.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

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

// Code written with AVX-512 intrinsics, where the compiler can build it: compiled for x86-64-v4 (in a
// portable build; a single-ISA build takes it only when that ISA has AVX-512) and called only on a CPU that
// has it (has_avx512()); each such kernel keeps a portable twin that gives the same result.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && __GNUC__ >= 12 && \
    (!defined(BERT_CLUSTER_NO_MULTIVERSION) || (defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)))
#define BC_HAVE_AVX512 1
#if defined(BERT_CLUSTER_NO_MULTIVERSION)
#define BC_AVX512_TARGET
#else
#define BC_AVX512_TARGET __attribute__((target("arch=x86-64-v4")))
#endif
#endif

// Helpers are force-inlined so that they compile with the ISA of the BC_MULTIVERSION clone calling them
// (a plain `inline` function may stay out of line, compiled for the baseline ISA).
#define BC_INLINE __attribute__((always_inline)) inline

namespace bert_cluster {

#ifdef BC_HAVE_AVX512
// Whether this CPU runs the BC_AVX512_TARGET code (checked once).
inline bool has_avx512() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("x86-64-v4");
  }();
  return has;
}
#endif

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

// ---------------------------------------------------------------------------------------------------
// Input dtypes, widened to float32 in registers: 16 values at a time (bf16: a shift; fp16: the ISA's
// conversion, F16C / AVX-512 in the v3 / v4 clones) or one at a time.

typedef uint16_t u16x16 __attribute__((vector_size(16 * sizeof(uint16_t))));
typedef uint32_t u32x16 __attribute__((vector_size(16 * sizeof(uint32_t))));
typedef _Float16 f16x16 __attribute__((vector_size(16 * sizeof(_Float16))));

BC_INLINE f32x16 load16(const c10::BFloat16* p) {
  u16x16 h;
  std::memcpy(&h, p, sizeof(h));
  const u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  f32x16 f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
}

BC_INLINE f32x16 load16(const c10::Half* p) {
  f16x16 h;
  std::memcpy(&h, p, sizeof(h));
  return __builtin_convertvector(h, f32x16);
}

BC_INLINE float to_float(float x) { return x; }
BC_INLINE float to_float(c10::BFloat16 x) {
  const uint32_t w = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
}
BC_INLINE float to_float(c10::Half x) {
  _Float16 h;
  std::memcpy(&h, &x.x, sizeof(h));
  return static_cast<float>(h);
}

// dst[0..n) = src[0..n) as float32 (n need not be a multiple of 16).
template <typename T>
BC_INLINE void widen(const T* __restrict src, float* __restrict dst, int64_t n) {
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  } else {
    for (; i + 16 <= n; i += 16) store16(dst + i, load16(src + i));
    for (; i < n; ++i) dst[i] = to_float(src[i]);
  }
}

// -1 in the first n lanes (n clamped to 0..16), 0 in the others, read from a table: GCC turns a compare of
// a constant lane-number vector with a scalar into 16 scalar compares, which dominated the loops using it.
BC_INLINE i32x16 first_lanes(int64_t n) {
  alignas(64) static const int32_t kTable[32] = {-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                 0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0};
  n = n < 0 ? 0 : (n > 16 ? 16 : n);
  i32x16 m;
  std::memcpy(&m, kTable + 16 - n, sizeof(m));
  return m;
}

// The lanes of a comparison result (-1 / 0 per lane) as a 16-bit mask, lane i -> bit i.
BC_INLINE uint32_t lane_bits(i32x16 mask) {
  const i32x16 bit = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768};
  i32x16 t = mask & bit;
  t |= __builtin_shufflevector(t, t, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  t |= __builtin_shufflevector(t, t, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  t |= __builtin_shufflevector(t, t, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  t |= __builtin_shufflevector(t, t, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return static_cast<uint32_t>(t[0]);
}

// Two comparison results as a 32-bit mask, lanes of `low` -> bits 0..15, lanes of `high` -> bits 16..31
// (one reduction for both).
BC_INLINE uint32_t lane_bits2(i32x16 low, i32x16 high) {
  const i32x16 bit = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768};
  i32x16 t = (low & bit) | (high & (bit << 16));
  t |= __builtin_shufflevector(t, t, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  t |= __builtin_shufflevector(t, t, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  t |= __builtin_shufflevector(t, t, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  t |= __builtin_shufflevector(t, t, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return static_cast<uint32_t>(t[0]);
}

BC_INLINE float hmax(f32x16 v) {
  v = v > __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7)
          ? v
          : __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  float m = v[0];
  for (int j = 1; j < 8; ++j) m = v[j] > m ? v[j] : m;
  return m;
}

// Sum of the 16 lanes in a fixed order (so a result never depends on how a loop was split).
BC_INLINE float hsum(f32x16 v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

// In-place transpose of a 16 x 16 block held in 16 vectors (r[i][j] -> r[j][i]): 4 rounds of 16
// two-source shuffles (one vpermt2ps each on AVX-512).
BC_INLINE void transpose16(f32x16* r) {
  f32x16 t[16];
  for (int i = 0; i < 16; i += 2) {  // interleave pairs of rows, element by element
    t[i] = __builtin_shufflevector(r[i], r[i + 1], 0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29);
    t[i + 1] = __builtin_shufflevector(r[i], r[i + 1], 2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31);
  }
  for (int i = 0; i < 16; i += 4) {  // pairs of elements: r[i + e] holds element e (of each 4) of 4 rows
    for (int j = 0; j < 2; ++j) {
      r[i + 2 * j] =
          __builtin_shufflevector(t[i + j], t[i + j + 2], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
      r[i + 2 * j + 1] =
          __builtin_shufflevector(t[i + j], t[i + j + 2], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    }
  }
  for (int i = 0; i < 16; i += 8) {  // quads
    for (int j = 0; j < 4; ++j) {
      t[i + j] = __builtin_shufflevector(r[i + j], r[i + j + 4], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
      t[i + j + 4] =
          __builtin_shufflevector(r[i + j], r[i + j + 4], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    }
  }
  for (int j = 0; j < 8; ++j) {  // octets
    r[j] = __builtin_shufflevector(t[j], t[j + 8], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    r[j + 8] = __builtin_shufflevector(t[j], t[j + 8], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
}

// Float <-> totally ordered integer keys: a < b as floats (no NaN) iff key(a) < key(b) as signed int32.
BC_INLINE int32_t order_key(float x) {
  int32_t b;
  std::memcpy(&b, &x, sizeof(b));
  return b ^ ((b >> 31) & 0x7FFFFFFF);
}
BC_INLINE i32x16 order_key16(f32x16 x) {
  i32x16 b;
  std::memcpy(&b, &x, sizeof(b));
  return b ^ ((b >> 31) & 0x7FFFFFFF);
}
BC_INLINE float from_order_key(int32_t k) {
  const int32_t b = k ^ ((k >> 31) & 0x7FFFFFFF);
  float x;
  std::memcpy(&x, &b, sizeof(x));
  return x;
}

}  // namespace bert_cluster
