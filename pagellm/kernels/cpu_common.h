// What the CPU kernels share: bf16 <-> fp32 conversion and the vector width of the GCC vector
// types. The vector width is set at build time from the CPU (-march=native): 16 floats with
// AVX-512, 8 otherwise; PAGELLM_VEC_WIDTH overrides it (tests build both widths on one machine:
// GCC lowers a 16-wide vector to two 8-wide ones where AVX-512 is missing).
#pragma once
#include <cstdint>
#include <cstring>

namespace pagellm {

inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {  // bf16 -> fp32: the bits move up 16 places
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
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

}  // namespace pagellm
