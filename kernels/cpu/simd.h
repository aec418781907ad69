// Float vectors one hardware register wide (GCC/Clang vector extensions) and the helpers the CPU kernels share.
//
// One source for every CPU, built once per instruction set (kernels/cpu_ext.py picks it from the CPU's
// flags, or TRILLM_CPU_ISA): W, the lanes per vector, is the register's width, 16 floats on AVX-512, 8 on
// AVX2, 4 on NEON and SSE2, so no vector is split over several registers behind the kernels' backs; NREG,
// the vector registers the ISA has, sizes each kernel's register tiles (32 on AVX-512 and NEON, 16 on
// AVX2). No intrinsics, so it builds anywhere.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>

namespace trillm_cpu {

#if defined(__AVX512F__)
constexpr int W = 16;
constexpr int NREG = 32;
#define TRILLM_SIMD "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int W = 8;
constexpr int NREG = 16;
#define TRILLM_SIMD "avx2"
#elif defined(__ARM_NEON) || defined(__aarch64__)
constexpr int W = 4;
constexpr int NREG = 32;
#define TRILLM_SIMD "neon"
#else
constexpr int W = 4;  // SSE2 (every x86-64) or the compiler's scalar lowering elsewhere
constexpr int NREG = 16;
#define TRILLM_SIMD "generic"
#endif

typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));

// A finite stand-in for -inf, as in the GPU kernels: exp(NEG_INF - NEG_INF) stays 1 instead of NaN.
constexpr float NEG_INF = -1.0e30f;

inline vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void vstore(float* p, vf v) {
  std::memcpy(p, &v, sizeof v);
}

// Spelled lane by lane: `vf{} + x` compiles to a scalar add of +0.0 and a register broadcast, two FP uops
// in front of every FMA that uses it; this is one broadcast load (or an FMA's {1to16} operand).
template <size_t... I>
inline vf vsplat_(float x, std::index_sequence<I...>) {
  return vf{((void)I, x)...};
}
inline vf vsplat(float x) {
  return vsplat_(x, std::make_index_sequence<W>{});
}

template <size_t... I>
inline vi viota_(std::index_sequence<I...>) {
  return vi{static_cast<int32_t>(I)...};
}
// 0, 1, ..., W - 1.
inline vi viota() {
  return viota_(std::make_index_sequence<W>{});
}

namespace simd_detail {
template <typename V, size_t... I>
inline auto low_half(V v, std::index_sequence<I...>) {
  return __builtin_shufflevector(v, v, I...);
}
template <typename V, size_t... I>
inline auto high_half(V v, std::index_sequence<I...>) {
  return __builtin_shufflevector(v, v, (I + sizeof...(I))...);
}
// Horizontal sum of N lanes by pairwise halving: the compiler turns it into shuffles + adds.
template <size_t N, typename V>
inline float hsum(V v) {
  if constexpr (N == 1) {
    return v[0];
  } else if constexpr (N == 4) {
    return (v[0] + v[2]) + (v[1] + v[3]);
  } else {
    return hsum<N / 2>(low_half(v, std::make_index_sequence<N / 2>{}) +
                       high_half(v, std::make_index_sequence<N / 2>{}));
  }
}
// One level of the transpose-add tree: of the 2W lanes of (a, b), blocks of 2C; the first C lanes of every
// block (first), or the last C (second).
template <int C, bool SECOND>
constexpr std::array<int, W> tree_lanes() {
  std::array<int, W> out{};
  int o = 0;
  for (int s = 0; s < 2 * W; s += 2 * C) {
    for (int i = 0; i < C; ++i) out[o++] = s + i + (SECOND ? C : 0);
  }
  return out;
}
template <int C, size_t... I>
inline vf tree_add(vf a, vf b, std::index_sequence<I...>) {
  constexpr auto first = tree_lanes<C, false>();
  constexpr auto second = tree_lanes<C, true>();
  return __builtin_shufflevector(a, b, first[I]...) + __builtin_shufflevector(a, b, second[I]...);
}
// One level of the tree per C = W/2, W/4, ..., 1: n vectors become n / 2.
template <int C>
inline void tree_levels(vf* cur, int n) {
  for (int i = 0; i < n / 2; ++i) cur[i] = tree_add<C>(cur[2 * i], cur[2 * i + 1], std::make_index_sequence<W>{});
  if constexpr (C > 1) tree_levels<C / 2>(cur, n / 2);
}
// Lanes (a0, b0, a1, b1, ...) of a and b: the first W (a's first half), or the last W (its second).
template <bool SECOND, size_t... I>
inline vf interleave(vf a, vf b, std::index_sequence<I...>) {
  return __builtin_shufflevector(a, b, static_cast<int>((I % 2) * W + (SECOND ? W / 2 : 0) + I / 2)...);
}
}  // namespace simd_detail


inline float vsum(vf v) {
  return simd_detail::hsum<W>(v);
}

inline float vmaxf(vf v) {
  float m = v[0];
  for (int i = 1; i < W; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

inline vf vmax(vf a, vf b) {
  return a > b ? a : b;
}

// exp(x) for W lanes: Cephes' expf (range reduction by ln 2, degree-6 polynomial), ~1 ulp on the range
// softmax uses; inputs below -87.3 (masked logits) clamp to ~1e-38 and callers zero them explicitly.
inline vf vexp(vf x) {
  x = x < vsplat(-87.3f) ? vsplat(-87.3f) : x;
  x = x > vsplat(88.3f) ? vsplat(88.3f) : x;
  const vf magic = vsplat(12582912.0f);  // 1.5 * 2^23: adding and subtracting it rounds to nearest
  vf n = (x * 1.44269504088896341f + magic) - magic;
  vf r = x - n * 0.693359375f - n * -2.12194440e-4f;
  vf p = vsplat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  vi bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += __builtin_convertvector(n, vi) << 23;
  std::memcpy(&p, &bits, sizeof p);
  return p;
}

// cap * tanh(s / cap) for W lanes (logit soft-capping), as the GPU kernels' SOFTCAP: 1 - 2 / (exp(2y) + 1)
// on y clamped to [-9, 9], where float32 tanh is already +-1.
inline vf vsoftcap(vf s, float cap, float inv_cap) {
  vf y = s * inv_cap;
  y = y < vsplat(-9.0f) ? vsplat(-9.0f) : y;
  y = y > vsplat(9.0f) ? vsplat(9.0f) : y;
  return cap * (1.0f - 2.0f / (vexp(y + y) + 1.0f));
}

// W bytes of two 4-bit values each -> their 2W values as floats, in element order (element 2i is byte i's
// low nibble, 2i + 1 its high one): first gets elements 0..W-1, second W..2W-1.
inline void vnibbles(const uint8_t* p, vf& first, vf& second) {
  typedef uint8_t vb __attribute__((vector_size(W)));
  vb bytes;
  std::memcpy(&bytes, p, sizeof bytes);
  const vi x = __builtin_convertvector(bytes, vi);
  const vf lo = __builtin_convertvector(x & 15, vf);
  const vf hi = __builtin_convertvector(x >> 4, vf);
  first = simd_detail::interleave<false>(lo, hi, std::make_index_sequence<W>{});
  second = simd_detail::interleave<true>(lo, hi, std::make_index_sequence<W>{});
}

// W vectors -> one vector of their W horizontal sums (lane j = sum of in[j]), by a transpose-add tree:
// W - 1 shuffle pairs for W dot products instead of W full horizontal reductions.
inline vf vsum_lanes(const vf* in) {
  vf cur[W];
  for (int i = 0; i < W; ++i) cur[i] = in[i];
  simd_detail::tree_levels<W / 2>(cur, W);
  return cur[0];
}

}  // namespace trillm_cpu
