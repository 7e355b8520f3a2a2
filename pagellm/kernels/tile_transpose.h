// A 16 x 16 transpose of 32-bit elements in AVX-512 registers: the tile kernels use it to pack x
// into AMX B tiles (pairs or quads of inputs, VNNI order) and to turn C^T tiles back into rows.
#pragma once
#if defined(__AVX512F__)
#include <immintrin.h>

namespace pagellm {

// r[i][j] -> r[j][i] for 16 x 16 32-bit elements.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  __m512i u[16];  // u[4b + j], 128-bit lane l: rows 4b..4b+3 at column 4l + j
  for (int b = 0; b < 4; ++b) {
    u[4 * b + 0] = _mm512_unpacklo_epi64(t[4 * b], t[4 * b + 2]);
    u[4 * b + 1] = _mm512_unpackhi_epi64(t[4 * b], t[4 * b + 2]);
    u[4 * b + 2] = _mm512_unpacklo_epi64(t[4 * b + 1], t[4 * b + 3]);
    u[4 * b + 3] = _mm512_unpackhi_epi64(t[4 * b + 1], t[4 * b + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i s0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44);
    const __m512i s1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE);
    const __m512i s2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44);
    const __m512i s3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
    r[j] = _mm512_shuffle_i32x4(s0, s2, 0x88);
    r[4 + j] = _mm512_shuffle_i32x4(s0, s2, 0xDD);
    r[8 + j] = _mm512_shuffle_i32x4(s1, s3, 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(s1, s3, 0xDD);
  }
}

}  // namespace pagellm
#endif
