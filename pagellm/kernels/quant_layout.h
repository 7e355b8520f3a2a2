// The stored form of a quantized weight, shared by the kernels that read it (quant_linear.cpp,
// quant_tiles.cpp): the Layout of codes, scales, zeros and offsets described at the top of
// quant_linear.cpp, and the scalar helpers that read it.
#pragma once
#include <cstdint>
#include <cstring>

#include <immintrin.h>

namespace pagellm {

// fp16 -> fp32. Without F16C (or AVX512-FP16) GCC converts _Float16 through a libgcc call,
// which cost a Q4_1 decode step 2x: one conversion per group and row.
inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  _Float16 f;
  std::memcpy(&f, &h, 2);
  return static_cast<float>(f);
#endif
}

// What a weight byte codes: the decoders' template parameter.
enum Code { INT4, INT8, FP8_E4M3 };

constexpr float FP8_SCALE = 256.f;  // fp8 decoders give value / 256; scales carry the 256

// An E4M3 byte's value / 256 as fp16 bits.
inline uint16_t fp8_half_bits(uint8_t b) {
  return static_cast<uint16_t>(((b & 0x80) << 8) | ((b & 0x7F) << 7));
}

struct Layout {
  const uint8_t* q;        // [n][k * bits / 8]
  const void* scales;      // [n][groups], fp16 or fp32
  const void* offsets;     // [n][groups] like scales, or null
  const uint8_t* zeros;    // [n][groups], or null (then zero_const)
  int scale_half;          // 1: scales and offsets are fp16
  int zero_const;
  int bits;
  int fp8;                 // 1: the bytes are E4M3 codes (bits 8, zero 0, no offsets)
  int k;
  int group;
  // k / group, divided once: groups() is asked per row and group in the kernels' inner loops,
  // an integer division each time (30 layers of SmolLM2's shapes at one row on a Zen 4, ad-hoc:
  // FP8 8.9 -> 6.3 ms; Q4_1, Q8_0 and per-channel int8 within the noise).
  int n_groups = group > 0 ? k / group : 0;

  int groups() const { return n_groups; }
  int64_t row_bytes() const { return static_cast<int64_t>(k) * bits / 8; }
  // The decoders' scale: an fp8 decoder's values are a 256th of the codes'.
  float scale(int n, int g) const {
    const float s = value(scales, n, g);
    return fp8 ? s * FP8_SCALE : s;
  }
  float offset(int n, int g) const { return offsets ? value(offsets, n, g) : 0.f; }
  int zero(int n, int g) const {
    return zeros ? zeros[static_cast<int64_t>(n) * groups() + g] : zero_const;
  }
  float value(const void* p, int n, int g) const {
    const int64_t i = static_cast<int64_t>(n) * groups() + g;
    return scale_half ? half_to_float(static_cast<const uint16_t*>(p)[i])
                      : static_cast<const float*>(p)[i];
  }
};

#if defined(__AVX512BW__) && defined(__AVX512VL__)
inline __mmask16 group_mask16(const Layout& L, int g) {
  return static_cast<__mmask16>((1u << (L.groups() - g < 16 ? L.groups() - g : 16)) - 1);
}

// 16 group values (scales or offsets: fp16 or fp32) of row n from group g as floats, zeros past
// the row's groups.
inline __m512 group_values16(const Layout& L, const void* p, int n, int g) {
  const int64_t i = static_cast<int64_t>(n) * L.groups() + g;
  const __mmask16 m = group_mask16(L, g);
  if (L.scale_half)
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(p) + i));
  return _mm512_maskz_loadu_ps(m, static_cast<const float*>(p) + i);
}

// The zero points of row n's groups [g, g + 16) as floats (the constant where there are none).
inline __m512 group_zeros16(const Layout& L, int n, int g) {
  if (!L.zeros) return _mm512_set1_ps(static_cast<float>(L.zero_const));
  const int64_t i = static_cast<int64_t>(n) * L.groups() + g;
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(group_mask16(L, g), L.zeros + i)));
}
#endif

// Input c of a 4-bit row (blocks of 32 in 16 bytes: j low, j + 16 high).
inline int nibble(const uint8_t* row, int c) {
  return (row[(c >> 5) * 16 + (c & 15)] >> ((c & 16) ? 4 : 0)) & 15;
}

}  // namespace pagellm
