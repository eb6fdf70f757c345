// The kernels' 64-byte vectors (f32x16, i32x16, u32x16, u64x8, i64x8, u8x64): the same lanes on every ISA.
//
// The kernels are written with GCC vector extensions on 64-byte types. Where the ISA has 64-byte registers
// (AVX-512) each type is one native vector. Where its registers are narrower, GCC keeps an oversized
// generic vector in memory (every variable a stack slot, every lane read a store and a reload: the AVX2
// build of the kernels ran 12-24x slower than the AVX-512 one), so there each type is a `Wide`: a struct of
// native-width parts with the same operators, which GCC keeps in registers. The kernels use `select`,
// `bitcast` and `convert` where GCC's syntax has no operator to overload (`m ? a : b`, casts,
// __builtin_convertvector). Lanes, operations and their order are the same on every ISA, and so are the
// results, bit for bit.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

// Helpers are force-inlined into the kernels that call them.
#define BC_INLINE __attribute__((always_inline)) inline

namespace bert_cluster {

// Bytes of the widest vector register this compilation targets.
#if defined(__AVX512F__)
#define BC_NATIVE_BYTES 64
#elif defined(__AVX__)
#define BC_NATIVE_BYTES 32
#else
#define BC_NATIVE_BYTES 16
#endif
constexpr int kNativeBytes = BC_NATIVE_BYTES;

template <typename T, int Bytes>
struct NativeOf {
  typedef T type __attribute__((vector_size(Bytes)));
};
template <typename T, int Bytes>
using Native = typename NativeOf<T, Bytes>::type;

// The signed integer of a lane's size: what a comparison gives per lane (-1 true, 0 false).
template <typename T>
using LaneInt = std::conditional_t<
    sizeof(T) == 8, int64_t,
    std::conditional_t<sizeof(T) == 4, int32_t, std::conditional_t<sizeof(T) == 2, int16_t, int8_t>>>;

// N lanes of T in native-width parts.
template <typename T, int N>
struct Wide {
  static constexpr int kPartLanes = kNativeBytes / static_cast<int>(sizeof(T));
  static constexpr int kParts = N / kPartLanes;
  static_assert(kParts >= 2 && N % kPartLanes == 0);
  using Part = Native<T, kNativeBytes>;
  Part p[kParts];

  BC_INLINE T operator[](int i) const { return p[i / kPartLanes][i % kPartLanes]; }
  // GCC lets a vector's memory be accessed as its element type.
  BC_INLINE T& operator[](int i) { return reinterpret_cast<T*>(p)[i]; }
};

template <typename V>
struct IsWide : std::false_type {};
template <typename T, int N>
struct IsWide<Wide<T, N>> : std::true_type {};
template <typename V>
constexpr bool kIsWide = IsWide<V>::value;

// N lanes of T: a native vector where it fits a register, else a Wide.
template <typename T, int N>
using Vec = std::conditional_t<(N * static_cast<int>(sizeof(T)) <= kNativeBytes), Native<T, N * sizeof(T)>, Wide<T, N>>;

typedef Vec<float, 16> f32x16;
typedef Vec<int32_t, 16> i32x16;
typedef Vec<uint32_t, 16> u32x16;
typedef Vec<uint64_t, 8> u64x8;
typedef Vec<int64_t, 8> i64x8;
typedef Vec<uint8_t, 64> u8x64;
typedef Vec<uint8_t, 16> u8x16;

template <typename V>
constexpr int lanes_of() {
  if constexpr (kIsWide<V>) {
    return V::kParts * V::kPartLanes;
  } else {
    return static_cast<int>(sizeof(V) / sizeof(V{}[0]));
  }
}

// --- Wide operators: part by part, exactly as a native vector computes each lane ---------------------

#define BC_WIDE_BINARY(OP)                                                                              \
  template <typename T, int N>                                                                          \
  BC_INLINE Wide<T, N> operator OP(Wide<T, N> a, const Wide<T, N>& b) {                                 \
    for (int k = 0; k < Wide<T, N>::kParts; ++k) a.p[k] = a.p[k] OP b.p[k];                             \
    return a;                                                                                           \
  }                                                                                                     \
  template <typename T, int N, typename S, typename = std::enable_if_t<std::is_arithmetic_v<S>>>        \
  BC_INLINE Wide<T, N> operator OP(Wide<T, N> a, S b) {                                                 \
    for (int k = 0; k < Wide<T, N>::kParts; ++k) a.p[k] = a.p[k] OP static_cast<T>(b);                  \
    return a;                                                                                           \
  }                                                                                                     \
  template <typename T, int N, typename S, typename = std::enable_if_t<std::is_arithmetic_v<S>>>        \
  BC_INLINE Wide<T, N> operator OP(S a, Wide<T, N> b) {                                                 \
    for (int k = 0; k < Wide<T, N>::kParts; ++k) b.p[k] = static_cast<T>(a) OP b.p[k];                  \
    return b;                                                                                           \
  }                                                                                                     \
  template <typename T, int N, typename B>                                                              \
  BC_INLINE Wide<T, N>& operator OP##=(Wide<T, N>& a, const B& b) {                                     \
    a = a OP b;                                                                                         \
    return a;                                                                                           \
  }

BC_WIDE_BINARY(+)
BC_WIDE_BINARY(-)
BC_WIDE_BINARY(*)
BC_WIDE_BINARY(/)
BC_WIDE_BINARY(&)
BC_WIDE_BINARY(|)
BC_WIDE_BINARY(^)
BC_WIDE_BINARY(<<)
BC_WIDE_BINARY(>>)
#undef BC_WIDE_BINARY

#define BC_WIDE_COMPARE(OP)                                                                             \
  template <typename T, int N>                                                                          \
  BC_INLINE Wide<LaneInt<T>, N> operator OP(const Wide<T, N>& a, const Wide<T, N>& b) {                 \
    Wide<LaneInt<T>, N> r;                                                                              \
    for (int k = 0; k < Wide<T, N>::kParts; ++k) r.p[k] = a.p[k] OP b.p[k];                             \
    return r;                                                                                           \
  }                                                                                                     \
  template <typename T, int N, typename S, typename = std::enable_if_t<std::is_arithmetic_v<S>>>        \
  BC_INLINE Wide<LaneInt<T>, N> operator OP(const Wide<T, N>& a, S b) {                                 \
    Wide<LaneInt<T>, N> r;                                                                              \
    for (int k = 0; k < Wide<T, N>::kParts; ++k) r.p[k] = a.p[k] OP static_cast<T>(b);                  \
    return r;                                                                                           \
  }                                                                                                     \
  template <typename T, int N, typename S, typename = std::enable_if_t<std::is_arithmetic_v<S>>>        \
  BC_INLINE Wide<LaneInt<T>, N> operator OP(S a, const Wide<T, N>& b) {                                 \
    Wide<LaneInt<T>, N> r;                                                                              \
    for (int k = 0; k < Wide<T, N>::kParts; ++k) r.p[k] = static_cast<T>(a) OP b.p[k];                  \
    return r;                                                                                           \
  }

BC_WIDE_COMPARE(<)
BC_WIDE_COMPARE(>)
BC_WIDE_COMPARE(<=)
BC_WIDE_COMPARE(>=)
BC_WIDE_COMPARE(==)
BC_WIDE_COMPARE(!=)
#undef BC_WIDE_COMPARE

template <typename T, int N>
BC_INLINE Wide<T, N> operator-(Wide<T, N> a) {
  for (int k = 0; k < Wide<T, N>::kParts; ++k) a.p[k] = -a.p[k];
  return a;
}
template <typename T, int N>
BC_INLINE Wide<T, N> operator~(Wide<T, N> a) {
  for (int k = 0; k < Wide<T, N>::kParts; ++k) a.p[k] = ~a.p[k];
  return a;
}

// --- the same on native vectors and Wides -----------------------------------------------------------

// mask ? a : b, lane by lane (mask: a comparison result, -1 / 0 per lane of a's size).
template <typename M, typename V>
BC_INLINE V select(const M& mask, V a, const V& b) {
  if constexpr (kIsWide<V>) {
    for (int k = 0; k < V::kParts; ++k) a.p[k] = mask.p[k] ? a.p[k] : b.p[k];
    return a;
  } else {
    return mask ? a : b;
  }
}

// A vector's bytes read from / written to memory (part by part for a Wide: a memcpy of the whole struct
// went through a stack copy).
template <typename V>
BC_INLINE V load_vec(const void* p) {
  V v;
  if constexpr (kIsWide<V>) {
    for (int k = 0; k < V::kParts; ++k)
      std::memcpy(&v.p[k], static_cast<const char*>(p) + k * kNativeBytes, sizeof(v.p[k]));
  } else {
    std::memcpy(&v, p, sizeof(v));
  }
  return v;
}

template <typename V>
BC_INLINE void store_vec(void* p, const V& v) {
  if constexpr (kIsWide<V>) {
    for (int k = 0; k < V::kParts; ++k) std::memcpy(static_cast<char*>(p) + k * kNativeBytes, &v.p[k], sizeof(v.p[k]));
  } else {
    std::memcpy(p, &v, sizeof(v));
  }
}

// The same bytes as another type of the same size.
template <typename To, typename From>
BC_INLINE To bitcast(const From& x) {
  static_assert(sizeof(To) == sizeof(From));
  if constexpr (kIsWide<To> && kIsWide<From>) {
    To r;
    for (int k = 0; k < To::kParts; ++k) r.p[k] = reinterpret_cast<typename To::Part>(x.p[k]);
    return r;
  } else {
    return load_vec<To>(&x);
  }
}

// Lane i converted to To's lane type, as __builtin_convertvector.
template <typename To, typename From>
BC_INLINE To convert(const From& x) {
  static_assert(lanes_of<To>() == lanes_of<From>());
  if constexpr (!kIsWide<To> && !kIsWide<From>) {
    return __builtin_convertvector(x, To);
  } else if constexpr (kIsWide<To> && kIsWide<From>) {
    if constexpr (To::kParts == From::kParts) {
      To r;
      for (int k = 0; k < To::kParts; ++k) r.p[k] = __builtin_convertvector(x.p[k], typename To::Part);
      return r;
    } else {
      To r;
      for (int i = 0; i < lanes_of<To>(); ++i) r[i] = static_cast<std::remove_reference_t<decltype(r[0])>>(x[i]);
      return r;
    }
  } else {
    To r;
    for (int i = 0; i < lanes_of<To>(); ++i) r[i] = static_cast<std::remove_reference_t<decltype(r[0])>>(x[i]);
    return r;
  }
}

}  // namespace bert_cluster
