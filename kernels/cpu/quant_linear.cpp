// y = x @ dequantize(w).T on weights kept quantized, as an MLX CPU primitive: MLX's affine layout
// (mx.quantize: `bits`-bit unsigned q packed little-endian into uint32 words along K, one scale and one bias
// per group of `group_size` along K, w = scale * q + bias), which GGUF's Q4_0, Q4_1, Q8_0 and Q4_K blocks
// are repacked into exactly (engine/gguf.py) and MLX's own 4- and 8-bit folders are stored in.
//
// Few rows (decode, M <= max_rows): the weight rows are cut into bands taken dynamically by the cores; each
// W-element slice of a weight row is unpacked in registers (nibbles or bytes -> int32 -> float, one FMA with
// its group's scale and bias) and multiplied into tiles of MT x rows by NT weight rows, fp32 accumulation.
// Nothing is written back but y: the weights are streamed from memory once per call at 4.5-9 bits per
// element instead of fp32's 32.
//
// Decode rows on x86 (AVX2 and up; x_bits 16, the default, or 8): integer dot products instead. Each row
// of x is rounded once per call to int16 (or int8, llama.cpp's Q8_0 activations) per block of 32 (d = max|x|
// / 32767 or / 127), and every weight block of 32 meets it in integer dot products: 32 products summed
// into 8 int32 lanes (vpmaddwd, or vpdpwssd with AVX-512 VNNI; int8: vpmaddubsw + vpmaddwd, or vpdpbusd);
// eight weight rows' lanes are summed into one vector (an exact int32 per row and block), then one int ->
// float conversion and one FMA by d_x * scale per block for the eight, instead of an unpack to float and an
// FMA per element, which kept the fp32 path compute-bound on the unpack. Each weight block is unpacked once
// per call for all rows of x (a verify step's 9 rows cost ~3.5x one row, not ~5.5x). With AVX-512 and int16
// x, weight rows are vector lanes instead (lanes_int: 16 rows transposed as they load, x's pairs broadcast,
// no reduction across lanes; the same float operations, so the same y). The bias term, bias *
// sum of x over the group, takes the rounded x's sums (llama.cpp's Q8_1), so y is exactly dequantize(w) . round(x):
// x's rounding meets w itself, not the larger scale * q. int16's rounding is ~1e-5 of |x| (greedy decode
// stays the fp32 path's); int8's, ~0.3%, moves SmolLM2-135M's greedy tokens. x_bits 32: the fp32 path.
//
// On x86 the integer path takes every row count (prefill chunks in row tiles of 64), so a row's y is the
// same whatever it is batched with; it keeps up with the sgemm path below on prefill. Elsewhere (NEON, the
// generic build) the same arithmetic takes calls of up to max_rows rows (see "the integer path elsewhere").
//
// Many rows elsewhere (or x_bits 32): compute, not memory, bounds the matmul, and BLAS's packed sgemm is far
// ahead of any unpack-in-fp32-registers tile. Blocks of weight rows are dequantized to an fp32 scratch (~4 MB, split
// across the cores) and handed to cblas_sgemm, the BLAS MLX itself links (the same symbol resolves to the
// library MLX uses: OpenBLAS or MKL when trillm loaded one first).
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#define TRILLM_Q8_DOT 1
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif

#ifndef TRILLM_KERNEL_BODIES_ONLY  // tests/kernels/cpu_bodies.cpp compiles the kernel bodies alone, without mlx
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#endif
#include "ops.h"
#include "simd.h"
#include "thread_pool.h"

extern "C" void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float* a,
                            int lda, const float* b, int ldb, float beta, float* c, int ldc);

namespace trillm_cpu {

namespace {

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;  // CBLAS enum values


inline float to_f32(float v) {
  return v;
}
inline float to_f32(mx::float16_t v) {
#if defined(__ARM_FP16_FORMAT_IEEE)
  using half = __fp16;  // aarch64: one fcvt (GCC 12's C++ has no _Float16 there)
#elif defined(__FLT16_MAX__)
  using half = _Float16;  // one vcvtph2ps with F16C (MLX's float16_t converts in software on x86)
#else
  using half = mx::float16_t;
#endif
  half h;
  std::memcpy(&h, &v, sizeof h);
  return static_cast<float>(h);
}
inline float to_f32(mx::bfloat16_t v) {
  uint16_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}

// W consecutive q values starting at byte p (4-bit: W / 2 bytes, element 2i in the low nibble of byte i):
// each lane takes its word broadcast and shifts it by BITS * (lane % values per word), then one mask.
template <int BITS, size_t... L>
inline vf unpack_(const uint8_t* p, std::index_sequence<L...>) {
  constexpr int per = 32 / BITS;
  int32_t u[(W * BITS + 31) / 32] = {};
  std::memcpy(u, p, W * BITS / 8);  // (W = 4 at 4 bits: two bytes, half a word)
  const vi words = {u[L / per]...};
  const vi shifts = {static_cast<int32_t>(BITS * (L % per))...};
  return __builtin_convertvector((words >> shifts) & ((1 << BITS) - 1), vf);  // the mask drops sign bits
}

template <int BITS>
inline vf unpack(const uint8_t* p) {
  return unpack_<BITS>(p, std::make_index_sequence<W>{});
}

template <typename S>
struct QArgs {
  const float* x;  // [M, K]
  const uint8_t* w;  // [N, K * BITS / 8]
  const S* scales;  // [N, K / G]
  const S* biases;
  float* y;  // [M, N]
  int M, N, K, G, bits;
};

// y[MT, NT] (row stride ldy) = x[MT, K] . dequantize(w rows n .. n + NT).
template <int BITS, int MT, int NT, typename S>
inline void qtile(const QArgs<S>& a, int m, int n) {
  const size_t wrow = static_cast<size_t>(a.K) * BITS / 8, grow = a.K / a.G;
  const float* x = a.x + static_cast<size_t>(m) * a.K;
  vf acc[MT * NT];
  for (int i = 0; i < MT * NT; ++i) acc[i] = vf{};
  for (int g = 0; g < a.K / a.G; ++g) {
    vf s[NT], b[NT];
    for (int j = 0; j < NT; ++j) {
      s[j] = vsplat(to_f32(a.scales[(n + j) * grow + g]));
      b[j] = vsplat(to_f32(a.biases[(n + j) * grow + g]));
    }
    for (int k = g * a.G; k < (g + 1) * a.G; k += W) {
      vf wv[NT];
      for (int j = 0; j < NT; ++j) wv[j] = unpack<BITS>(a.w + (n + j) * wrow + k * BITS / 8) * s[j] + b[j];
      for (int i = 0; i < MT; ++i) {
        const vf xv = vload(x + static_cast<size_t>(i) * a.K + k);
        for (int j = 0; j < NT; ++j) acc[i * NT + j] += xv * wv[j];
      }
    }
  }
  float* y = a.y + static_cast<size_t>(m) * a.N + n;
  for (int i = 0; i < MT; ++i) {
    for (int j = 0; j < NT; ++j) y[static_cast<size_t>(i) * a.N + j] = vsum(acc[i * NT + j]);
  }
}

// Tile sizes by vector registers: 32 (AVX-512) hold 4 x 4 accumulators with their 4 weight vectors; 16
// (AVX2, where one 16-float vector is two registers; NEON: four) hold 2 x 2.
#if defined(__AVX512F__)
constexpr int kMT = 4, kNT = 4;
#else
constexpr int kMT = 2, kNT = 2;
#endif

template <int BITS, int MT, typename S>
inline void rows_of_band(const QArgs<S>& a, int m, int n0, int n1) {
  int n = n0;
  for (; n + kNT <= n1; n += kNT) qtile<BITS, MT, kNT>(a, m, n);
  for (; n < n1; ++n) qtile<BITS, MT, 1>(a, m, n);
}

template <int BITS, typename S>
void band(const QArgs<S>& a, int n0, int n1) {
  int m = 0;
  for (; m + kMT <= a.M; m += kMT) rows_of_band<BITS, kMT>(a, m, n0, n1);
  if constexpr (kMT > 2) {
    for (; m + 2 <= a.M; m += 2) rows_of_band<BITS, 2>(a, m, n0, n1);
  }
  for (; m < a.M; ++m) rows_of_band<BITS, 1>(a, m, n0, n1);
}

// Weight rows [n0, n1) dequantized into out[(n - n0) * K + k].
template <int BITS, typename S>
void dequantize_rows(const QArgs<S>& a, int n0, int n1, float* out) {
  const size_t wrow = static_cast<size_t>(a.K) * BITS / 8, grow = a.K / a.G;
  for (int n = n0; n < n1; ++n) {
    float* o = out + static_cast<size_t>(n - n0) * a.K;
    for (int g = 0; g < a.K / a.G; ++g) {
      const vf s = vsplat(to_f32(a.scales[n * grow + g])), b = vsplat(to_f32(a.biases[n * grow + g]));
      for (int k = g * a.G; k < (g + 1) * a.G; k += W) vstore(o + k, unpack<BITS>(a.w + n * wrow + k * BITS / 8) * s + b);
    }
  }
}

// y[MT, NT] (+)= x[MT, k0:k1] . d[NT, 0:k1-k0] (fp32 rows of ldd), accumulated into y unless `first`.
template <int MT, int NT>
inline void ftile(const float* x, int ldx, const float* d, int ldd, float* y, int ldy, int len, bool first) {
  vf acc[MT * NT];
  for (int i = 0; i < MT * NT; ++i) acc[i] = vf{};
  for (int k = 0; k < len; k += W) {
    vf wv[NT];
    for (int j = 0; j < NT; ++j) wv[j] = vload(d + j * ldd + k);
    for (int i = 0; i < MT; ++i) {
      const vf xv = vload(x + static_cast<size_t>(i) * ldx + k);
      for (int j = 0; j < NT; ++j) acc[i * NT + j] += xv * wv[j];
    }
  }
  for (int i = 0; i < MT; ++i) {
    for (int j = 0; j < NT; ++j) {
      float& out = y[static_cast<size_t>(i) * ldy + j];
      out = first ? vsum(acc[i * NT + j]) : out + vsum(acc[i * NT + j]);
    }
  }
}

// Weight rows [n0, n1) dequantized columns [k0, k1) into out[(n - n0) * (k1 - k0) + k - k0].
template <int BITS, typename S>
void dequantize_block(const QArgs<S>& a, int n0, int n1, int k0, int k1, float* out) {
  const size_t wrow = static_cast<size_t>(a.K) * BITS / 8, grow = a.K / a.G;
  const int len = k1 - k0;
  for (int n = n0; n < n1; ++n) {
    float* o = out + static_cast<size_t>(n - n0) * len - k0;
    for (int g = k0 / a.G; g < k1 / a.G; ++g) {
      const vf s = vsplat(to_f32(a.scales[n * grow + g])), b = vsplat(to_f32(a.biases[n * grow + g]));
      for (int k = g * a.G; k < (g + 1) * a.G; k += W) vstore(o + k, unpack<BITS>(a.w + n * wrow + k * BITS / 8) * s + b);
    }
  }
}

// More rows than one register tile holds: each band of 16 weight rows is dequantized once, a chunk of K
// at a time (16 x 1024 floats: 64 KB, in L2), and every row of x is multiplied against it in fp32 tiles.
template <int BITS, typename S>
void mid_band(const QArgs<S>& a, int n0, int n1, float* scratch) {
  const int kc = std::max(a.G, 1024 / a.G * a.G);
  for (int k0 = 0; k0 < a.K; k0 += kc) {
    const int k1 = std::min(a.K, k0 + kc), len = k1 - k0;
    dequantize_block<BITS>(a, n0, n1, k0, k1, scratch);
    const bool first = k0 == 0;
    int m = 0;
    for (; m + kMT <= a.M; m += kMT) {
      int n = n0;
      for (; n + kNT <= n1; n += kNT) {
        ftile<kMT, kNT>(a.x + static_cast<size_t>(m) * a.K + k0, a.K, scratch + (n - n0) * len, len,
                        a.y + static_cast<size_t>(m) * a.N + n, a.N, len, first);
      }
      for (; n < n1; ++n) {
        ftile<kMT, 1>(a.x + static_cast<size_t>(m) * a.K + k0, a.K, scratch + (n - n0) * len, len,
                      a.y + static_cast<size_t>(m) * a.N + n, a.N, len, first);
      }
    }
    for (; m < a.M; ++m) {
      for (int n = n0; n < n1; ++n) {
        ftile<1, 1>(a.x + static_cast<size_t>(m) * a.K + k0, a.K, scratch + (n - n0) * len, len,
                    a.y + static_cast<size_t>(m) * a.N + n, a.N, len, first);
      }
    }
  }
}

template <int BITS, typename S>
void decode_impl(const QArgs<S>& a) {
  auto& pool = ThreadPool::get();
  // Bands of 16 weight rows or more (divisible by the tiles), ~8 per thread so the dynamic split stays
  // even when another process holds a core.
  if (a.M <= kMT) {
    const int rows = std::max(16, (a.N / (8 * pool.size())) / 16 * 16);
    const int bands = (a.N + rows - 1) / rows;
    pool.parallel_for(bands, [&](int i) {
      const int n0 = i * rows;
      band<BITS>(a, n0, std::min(a.N, n0 + rows));
    });
    return;
  }
  const int bands = (a.N + 15) / 16;
  const int kc = std::max(a.G, 1024 / a.G * a.G);
  std::vector<float> scratch(static_cast<size_t>(pool.size()) * 16 * kc);
  std::vector<std::atomic<int>> owner(pool.size());  // one scratch slot per participating thread
  for (auto& o : owner) o = 0;
  static std::atomic<uint64_t> calls{0};
  const uint64_t call = ++calls;
  pool.parallel_for(bands, [&](int i) {
    thread_local int slot = -1;
    thread_local uint64_t slot_call = 0;
    if (slot_call != call) {  // this thread's first item of this call: claim a slot
      slot_call = call;
      slot = 0;
      while (owner[slot].exchange(1)) ++slot;
    }
    const int n0 = i * 16;
    mid_band<BITS>(a, n0, std::min(a.N, n0 + 16), scratch.data() + static_cast<size_t>(slot) * 16 * kc);
  });
}

template <int BITS, typename S>
void prefill_impl(const QArgs<S>& a) {
  auto& pool = ThreadPool::get();
  const int block = std::min(a.N, std::max(64, (1 << 20) / a.K / 16 * 16));  // ~4 MB of fp32 rows
  std::vector<float> scratch(static_cast<size_t>(block) * a.K);
  for (int n0 = 0; n0 < a.N; n0 += block) {
    const int nb = std::min(block, a.N - n0);
    const int pieces = (nb + 15) / 16;
    pool.parallel_for(pieces, [&](int i) {
      const int r0 = n0 + i * 16;
      dequantize_rows<BITS>(a, r0, std::min(n0 + nb, r0 + 16), scratch.data() + static_cast<size_t>(i) * 16 * a.K);
    });
    cblas_sgemm(kRowMajor, kNoTrans, kTrans, a.M, nb, a.K, 1.0f, a.x, a.K, scratch.data(), a.K, 0.0f, a.y + n0, a.N);
  }
}

#if defined(TRILLM_Q8_DOT)
// ------------------------------------------------------------ decode rows in integer dot products

constexpr int QB = 32;  // elements per activation block
constexpr int kRowTile = 64;  // rows of x the integer path keeps accumulators for at once

struct XQ {
  const void* q;  // [M, K] int8 or int16, each block in the order the weights' blocks unpack to
  const float* d;  // [M, K / QB]
  const float* sum;  // [M, K / G]: sums of the rounded x
};

inline int hsum8i(__m256i t) {
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
  return _mm_cvtsi128_si32(h);
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define TRILLM_VNNI 1
#endif

// 8 int32 lanes, each the sum of 4 products of unsigned u and signed s bytes (u * s pairs fit int16: u <= 15
// at 4 bits, or |u| <= 128 against |s| <= 127 at 8).
inline __m256i dot_us(__m256i u, __m256i s) {
#if defined(TRILLM_VNNI)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// acc + the sums of pairs of int16 products (vpdpwssd with VNNI).
inline __m256i dot16(__m256i acc, __m256i a, __m256i b) {
#if defined(TRILLM_VNNI)
  return _mm256_dpwssd_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

// One weight block of 32 against one block of x (XB bits), loaded as it is stored. 4 bits: byte i holds
// elements 2i (low nibble) and 2i + 1, so the block unpacks to its even elements, then its odd ones (x's
// blocks are stored in that order).
template <int BITS, int XB>
struct WBlock;

template <>
struct WBlock<4, 8> {
  static constexpr float kShift = 0.0f;
  __m256i u;
  void load(const uint8_t* p) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), m = _mm_set1_epi8(0x0F);
    u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
  }
  __m256i dot(const __m256i* x) const {
    return dot_us(u, x[0]);
  }
};

template <>
struct WBlock<8, 8> {
#if defined(TRILLM_VNNI)
  static constexpr float kShift = 0.0f;
  __m256i u;
  void load(const uint8_t* p) {
    u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  __m256i dot(const __m256i* x) const {
    return dot_us(u, x[0]);
  }
#else
  // vpmaddubsw on q up to 255 would saturate its int16 pairs: q - 128 instead (bias + 128 * scale), as
  // |q - 128| times x with q - 128's sign.
  static constexpr float kShift = 128.0f;
  __m256i a, s;
  void load(const uint8_t* p) {
    s = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_set1_epi8(-128));
    a = _mm256_abs_epi8(s);
  }
  __m256i dot(const __m256i* x) const {
    return dot_us(a, _mm256_sign_epi8(x[0], s));
  }
#endif
};

#if defined(__AVX512BW__)
#define TRILLM_LANES 1  // int16 x: weight rows as vector lanes (lanes_int); AVX2 keeps group8_int (measured faster there)
#endif

#if !defined(TRILLM_LANES)
// int16 x: the weights widened to int16 (q <= 255 times |x| <= 32767: pairs fit int32).
template <>
struct WBlock<4, 16> {
  static constexpr float kShift = 0.0f;
  __m256i e, o;  // even elements, odd elements
  void load(const uint8_t* p) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), m = _mm_set1_epi8(0x0F);
    e = _mm256_cvtepu8_epi16(_mm_and_si128(b, m));
    o = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), m));
  }
  __m256i dot(const __m256i* x) const {
    return dot16(dot16(_mm256_setzero_si256(), e, x[0]), o, x[1]);
  }
};

template <>
struct WBlock<8, 16> {
  static constexpr float kShift = 0.0f;
  __m256i lo, hi;  // elements 0-15, 16-31
  void load(const uint8_t* p) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    lo = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(v));
    hi = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(v, 1));
  }
  __m256i dot(const __m256i* x) const {
    return dot16(dot16(_mm256_setzero_si256(), lo, x[0]), hi, x[1]);
  }
};

#endif

// int16 x meets weight rows held one per 32-bit vector lane (lanes_int below): the 16 int16 pairs of a block of
// 32, each pair the two elements one lane's unpacked dword holds in its low and high halves. 4 bits: dword c of
// a row's block (elements 8c .. 8c + 7, two per byte, low nibble first) shifted by 4s, masked by 0x000F000F,
// is the pair (8c + s, 8c + 4 + s); 8 bits: dword c (elements 4c .. 4c + 3) masked by 0x00FF00FF or shifted by
// 8 is (4c + s, 4c + 2 + s). x's block is stored pair by pair in that order.
template <int BITS>
constexpr std::array<int, 32> lane_pairs() {
  std::array<int, 32> out{};
  for (int p = 0; p < 32; ++p) {
    const int v = p / 2, hi = p % 2;
    out[p] = BITS == 4 ? 8 * (v / 4) + v % 4 + 4 * hi : 4 * (v / 2) + v % 2 + 2 * hi;
  }
  return out;
}
template <int BITS>
constexpr std::array<int, 32> kLanePairs = lane_pairs<BITS>();

// Rows of x -> XB-bit blocks q (4-bit weights: each block's even elements, then its odd ones; int16 with
// AVX-512: kLanePairs' order), their d, and the rounded x's sums per weight group.
template <int BITS, int XB>
void quantize_rows(const float* x, int M, int K, int G, void* qv, float* d, float* sum) {
  using Q = std::conditional_t<XB == 8, int8_t, int16_t>;
  constexpr float kMax = XB == 8 ? 127.0f : 32767.0f;
  Q* q = static_cast<Q*>(qv);
  const int nb = K / QB, ng = K / G;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
  const __m256i evens_odds = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                              0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  std::fill(sum, sum + static_cast<size_t>(M) * ng, 0.0f);
  for (int m = 0; m < M; ++m) {
    const float* xr = x + static_cast<size_t>(m) * K;
    for (int b = 0; b < nb; ++b) {
      float t[QB];  // int16: kLanePairs' order (AVX-512), or 4-bit weights' evens then odds (AVX2)
      const float* p = xr + b * QB;
#if defined(TRILLM_LANES)
      if constexpr (XB == 16) {
        for (int k = 0; k < QB; ++k) t[k] = p[kLanePairs<BITS>[k]];
        p = t;
      }
#else
      if constexpr (BITS == 4 && XB == 16) {
        for (int k = 0; k < QB / 2; ++k) t[k] = p[2 * k], t[QB / 2 + k] = p[2 * k + 1];
        p = t;
      }
#endif
      __m256 v[4];
      for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(p + 8 * i);
      const __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                     _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_movehdup_ps(h));
      const float amax = _mm_cvtss_f32(h);
      const float dq = amax / kMax;
      d[static_cast<size_t>(m) * nb + b] = dq;
      const __m256 inv = _mm256_set1_ps(amax > 0.0f ? kMax / amax : 0.0f);
      __m256i i[4];
      for (int k = 0; k < 4; ++k) i[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], inv));  // to nearest, ties even
      const __m256i tot = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
      sum[static_cast<size_t>(m) * ng + b * QB / G] += dq * static_cast<float>(hsum8i(tot));
      Q* out = q + static_cast<size_t>(m) * K + b * QB;
      if constexpr (XB == 8) {
        __m256i o = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
        o = _mm256_permutevar8x32_epi32(o, order);
        if constexpr (BITS == 4) {
          // per 16-byte lane evens then odds; then the quadwords as (evens 0-14, evens 16-30, odds, odds)
          o = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(o, evens_odds), 0xD8);
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), o);
      } else {
        for (int k = 0; k < 2; ++k) {  // packs interleaves 128-bit lanes: quadwords 0, 2, 1, 3 restore the order
          const __m256i o = _mm256_permute4x64_epi64(_mm256_packs_epi32(i[2 * k], i[2 * k + 1]), 0xD8);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * k), o);
        }
      }
    }
  }
}

// Lane j of the result: the sum of v[j]'s 8 lanes (int32, exact, so any order gives the same sums).
inline __m256i reduce8(const __m256i* v) {
  __m256i h[4];
  for (int p = 0; p < 4; ++p) {
    h[p] = _mm256_add_epi32(_mm256_unpacklo_epi32(v[2 * p], v[2 * p + 1]), _mm256_unpackhi_epi32(v[2 * p], v[2 * p + 1]));
  }
  const __m256i q0 = _mm256_add_epi32(_mm256_unpacklo_epi64(h[0], h[1]), _mm256_unpackhi_epi64(h[0], h[1]));
  const __m256i q1 = _mm256_add_epi32(_mm256_unpacklo_epi64(h[2], h[3]), _mm256_unpackhi_epi64(h[2], h[3]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(q0, q1, 0x20), _mm256_permute2x128_si256(q0, q1, 0x31));
}

// The integer path's arithmetic, the same for every row count and weight row (so a row's y does not
// depend on what else is in the call: a verify step's rows equal plain decode's): per weight block, the
// exact int32 dot of the block with x's block, one conversion, one FMA by d_x * scale into y's accumulator;
// per group one FMA of bias * (the rounded x's sum) into a second accumulator; y = the two's sum.
//
// Weight rows n .. n + 8 against every row of x: each weight block is loaded (and unpacked) once per call
// and met by all M rows; the 8 rows' block dots are summed into one vector whose lane j is weight row j's,
// so the scaling is one vector FMA per x row and block, and the 8 outputs are stored together.
template <int BITS, int XB, typename S>
void group8_int(const QArgs<S>& a, const XQ& xq, int n, __m256* acc, __m256* bacc) {
  using Q = std::conditional_t<XB == 8, int8_t, int16_t>;
  const int K = a.K, ng = K / a.G, nb = K / QB, per = a.G / QB;
  const size_t wrow = static_cast<size_t>(K) * BITS / 8;
  const Q* xbase = static_cast<const Q*>(xq.q);
  for (int i = 0; i < a.M; ++i) acc[i] = bacc[i] = _mm256_setzero_ps();
  for (int g = 0; g < ng; ++g) {
    alignas(32) float s[8], b[8];
    for (int j = 0; j < 8; ++j) {
      s[j] = to_f32(a.scales[static_cast<size_t>(n + j) * ng + g]);
      b[j] = to_f32(a.biases[static_cast<size_t>(n + j) * ng + g]) + WBlock<BITS, XB>::kShift * s[j];
    }
    const __m256 sv = _mm256_load_ps(s), bv = _mm256_load_ps(b);
    for (int i = 0; i < a.M; ++i) {
      bacc[i] = _mm256_fmadd_ps(bv, _mm256_set1_ps(xq.sum[static_cast<size_t>(i) * ng + g]), bacc[i]);
    }
    if (a.M == 1) {  // no next row to keep the weight blocks for: unpack each where it is used (AVX2's 16 registers)
      for (int blk = g * per; blk < (g + 1) * per; ++blk) {
        const __m256i* xp = reinterpret_cast<const __m256i*>(xbase + static_cast<size_t>(blk) * QB);
        __m256i xv[XB / 8];
        for (int h = 0; h < XB / 8; ++h) xv[h] = _mm256_loadu_si256(xp + h);
        __m256i d[8];
        for (int j = 0; j < 8; ++j) {
          WBlock<BITS, XB> wb;
          wb.load(a.w + (n + j) * wrow + static_cast<size_t>(blk) * QB * BITS / 8);
          d[j] = wb.dot(xv);
        }
        const __m256 dxs = _mm256_mul_ps(_mm256_set1_ps(xq.d[blk]), sv);
        acc[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce8(d)), dxs, acc[0]);
      }
      continue;
    }
    for (int blk = g * per; blk < (g + 1) * per; ++blk) {
      WBlock<BITS, XB> wb[8];
      for (int j = 0; j < 8; ++j) wb[j].load(a.w + (n + j) * wrow + static_cast<size_t>(blk) * QB * BITS / 8);
      for (int i = 0; i < a.M; ++i) {
        const Q* xp = xbase + static_cast<size_t>(i) * K + static_cast<size_t>(blk) * QB;
        __m256i xv[XB / 8];
        for (int h = 0; h < XB / 8; ++h) xv[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp) + h);
        __m256i d[8];
        for (int j = 0; j < 8; ++j) d[j] = wb[j].dot(xv);
        const __m256 dxs = _mm256_mul_ps(_mm256_set1_ps(xq.d[static_cast<size_t>(i) * nb + blk]), sv);
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce8(d)), dxs, acc[i]);
      }
    }
  }
  for (int i = 0; i < a.M; ++i) _mm256_storeu_ps(a.y + static_cast<size_t>(i) * a.N + n, _mm256_add_ps(acc[i], bacc[i]));
}

// One weight row (the last N % 8), in the same arithmetic as a lane of group8_int.
template <int BITS, int XB, typename S>
void row_int(const QArgs<S>& a, const XQ& xq, int n) {
  using Q = std::conditional_t<XB == 8, int8_t, int16_t>;
  const int K = a.K, ng = K / a.G, nb = K / QB, per = a.G / QB;
  const size_t wrow = static_cast<size_t>(K) * BITS / 8;
  const Q* xbase = static_cast<const Q*>(xq.q);
  for (int i = 0; i < a.M; ++i) {
    float acc = 0.0f, bacc = 0.0f;
    for (int g = 0; g < ng; ++g) {
      const float s = to_f32(a.scales[static_cast<size_t>(n) * ng + g]);
      const float b = to_f32(a.biases[static_cast<size_t>(n) * ng + g]) + WBlock<BITS, XB>::kShift * s;
      bacc = std::fma(b, xq.sum[static_cast<size_t>(i) * ng + g], bacc);
      for (int blk = g * per; blk < (g + 1) * per; ++blk) {
        WBlock<BITS, XB> wb;
        wb.load(a.w + n * wrow + static_cast<size_t>(blk) * QB * BITS / 8);
        const Q* xp = xbase + static_cast<size_t>(i) * K + static_cast<size_t>(blk) * QB;
        __m256i xv[XB / 8];
        for (int h = 0; h < XB / 8; ++h) xv[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp) + h);
        acc = std::fma(static_cast<float>(hsum8i(wb.dot(xv))), xq.d[static_cast<size_t>(i) * nb + blk] * s, acc);
      }
    }
    a.y[static_cast<size_t>(i) * a.N + n] = acc + bacc;
  }
}

// ---- int16 x: weight rows as vector lanes
// AVX-512 (BW): one output row per 32-bit lane, 16 rows a zmm. A block's 32 weights of 16 rows are transposed
// by dwords as they are loaded (16 loads of 16 bytes and a 4 x 4 dword transpose per 128-bit lane) and
// unpacked to 16 vectors of int16 pairs (kLanePairs); each pair of x is broadcast and multiply-added into every
// lane at once (vpdpwssd, or vpmaddwd + vpaddd), so lane j ends the block holding row j's exact int32 block dot
// with no horizontal reduction (group8_int's 8-row transpose-add cost as many instructions as its dot
// products). The float arithmetic per lane is group8_int's: one conversion, one FMA by d_x * scale per block;
// bias * (the rounded x's sum) per group into a second accumulator; so y is the same bits either way. AVX2
// keeps group8_int: with 16 registers (the 16 pair vectors spill) and no VNNI this layout measured 8-18% slower.
#if defined(TRILLM_LANES)
constexpr int kLanes = 16;
using LI = __m512i;
using LF = __m512;
inline LI l_and(LI a, LI b) { return _mm512_and_si512(a, b); }
template <int S> inline LI l_srl16(LI a) { return _mm512_srli_epi16(a, S); }
inline LI l_set1(int32_t v) { return _mm512_set1_epi32(v); }
inline LI l_madd(LI w, LI x) { return _mm512_madd_epi16(w, x); }
inline LI l_dot(LI acc, LI w, LI x) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, w, x);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}
inline LI l_add(LI a, LI b) { return _mm512_add_epi32(a, b); }
inline LF l_cvt(LI a) { return _mm512_cvtepi32_ps(a); }
inline LF l_fmadd(LF a, LF b, LF c) { return _mm512_fmadd_ps(a, b, c); }
inline LF l_mul(LF a, LF b) { return _mm512_mul_ps(a, b); }
inline LF l_add(LF a, LF b) { return _mm512_add_ps(a, b); }
inline LF l_splat(float v) { return _mm512_set1_ps(v); }
inline LF l_zero() { return _mm512_setzero_ps(); }
inline LF l_loadf(const float* p) { return _mm512_loadu_ps(p); }
inline void l_storef(float* p, LF v) { _mm512_storeu_ps(p, v); }
inline LF l_asf(LI a) { return _mm512_castsi512_ps(a); }
inline LI l_sll32_16(LI a) { return _mm512_slli_epi32(a, 16); }
inline LI l_srl32_16(LI a) { return _mm512_srli_epi32(a, 16); }
// Halves in the low 16 bits of each lane -> floats.
inline LF l_half_lo(LI a) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(a)); }
inline LI l_rows(const uint8_t* const* r, size_t off, int k) {  // rows k, k + 4, k + 8, k + 12 in the 128-bit lanes
  auto ld = [&](int j) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(r[j] + off)); };
  LI v = _mm512_castsi128_si512(ld(k));
  v = _mm512_inserti32x4(v, ld(k + 4), 1);
  v = _mm512_inserti32x4(v, ld(k + 8), 2);
  return _mm512_inserti32x4(v, ld(k + 12), 3);
}
inline LI l_unpacklo32(LI a, LI b) { return _mm512_unpacklo_epi32(a, b); }
inline LI l_unpackhi32(LI a, LI b) { return _mm512_unpackhi_epi32(a, b); }
inline LI l_unpacklo64(LI a, LI b) { return _mm512_unpacklo_epi64(a, b); }
inline LI l_unpackhi64(LI a, LI b) { return _mm512_unpackhi_epi64(a, b); }

// t[c], lane j: the dword at byte off + 4c of row r[j] (c < 4): 16 bytes of each of kLanes rows, transposed.
inline void load_lanes(const uint8_t* const* r, size_t off, LI* t) {
  const LI a0 = l_rows(r, off, 0), a1 = l_rows(r, off, 1), a2 = l_rows(r, off, 2), a3 = l_rows(r, off, 3);
  const LI t0 = l_unpacklo32(a0, a1), t1 = l_unpackhi32(a0, a1), t2 = l_unpacklo32(a2, a3), t3 = l_unpackhi32(a2, a3);
  t[0] = l_unpacklo64(t0, t2), t[1] = l_unpackhi64(t0, t2), t[2] = l_unpacklo64(t1, t3), t[3] = l_unpackhi64(t1, t3);
}

// out[g * kLanes + j] = v[row j][g] for g < ng (v: [rows, ng] scales or biases): one float vector per group.
template <typename S>
void lanes_of_groups(const S* v, const int* rows, int ng, float* out) {
  const uint8_t* r[kLanes];
  for (int j = 0; j < kLanes; ++j) r[j] = reinterpret_cast<const uint8_t*>(v + static_cast<size_t>(rows[j]) * ng);
  constexpr int per = 16 / sizeof(S);  // groups per 16 bytes
  int g = 0;
  for (; g + per <= ng; g += per) {
    LI t[4];
    load_lanes(r, g * sizeof(S), t);
    for (int c = 0; c < 4; ++c) {
      if constexpr (std::is_same_v<S, float>) {
        l_storef(out + (g + c) * kLanes, l_asf(t[c]));
      } else if constexpr (std::is_same_v<S, mx::bfloat16_t>) {
        l_storef(out + (g + 2 * c) * kLanes, l_asf(l_sll32_16(t[c])));
        l_storef(out + (g + 2 * c + 1) * kLanes, l_asf(l_and(t[c], l_set1(static_cast<int32_t>(0xFFFF0000u)))));
      } else {
        l_storef(out + (g + 2 * c) * kLanes, l_half_lo(t[c]));
        l_storef(out + (g + 2 * c + 1) * kLanes, l_half_lo(l_srl32_16(t[c])));
      }
    }
  }
  for (; g < ng; ++g) {
    for (int j = 0; j < kLanes; ++j) out[g * kLanes + j] = to_f32(v[static_cast<size_t>(rows[j]) * ng + g]);
  }
}

typedef int32_t pair_t __attribute__((may_alias, aligned(4)));  // two int16 of x read as one lane's operand

// Weight rows n .. n + kLanes (clamped to the band's end n1) against every row of x (M <= kRowTile).
template <int BITS, typename S>
void lanes_int(const QArgs<S>& a, const XQ& xq, int n, int n1, LF* acc, LF* bacc) {
  const int K = a.K, ng = K / a.G, nb = K / QB, per = a.G / QB, live = std::min(kLanes, n1 - n);
  const size_t wrow = static_cast<size_t>(K) * BITS / 8;
  const int16_t* xbase = static_cast<const int16_t*>(xq.q);
  int rows[kLanes];
  const uint8_t* wr[kLanes];
  for (int j = 0; j < kLanes; ++j) {
    rows[j] = n + std::min(j, live - 1);  // past the end: the last row again, not stored
    wr[j] = a.w + static_cast<size_t>(rows[j]) * wrow;
  }
  thread_local std::vector<float> sb;
  sb.resize(static_cast<size_t>(2) * ng * kLanes);
  float* const sl = sb.data();
  float* const bl = sl + static_cast<size_t>(ng) * kLanes;
  lanes_of_groups(a.scales, rows, ng, sl);
  lanes_of_groups(a.biases, rows, ng, bl);
  for (int i = 0; i < a.M; ++i) acc[i] = bacc[i] = l_zero();
  const LI mask = l_set1(BITS == 4 ? 0x000F000F : 0x00FF00FF);
  for (int g = 0; g < ng; ++g) {
    const LF sv = l_loadf(sl + g * kLanes), bv = l_loadf(bl + g * kLanes);
    for (int i = 0; i < a.M; ++i) bacc[i] = l_fmadd(bv, l_splat(xq.sum[static_cast<size_t>(i) * ng + g]), bacc[i]);
    for (int blk = g * per; blk < (g + 1) * per; ++blk) {
      LI w[16];  // w[v], lane j: row j's pair v (kLanePairs)
      if constexpr (BITS == 4) {
        LI t[4];
        load_lanes(wr, static_cast<size_t>(blk) * 16, t);
        for (int c = 0; c < 4; ++c) {
          w[4 * c] = l_and(t[c], mask);
          w[4 * c + 1] = l_and(l_srl16<4>(t[c]), mask);
          w[4 * c + 2] = l_and(l_srl16<8>(t[c]), mask);
          w[4 * c + 3] = l_srl16<12>(t[c]);
        }
      } else {
        LI t[8];
        load_lanes(wr, static_cast<size_t>(blk) * 32, t);
        load_lanes(wr, static_cast<size_t>(blk) * 32 + 16, t + 4);
        for (int c = 0; c < 8; ++c) w[2 * c] = l_and(t[c], mask), w[2 * c + 1] = l_srl16<8>(t[c]);
      }
      for (int i = 0; i < a.M; ++i) {
        // x's pairs as int32s, each broadcast straight from memory (an FMA's {1to16} operand)
        const pair_t* xp = reinterpret_cast<const pair_t*>(xbase + static_cast<size_t>(i) * K + static_cast<size_t>(blk) * QB);
        // four chains of 4 (exact int32 sums, so any split gives the same dot): one row's latency, not 16 deep
        LI d[4];
        for (int c = 0; c < 4; ++c) d[c] = l_madd(w[c], l_set1(xp[c]));
        for (int v = 4; v < 16; v += 4) {
          for (int c = 0; c < 4; ++c) d[c] = l_dot(d[c], w[v + c], l_set1(xp[v + c]));
        }
        const LF dxs = l_mul(l_splat(xq.d[static_cast<size_t>(i) * nb + blk]), sv);
        acc[i] = l_fmadd(l_cvt(l_add(l_add(d[0], d[1]), l_add(d[2], d[3]))), dxs, acc[i]);
      }
    }
  }
  for (int i = 0; i < a.M; ++i) {
    float* y = a.y + static_cast<size_t>(i) * a.N + n;
    const LF out = l_add(acc[i], bacc[i]);
    if (live == kLanes) {
      l_storef(y, out);
    } else {
      alignas(64) float tmp[kLanes];
      l_storef(tmp, out);
      std::memcpy(y, tmp, live * sizeof(float));
    }
  }
}
#endif  // TRILLM_LANES

// The accumulators' vectors: one float per output row (lanes_int's 16 for int16 x; group8_int's 8 otherwise).
template <int XB>
struct Acc {
  using T = __m256;
};
#if defined(TRILLM_LANES)
template <>
struct Acc<16> {
  using T = LF;
};
constexpr bool kLanesInt16 = true;
#else
constexpr bool kLanesInt16 = false;
#endif

template <int BITS, int XB, typename S>
void int_impl(const QArgs<S>& a) {
  auto& pool = ThreadPool::get();
  thread_local std::vector<int16_t> q;  // MLX runs a stream's primitives one at a time on its thread
  thread_local std::vector<float> d, sum;
  q.resize(static_cast<size_t>(a.M) * a.K);
  d.resize(static_cast<size_t>(a.M) * (a.K / QB));
  sum.resize(static_cast<size_t>(a.M) * (a.K / a.G));
  quantize_rows<BITS, XB>(a.x, a.M, a.K, a.G, q.data(), d.data(), sum.data());
  const XQ xq{q.data(), d.data(), sum.data()};
  // Bands of 16 weight rows or more, ~8 per thread so the dynamic split stays even when another process
  // holds a core.
  const int rows = std::max(16, (a.N / (8 * pool.size())) / 16 * 16);
  const int bands = (a.N + rows - 1) / rows;
  using Q = std::conditional_t<XB == 8, int8_t, int16_t>;
  const int nb = a.K / QB, ng = a.K / a.G;
  pool.parallel_for(bands, [&](int i) {
    const int n0 = i * rows, n1 = std::min(a.N, n0 + rows);
    typename Acc<XB>::T acc[kRowTile], bacc[kRowTile];
    for (int m0 = 0; m0 < a.M; m0 += kRowTile) {  // rows of x in tiles (a prefill chunk's hundreds)
      QArgs<S> t = a;
      t.x = a.x + static_cast<size_t>(m0) * a.K;
      t.y = a.y + static_cast<size_t>(m0) * a.N;
      t.M = std::min(kRowTile, a.M - m0);
      const XQ tq{static_cast<const Q*>(xq.q) + static_cast<size_t>(m0) * a.K, xq.d + static_cast<size_t>(m0) * nb,
                  xq.sum + static_cast<size_t>(m0) * ng};
      if constexpr (XB == 16 && kLanesInt16) {
#if defined(TRILLM_LANES)
        for (int n = n0; n < n1; n += kLanes) lanes_int<BITS>(t, tq, n, n1, acc, bacc);
#endif
      } else {
        int n = n0;
        for (; n + 8 <= n1; n += 8) group8_int<BITS, XB>(t, tq, n, acc, bacc);
        for (; n < n1; ++n) row_int<BITS, XB>(t, tq, n);
      }
    }
  });
}
#else
// ------------------------------------------------------------ the integer path elsewhere (NEON; scalar otherwise)
// The x86 path's arithmetic exactly (the same rounded x, d and sums, the same exact int32 block dots, the same
// float operations in the same order; by construction a row's y is the x86 int16 path's and the VNNI int8 path's,
// not compared across builds; AVX2's int8 8-bit path shifts q by 128 and rounds apart), for rows of x up to
// max_rows (decode, a verify's few positions); more rows keep the dequantize + sgemm path (not measured on an
// ARM CPU against it). Block dots: NEON's widening int16 multiply-accumulate (vmlal) for int16 x; for int8 x
// the Armv8.2 dot product (sdot: vdotq_s32) where the build has it, else the same widening.

constexpr int QB = 32;  // elements per activation block

template <typename Q>
struct XQ {
  const Q* q;  // [M, K] in natural order
  const float* d;  // [M, K / QB]
  const float* sum;  // [M, K / G]: sums of the rounded x
};

template <typename Q>
void quantize_rows(const float* x, int M, int K, int G, Q* q, float* d, float* sum) {
  constexpr float kMax = sizeof(Q) == 1 ? 127.0f : 32767.0f;
  const int nb = K / QB, ng = K / G;
  std::fill(sum, sum + static_cast<size_t>(M) * ng, 0.0f);
  for (int m = 0; m < M; ++m) {
    for (int b = 0; b < nb; ++b) {
      const float* p = x + static_cast<size_t>(m) * K + b * QB;
      float amax = 0.0f;
      for (int k = 0; k < QB; ++k) amax = std::max(amax, std::fabs(p[k]));
      const float dq = amax / kMax, inv = amax > 0.0f ? kMax / amax : 0.0f;
      d[static_cast<size_t>(m) * nb + b] = dq;
      Q* out = q + static_cast<size_t>(m) * K + b * QB;
      int32_t tot = 0;
      for (int k = 0; k < QB; ++k) {
        const int32_t v = static_cast<int32_t>(std::nearbyint(p[k] * inv));  // to nearest, ties even (x86's)
        out[k] = static_cast<Q>(v);
        tot += v;
      }
      sum[static_cast<size_t>(m) * ng + b * QB / G] += dq * static_cast<float>(tot);
    }
  }
}

// The exact int32 dot of one weight block of 32 (BITS-bit unsigned q, MLX's packing: 4 bits, element 2i in
// the low nibble of byte i) with one block of x.
template <int BITS, typename Q>
inline int32_t block_dot(const uint8_t* w, const Q* x) {
#if defined(__ARM_NEON)
  if constexpr (sizeof(Q) == 2) {
    int32x4_t acc = vdupq_n_s32(0);
    auto mla = [&acc](uint8x8_t w8, int16x8_t xv) {
      const int16x8_t w16 = vreinterpretq_s16_u16(vmovl_u8(w8));
      acc = vmlal_s16(acc, vget_low_s16(w16), vget_low_s16(xv));
      acc = vmlal_high_s16(acc, w16, xv);
    };
    if constexpr (BITS == 4) {
      const uint8x16_t b = vld1q_u8(w);
      const uint8x16_t e = vandq_u8(b, vdupq_n_u8(0x0F)), o = vshrq_n_u8(b, 4);  // elements 2i, 2i + 1
      const int16x8x2_t x0 = vld2q_s16(x), x1 = vld2q_s16(x + 16);  // de-interleaved: evens, odds
      mla(vget_low_u8(e), x0.val[0]);
      mla(vget_low_u8(o), x0.val[1]);
      mla(vget_high_u8(e), x1.val[0]);
      mla(vget_high_u8(o), x1.val[1]);
    } else {
      const uint8x16_t b0 = vld1q_u8(w), b1 = vld1q_u8(w + 16);
      mla(vget_low_u8(b0), vld1q_s16(x));
      mla(vget_high_u8(b0), vld1q_s16(x + 8));
      mla(vget_low_u8(b1), vld1q_s16(x + 16));
      mla(vget_high_u8(b1), vld1q_s16(x + 24));
    }
    return vaddvq_s32(acc);
  } else {
#if defined(__ARM_FEATURE_DOTPROD)
    int32x4_t acc = vdupq_n_s32(0);
    if constexpr (BITS == 4) {
      const uint8x16_t b = vld1q_u8(w);
      const int8x16x2_t xv = vld2q_s8(x);  // evens, odds
      acc = vdotq_s32(acc, vreinterpretq_s8_u8(vandq_u8(b, vdupq_n_u8(0x0F))), xv.val[0]);
      acc = vdotq_s32(acc, vreinterpretq_s8_u8(vshrq_n_u8(b, 4)), xv.val[1]);
      return vaddvq_s32(acc);
    } else {
      // q up to 255 is no int8: q - 128 (the bytes' top bit flipped), then 128 * sum(x), an exact identity
      const int8x16_t x0 = vld1q_s8(x), x1 = vld1q_s8(x + 16);
      const uint8x16_t flip = vdupq_n_u8(0x80);
      acc = vdotq_s32(acc, vreinterpretq_s8_u8(veorq_u8(vld1q_u8(w), flip)), x0);
      acc = vdotq_s32(acc, vreinterpretq_s8_u8(veorq_u8(vld1q_u8(w + 16), flip)), x1);
      const int32_t xs = vaddlvq_s8(x0) + vaddlvq_s8(x1);
      return vaddvq_s32(acc) + 128 * xs;
    }
#else
    int16_t wide[QB];
    for (int k = 0; k < QB; ++k) wide[k] = x[k];
    return block_dot<BITS, int16_t>(w, wide);
#endif
  }
#else
  int32_t acc = 0;
  for (int k = 0; k < QB; ++k) {
    const int q = BITS == 4 ? (w[k / 2] >> (4 * (k % 2))) & 0x0F : w[k];
    acc += q * static_cast<int32_t>(x[k]);
  }
  return acc;
#endif
}

// Weight row n against every row of x, in the x86 path's arithmetic (see row_int there).
template <int BITS, typename Q, typename S>
void row_int(const QArgs<S>& a, const XQ<Q>& xq, int n) {
  const int K = a.K, ng = K / a.G, nb = K / QB, per = a.G / QB;
  const uint8_t* wr = a.w + static_cast<size_t>(n) * K * BITS / 8;
  for (int i = 0; i < a.M; ++i) {
    const Q* xr = xq.q + static_cast<size_t>(i) * K;
    float acc = 0.0f, bacc = 0.0f;
    for (int g = 0; g < ng; ++g) {
      const float s = to_f32(a.scales[static_cast<size_t>(n) * ng + g]);
      const float b = to_f32(a.biases[static_cast<size_t>(n) * ng + g]);
      bacc = std::fma(b, xq.sum[static_cast<size_t>(i) * ng + g], bacc);
      for (int blk = g * per; blk < (g + 1) * per; ++blk) {
        const int32_t dot = block_dot<BITS>(wr + static_cast<size_t>(blk) * QB * BITS / 8, xr + blk * QB);
        acc = std::fma(static_cast<float>(dot), xq.d[static_cast<size_t>(i) * nb + blk] * s, acc);
      }
    }
    a.y[static_cast<size_t>(i) * a.N + n] = acc + bacc;
  }
}

template <int BITS, typename Q, typename S>
void int_impl(const QArgs<S>& a) {
  auto& pool = ThreadPool::get();
  thread_local std::vector<Q> q;  // MLX runs a stream's primitives one at a time on its thread
  thread_local std::vector<float> d, sum;
  q.resize(static_cast<size_t>(a.M) * a.K);
  d.resize(static_cast<size_t>(a.M) * (a.K / QB));
  sum.resize(static_cast<size_t>(a.M) * (a.K / a.G));
  quantize_rows(a.x, a.M, a.K, a.G, q.data(), d.data(), sum.data());
  const XQ<Q> xq{q.data(), d.data(), sum.data()};
  const int rows = std::max(16, (a.N / (8 * pool.size())) / 16 * 16);  // bands, ~8 per thread, taken dynamically
  pool.parallel_for((a.N + rows - 1) / rows, [&](int i) {
    for (int n = i * rows; n < std::min(a.N, (i + 1) * rows); ++n) row_int<BITS>(a, xq, n);
  });
}
#endif

template <typename S>
void run(const QArgs<S>& a, int max_rows, int x_bits) {
  const bool decode = a.M <= max_rows;
#if defined(TRILLM_Q8_DOT)
  // Every row count, prefill chunks too: one arithmetic, so a row's y never depends on what it is batched with
  // (the dequantize + sgemm path below multiplies fp32 x, ~1e-3 away from the rounded x's).
  if ((x_bits == 8 || x_bits == 16) && a.G % QB == 0) {
    if (x_bits == 16) {
      a.bits == 4 ? int_impl<4, 16>(a) : int_impl<8, 16>(a);
    } else {
      a.bits == 4 ? int_impl<4, 8>(a) : int_impl<8, 8>(a);
    }
    return;
  }
#else
  if ((x_bits == 8 || x_bits == 16) && a.G % QB == 0 && decode) {
    if (x_bits == 16) {
      a.bits == 4 ? int_impl<4, int16_t>(a) : int_impl<8, int16_t>(a);
    } else {
      a.bits == 4 ? int_impl<4, int8_t>(a) : int_impl<8, int8_t>(a);
    }
    return;
  }
#endif
  if (a.bits == 4) {
    decode ? decode_impl<4>(a) : prefill_impl<4>(a);
  } else {
    decode ? decode_impl<8>(a) : prefill_impl<8>(a);
  }
}

}  // namespace

#ifndef TRILLM_KERNEL_BODIES_ONLY
mx::array quant_linear(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                       int group_size, int bits, int max_rows, int x_bits, mx::StreamOrDevice s) {
  if (x.dtype() != mx::float32) throw std::invalid_argument("[trillm quant_linear] x must be float32");
  if (bits != 4 && bits != 8) throw std::invalid_argument("[trillm quant_linear] bits must be 4 or 8");
  if (w.dtype() != mx::uint32 || w.ndim() != 2 || scales.ndim() != 2 || biases.shape() != scales.shape()) {
    throw std::invalid_argument("[trillm quant_linear] w uint32 [N, K * bits / 32], scales and biases [N, K / group]");
  }
  if (scales.dtype() != biases.dtype() ||
      (scales.dtype() != mx::float32 && scales.dtype() != mx::float16 && scales.dtype() != mx::bfloat16)) {
    throw std::invalid_argument("[trillm quant_linear] scales and biases: one float dtype (32, 16 or bf16)");
  }
  const int K = x.ndim() ? x.shape(-1) : 0;
  if (x.ndim() < 1 || group_size % W || group_size <= 0 || K % group_size || w.shape(1) * 32 != K * bits ||
      scales.shape(0) != w.shape(0) || scales.shape(1) * group_size != K) {
    throw std::invalid_argument("[trillm quant_linear] shapes do not match (K a multiple of group_size, a multiple of 16)");
  }
  auto stream = mx::to_stream(s);
  auto shape = x.shape();
  shape.back() = w.shape(0);
  return mx::array(shape, mx::float32, std::make_shared<QuantLinear>(stream, group_size, bits, max_rows, x_bits),
                   {mx::contiguous(x, false, stream), mx::contiguous(w, false, stream),
                    mx::contiguous(scales, false, stream), mx::contiguous(biases, false, stream)});
}

void QuantLinear::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const auto &x = inputs[0], &w = inputs[1], &scales = inputs[2], &biases = inputs[3];
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) enc.set_input_array(in);
  enc.set_output_array(out);
  const int N = w.shape(0), K = x.shape(-1), M = static_cast<int>(x.size() / K);
  const int G = group_size_, bits = bits_, max_rows = max_rows_;
  const int x_bits = x_bits_;
  if (M == 0 || N == 0) return;
  auto launch = [&](auto tag) {
    using S = decltype(tag);
    QArgs<S> a{x.data<float>(), w.data<uint8_t>(), scales.data<S>(), biases.data<S>(), out.data<float>(),
               M, N, K, G, bits};
    enc.dispatch([a, max_rows, x_bits] { run(a, max_rows, x_bits); });
  };
  if (scales.dtype() == mx::float32) {
    launch(float{});
  } else if (scales.dtype() == mx::float16) {
    launch(mx::float16_t{});
  } else {
    launch(mx::bfloat16_t{});
  }
}

void QuantLinear::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[trillm quant_linear] the CPU primitive has no GPU implementation");
}
#endif  // TRILLM_KERNEL_BODIES_ONLY

}  // namespace trillm_cpu
