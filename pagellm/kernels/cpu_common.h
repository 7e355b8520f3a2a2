// What the CPU kernels share: bf16 <-> fp32 and fp8 -> fp32 conversion and the vector width of
// the GCC vector types. The vector width is set at build time from the CPU (-march=native): 16 floats with
// AVX-512, 8 otherwise; PAGELLM_VEC_WIDTH overrides it (tests build both widths on one machine:
// GCC lowers a 16-wide vector to two 8-wide ones where AVX-512 is missing).
#pragma once
#include <cstdint>
#include <cstring>
#if defined(__AVX512DQ__) || defined(__AVX512BW__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace pagellm {

inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {  // bf16 -> fp32: the bits move up 16 places
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// An FP8 KV cache holds bytes (torch's float8_e4m3fn or float8_e5m2 bits); the tag types let a
// kernel template tell them apart from each other and from bf16.
struct fp8_e4m3 {
  uint8_t bits;
};
struct fp8_e5m2 {
  uint8_t bits;
};

#if defined(__AVX2__)
// E4M3 bytes as the fp16 bits of value / 256, subnormals included: a byte sign-extended to 16
// bits and moved up 7 places has its exponent and mantissa on bits 7-13 and its sign on 15 (and
// on 14, cleared). Eight bytes, and sixteen.
inline __m128i e4m3_half_bits8(__m128i bytes) {
  return _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(bytes), 7),
                       _mm_set1_epi16(static_cast<short>(0xBF80)));
}
inline __m256i e4m3_half_bits16(__m128i bytes) {
  return _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7),
                          _mm256_set1_epi16(static_cast<short>(0xBF80)));
}
#endif

// Every value of an FP8 format, computed at compile time (exactly: powers of two by doubling).
// E4M3 ("fn"): bias 7, no infinities, 0x7F / 0xFF are NaN; E5M2: bias 15, IEEE-like. The cache
// writer saturates, so neither NaN nor infinity is ever stored.
struct Fp8Table {
  float v[256];
  constexpr explicit Fp8Table(int exp_bits) : v() {
    const int man_bits = 7 - exp_bits;
    const int bias = (1 << (exp_bits - 1)) - 1;
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> man_bits) & ((1 << exp_bits) - 1);
      const int m = b & ((1 << man_bits) - 1);
      float x = static_cast<float>(m) / static_cast<float>(1 << man_bits) + (e == 0 ? 0.f : 1.f);
      for (int p = (e == 0 ? 1 : e) - bias; p > 0; --p) x *= 2.f;
      for (int p = (e == 0 ? 1 : e) - bias; p < 0; ++p) x *= 0.5f;
      v[b] = (b & 0x80) ? -x : x;
    }
  }
};
inline constexpr Fp8Table kE4M3(4);
inline constexpr Fp8Table kE5M2(5);
inline float to_float(fp8_e4m3 x) { return kE4M3.v[x.bits]; }
inline float to_float(fp8_e5m2 x) { return kE5M2.v[x.bits]; }

inline void store(float* dst, float x) { *dst = x; }
inline void store(uint16_t* dst, float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest even
  *dst = static_cast<uint16_t>(u >> 16);
}

#ifndef PAGELLM_VEC_WIDTH
#if defined(__AVX512F__)
#define PAGELLM_VEC_WIDTH 16
#else
#define PAGELLM_VEC_WIDTH 8
#endif
#endif

constexpr int VW = PAGELLM_VEC_WIDTH;
typedef float vf __attribute__((vector_size(VW * 4)));

inline vf loadv(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void storev(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

#if defined(__AVX512DQ__)
// 2^t as 2^floor(t) times a polynomial (coefficients from the highest power) of t - floor(t) in
// [0, 1): one vreduceps for the reduction, as vscalefps floors its exponent by itself.
template <int N>
inline __m512 exp2_floor_poly(__m512 t, const float (&c)[N]) {
  const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(c[0]);
  for (int i = 1; i < N; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
  return _mm512_scalef_ps(p, t);
}

// Lane sums of 16 vectors: lane j of the result sums v[j]'s lanes (45 shuffles and adds for the
// 16 rows of a block, where a horizontal sum per row took about 8 each).
inline __m512 sum_lanes16(const __m512* v) {
  __m512 a[8], b[4];
  for (int j = 0; j < 8; ++j)  // 128-bit lane q: v2j q0+q2, v2j+1 q0+q2, v2j q1+q3, v2j+1 q1+q3
    a[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]),
                         _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  for (int j = 0; j < 4; ++j) {  // 128-bit lane q: the sums over q of v4j .. v4j+3
    const __m512d x = _mm512_castps_pd(a[2 * j]), y = _mm512_castps_pd(a[2 * j + 1]);
    b[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88),
                                  _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88),
                                  _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xDD));
}
#endif

#if defined(__AVX512BW__) && defined(__AVX512VL__)
// 16 values (mask: those that exist) as fp32.
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
#endif

}  // namespace pagellm
