// Small float loops written so that GCC vectorises them (-O3), and a polynomial exp that vectorises too
// (std::exp does not without -ffast-math), on the 64-byte vectors of simd.h. The kernels are compiled once
// per ISA level (x86-64-v4 = AVX-512, v3 = AVX2+FMA, baseline), each into its own library, of which
// bert_cluster._loader loads the best this CPU runs: the wheel stays portable without -march=native.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "simd.h"

// Code written with AVX-512 intrinsics, where this compilation targets AVX-512 (the x86-64-v4 library);
// each such kernel keeps a portable twin that gives the same result.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define BC_HAVE_AVX512 1
#endif

namespace bert_cluster {

#ifdef BC_HAVE_AVX512
// Whether this CPU runs the AVX-512 code: the library that has it is loaded only on such a CPU.
constexpr bool has_avx512() { return true; }
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

BC_INLINE f32x16 load16(const float* p) { return load_vec<f32x16>(p); }

BC_INLINE void store16(float* p, f32x16 v) { store_vec(p, v); }

// fast_exp on 16 lanes at once (the same steps; floor by truncation and a correction).
BC_INLINE f32x16 fast_exp16(f32x16 x) {
  const f32x16 zero = {};
  const f32x16 lo = zero - 87.0f, hi = zero + 88.0f;
  x = select(x < lo, lo, x);
  x = select(x > hi, hi, x);
  const f32x16 t = x * 1.44269504088896341f + 0.5f;
  i32x16 i = convert<i32x16>(t);
  i += (convert<f32x16>(i) > t);  // truncation rounds up below 0: subtract 1 (mask is -1)
  const f32x16 n = convert<f32x16>(i);
  const f32x16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  f32x16 p = zero + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const f32x16 y = p * r * r + r + 1.0f;
  const i32x16 e = (i + 127) << 23;
  return y * bitcast<f32x16>(e);
}

// Max of x[0..n) (n >= 1), in 16 lanes then across them (a plain float max loop does not vectorise).
BC_INLINE float max_of(const float* __restrict x, int64_t n) {
  float m = x[0];
  int64_t i = 0;
  if (n >= 16) {
    f32x16 acc = load16(x);
    for (i = 16; i + 16 <= n; i += 16) {
      const f32x16 y = load16(x + i);
      acc = select(acc > y, acc, y);
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
// conversion, F16C / AVX-512 in the v3 / v4 libraries) or one at a time.

// 16 bf16 / fp16 values widened to float32, a register's worth at a time.
template <typename T, typename Widen>
BC_INLINE f32x16 load16_parts(const T* p, Widen widen_part) {
#if BC_NATIVE_BYTES < 64
  f32x16 f;
  for (int k = 0; k < f32x16::kParts; ++k) f.p[k] = widen_part(p + k * f32x16::kPartLanes);
  return f;
#else
  return widen_part(p);
#endif
}

BC_INLINE f32x16 load16(const c10::BFloat16* p) {
  constexpr int lanes = kIsWide<f32x16> ? kNativeBytes / 4 : 16;
  return load16_parts(p, [](const c10::BFloat16* q) {
    Native<uint16_t, 2 * lanes> h;
    std::memcpy(&h, q, sizeof(h));
    const Native<uint32_t, 4 * lanes> w = __builtin_convertvector(h, Native<uint32_t, 4 * lanes>) << 16;
    return bitcast<Native<float, 4 * lanes>>(w);
  });
}

BC_INLINE f32x16 load16(const c10::Half* p) {
  constexpr int lanes = kIsWide<f32x16> ? kNativeBytes / 4 : 16;
  return load16_parts(p, [](const c10::Half* q) {
    Native<_Float16, 2 * lanes> h;
    std::memcpy(&h, q, sizeof(h));
    return __builtin_convertvector(h, Native<float, 4 * lanes>);
  });
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
  return load_vec<i32x16>(kTable + 16 - n);
}

// The lanes of a comparison result (-1 / 0 per lane) as a 16-bit mask, lane i -> bit i.
BC_INLINE uint32_t lane_bits(i32x16 mask) {
#if defined(__AVX512DQ__)
  return static_cast<uint16_t>(_mm512_movepi32_mask(reinterpret_cast<__m512i>(mask)));
#elif defined(__AVX__)
  uint32_t bits = 0;
  for (int k = 0; k < i32x16::kParts; ++k)
    bits |= static_cast<uint32_t>(_mm256_movemask_ps(reinterpret_cast<__m256>(mask.p[k]))) << (8 * k);
  return bits;
#elif defined(__SSE2__)
  uint32_t bits = 0;
  for (int k = 0; k < i32x16::kParts; ++k)
    bits |= static_cast<uint32_t>(_mm_movemask_ps(reinterpret_cast<__m128>(mask.p[k]))) << (4 * k);
  return bits;
#else
  uint32_t bits = 0;
  for (int i = 0; i < 16; ++i) bits |= static_cast<uint32_t>(mask[i] & 1) << i;
  return bits;
#endif
}

// Two comparison results as a 32-bit mask, lanes of `low` -> bits 0..15, lanes of `high` -> bits 16..31.
BC_INLINE uint32_t lane_bits2(i32x16 low, i32x16 high) { return lane_bits(low) | (lane_bits(high) << 16); }

// Lane i combined with lane i + 8 (the first step of the reductions below), in the low 8 lanes.
template <typename Combine>
BC_INLINE f32x16 fold_halves(f32x16 v, Combine combine) {
#if BC_NATIVE_BYTES < 64
  constexpr int half = f32x16::kParts / 2;
  for (int k = 0; k < half; ++k) v.p[k] = combine(v.p[k], v.p[k + half]);
  return v;
#else
  return combine(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
#endif
}

BC_INLINE float hmax(f32x16 v) {
  v = fold_halves(v, [](auto a, auto b) { return a > b ? a : b; });
  float m = v[0];
  for (int j = 1; j < 8; ++j) m = v[j] > m ? v[j] : m;
  return m;
}

// Sum of the 16 lanes in a fixed order (so a result never depends on how a loop was split, or on the ISA):
// lane i + lane i + 8, then + 4, + 2, + 1.
BC_INLINE float hsum(f32x16 v) {
#if BC_NATIVE_BYTES < 64
  {
    constexpr int lanes = f32x16::kPartLanes;
    using Part = f32x16::Part;
    Part p[f32x16::kParts];
    for (int k = 0; k < f32x16::kParts; ++k) p[k] = v.p[k];
    int parts = f32x16::kParts;
    for (; parts > 1; parts /= 2)  // strides of a part or more: whole parts
      for (int k = 0; k < parts / 2; ++k) p[k] = p[k] + p[k + parts / 2];
    Part x = p[0];
#if BC_NATIVE_BYTES == 32
    static_assert(lanes == 8);
    x += __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3);
    x += __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5);
    x += __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6);
#else
    static_assert(lanes == 4);
    x += __builtin_shufflevector(x, x, 2, 3, 0, 1);
    x += __builtin_shufflevector(x, x, 1, 0, 3, 2);
#endif
    return x[0];
  }
#else
  {
    v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return v[0];
  }
#endif
}

// Lane L of the result = hsum(a[L]), bit for bit, for 16 vectors at once: the additions of hsum's tree
// (strides 8, 4, 2, 1) on pairs of vectors, with the shuffles that also transpose (with AVX-512 30
// two-source shuffles, against 64 for a transpose alone and 16 hsums' 64). The inputs enter in the order
// that leaves the sums in lane order: bit-reversed with 16 lanes, (0, 4, 1, 5, 2, 6, 3, 7) per 8.
#if BC_NATIVE_BYTES == 32
// With AVX2, input L (of 8) enters lane_sums8 in slot kLaneSlot[L].
constexpr int kLaneSlot[8] = {0, 2, 4, 6, 1, 3, 5, 7};

// lane_sums' levels after the first for 8 inputs: x[kLaneSlot[L]] holds input L's two halves added (hsum's
// stride 8); lane L of the result is input L's hsum.
BC_INLINE f32x16::Part lane_sums8(const f32x16::Part* x) {
  using Part = f32x16::Part;
  Part r[4], s[2];
  for (int i = 0; i < 4; ++i)  // stride 4: lanes 0-3 slot 2i, 4-7 slot 2i + 1
    r[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(x[2 * i], x[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)  // stride 2: pairs of lanes, slots 4i, 4i + 2, 4i + 1, 4i + 3
    s[i] = __builtin_shufflevector(r[2 * i], r[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(r[2 * i], r[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  // stride 1: slots 0, 2, 4, 6, 1, 3, 5, 7
  return __builtin_shufflevector(s[0], s[1], 0, 2, 8, 10, 4, 6, 12, 14) +
         __builtin_shufflevector(s[0], s[1], 1, 3, 9, 11, 5, 7, 13, 15);
}
#endif

BC_INLINE f32x16 lane_sums(const f32x16* a) {
#if BC_NATIVE_BYTES == 32
  {
    f32x16 out;
    for (int g = 0; g < 2; ++g) {
      f32x16::Part x[8];
      for (int l = 0; l < 8; ++l) x[kLaneSlot[l]] = a[8 * g + l].p[0] + a[8 * g + l].p[1];  // stride 8
      out.p[g] = lane_sums8(x);
    }
    return out;
  }
#elif BC_NATIVE_BYTES < 64
  {
    alignas(64) float sums[16];
    for (int l = 0; l < 16; ++l) sums[l] = hsum(a[l]);
    return load16(sums);
  }
#else
  {
    constexpr int kReversed[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
    f32x16 b[8], c[4], d[2];
    for (int i = 0; i < 8; ++i) {  // stride 8: lanes 0-7 slot 2i, 8-15 slot 2i + 1
      const f32x16 x = a[kReversed[2 * i]], y = a[kReversed[2 * i + 1]];
      b[i] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
             __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    }
    for (int i = 0; i < 4; ++i)  // stride 4: quads, slots 4i, 4i + 2, 4i + 1, 4i + 3
      c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
             __builtin_shufflevector(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int i = 0; i < 2; ++i)  // stride 2: pairs
      d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
             __builtin_shufflevector(c[2 * i], c[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    // stride 1: lane L holds slot kReversed[L], which is input L
    return __builtin_shufflevector(d[0], d[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
           __builtin_shufflevector(d[0], d[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  }
#endif
}

// out[m] = hsum(a[m]) for m < M (M <= 16), bit for bit: from 4 vectors on in one lane_sums (its shuffles
// also transpose, and the M sums run side by side instead of as M chains of dependent reductions).
template <int M>
BC_INLINE void hsums(const f32x16* a, float* out) {
  static_assert(M >= 1 && M <= 16);
  if constexpr (M < 4) {
    for (int m = 0; m < M; ++m) out[m] = hsum(a[m]);
  } else {
    f32x16 x[16];
    for (int m = 0; m < 16; ++m) x[m] = m < M ? a[m] : f32x16{};
    alignas(64) float sums[16];
    store16(sums, lane_sums(x));
    for (int m = 0; m < M; ++m) out[m] = sums[m];
  }
}

// a[0] + ... + a[15] lane by lane, in hsum's order (pairs 8 apart, then 4, 2, 1): what 16 hsums of the
// transposed vectors give, with 15 additions and no shuffle.
BC_INLINE f32x16 tree_sum16(const f32x16* a) {
  f32x16 b[8];
  for (int l = 0; l < 8; ++l) b[l] = a[l] + a[l + 8];
  for (int l = 0; l < 4; ++l) b[l] = b[l] + b[l + 4];
  for (int l = 0; l < 2; ++l) b[l] = b[l] + b[l + 2];
  return b[0] + b[1];
}

// In-place transpose of a 16 x 16 block held in 16 vectors (r[i][j] -> r[j][i]): on AVX-512 4 rounds of
// 16 two-source shuffles (one vpermt2ps each); with AVX2 four 8 x 8 blocks of 24 shuffles each (through
// memory it took 5.6% of i-clustered+ at 512 tokens); elsewhere through memory.
BC_INLINE void transpose16(f32x16* r) {
#if BC_NATIVE_BYTES == 32
  {
    using Part = f32x16::Part;
    Part block[2][2][8];  // [row half][column half][row]: 8 x 8 blocks, transposed in place
    for (int i = 0; i < 16; ++i)
      for (int h = 0; h < 2; ++h) block[i / 8][h][i % 8] = r[i].p[h];
    for (int bi = 0; bi < 2; ++bi)
      for (int bj = 0; bj < 2; ++bj) {
        Part* x = block[bi][bj];
        Part t[8], u[8];
        for (int i = 0; i < 8; i += 2) {  // interleave pairs of rows
          t[i] = __builtin_shufflevector(x[i], x[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
          t[i + 1] = __builtin_shufflevector(x[i], x[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
        }
        for (int i = 0; i < 8; i += 4)  // pairs of elements of 4 rows
          for (int j = 0; j < 2; ++j) {
            u[i + 2 * j] = __builtin_shufflevector(t[i + j], t[i + j + 2], 0, 1, 8, 9, 4, 5, 12, 13);
            u[i + 2 * j + 1] = __builtin_shufflevector(t[i + j], t[i + j + 2], 2, 3, 10, 11, 6, 7, 14, 15);
          }
        for (int j = 0; j < 4; ++j) {  // 128-bit halves
          x[j] = __builtin_shufflevector(u[j], u[j + 4], 0, 1, 2, 3, 8, 9, 10, 11);
          x[j + 4] = __builtin_shufflevector(u[j], u[j + 4], 4, 5, 6, 7, 12, 13, 14, 15);
        }
      }
    for (int j = 0; j < 16; ++j)  // row j of the result: column j, from the blocks of its column half
      for (int h = 0; h < 2; ++h) r[j].p[h] = block[h][j / 8][j % 8];
  }
#elif BC_NATIVE_BYTES < 64
  {
    float block[16][16];
    std::memcpy(block, r, sizeof(block));
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 16; ++j) r[j][i] = block[i][j];
  }
#else
  {
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
#endif
}

// Float <-> totally ordered integer keys: a < b as floats (no NaN) iff key(a) < key(b) as signed int32.
BC_INLINE int32_t order_key(float x) {
  int32_t b;
  std::memcpy(&b, &x, sizeof(b));
  return b ^ ((b >> 31) & 0x7FFFFFFF);
}
BC_INLINE i32x16 order_key16(f32x16 x) {
  const i32x16 b = bitcast<i32x16>(x);
  return b ^ ((b >> 31) & 0x7FFFFFFF);
}
BC_INLINE float from_order_key(int32_t k) {
  const int32_t b = k ^ ((k >> 31) & 0x7FFFFFFF);
  float x;
  std::memcpy(&x, &b, sizeof(x));
  return x;
}

}  // namespace bert_cluster
