// Portable 16-lane float vectors (GCC/Clang vector extensions) and the helpers the CPU kernels share.
//
// One source for every CPU: with -march=native the compiler lowers a 16-float vector to one AVX-512
// register, to two AVX2 registers or to four NEON registers; no intrinsics, so it builds anywhere.
#pragma once

#include <cstdint>
#include <cstring>

namespace trillm_cpu {

constexpr int W = 16;  // lanes per vector
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
inline vf vsplat(float x) {
  return vf{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
}

inline float vsum(vf v) {
  // Pairwise halving: the compiler turns it into shuffles + adds.
  typedef float v8 __attribute__((vector_size(8 * sizeof(float))));
  typedef float v4 __attribute__((vector_size(4 * sizeof(float))));
  v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

inline float vmaxf(vf v) {
  float m = v[0];
  for (int i = 1; i < W; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

inline vf vmax(vf a, vf b) {
  return a > b ? a : b;
}

// exp(x) for 16 lanes: Cephes' expf (range reduction by ln 2, degree-6 polynomial), ~1 ulp on the range
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

// cap * tanh(s / cap) for 16 lanes (logit soft-capping), as the GPU kernels' SOFTCAP: 1 - 2 / (exp(2y) + 1)
// on y clamped to [-9, 9], where float32 tanh is already +-1.
inline vf vsoftcap(vf s, float cap, float inv_cap) {
  vf y = s * inv_cap;
  y = y < vsplat(-9.0f) ? vsplat(-9.0f) : y;
  y = y > vsplat(9.0f) ? vsplat(9.0f) : y;
  return cap * (1.0f - 2.0f / (vexp(y + y) + 1.0f));
}

// 16 vectors -> one vector of their 16 horizontal sums (lane j = sum of in[j]), by a transpose-add tree:
// 15 shuffle pairs for 16 dot products instead of 16 full horizontal reductions.
inline vf vsum16(const vf* in) {
  vf l1[8];
  for (int i = 0; i < 8; ++i) {
    vf a = in[2 * i], b = in[2 * i + 1];
    l1[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
            __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  vf l2[4];
  for (int i = 0; i < 4; ++i) {
    vf a = l1[2 * i], b = l1[2 * i + 1];
    l2[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
            __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  vf l3[2];
  for (int i = 0; i < 2; ++i) {
    vf a = l2[2 * i], b = l2[2 * i + 1];
    l3[i] = __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
            __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  }
  vf a = l3[0], b = l3[1];
  return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

}  // namespace trillm_cpu
