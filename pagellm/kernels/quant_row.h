// One row of bf16 x (a one-stream decode step) against 4-bit weights (quant_layout.h) on CPUs
// with bf16 products: y = x W^T (+ bias), W read as stored, for groups of 32 or 64 inputs or a
// multiple of 128.
//
// Decoding. A chunk is 128 inputs of a row, 64 bytes (four 32-input blocks). Each 16-bit word of
// it holds four codes, at bits 0-3, 4-7, 8-11 and 12-15: inputs j, j + 16, j + 1 and j + 17 of
// block word / 8, j = 2 * (word % 8). One shift puts a code at bits 3-6 and one vpternlog masks
// it and sets the exponent of 16: the word is then the bf16 of 16 + q, exactly. So a chunk is
// four vectors of 32 bf16 weights for two instructions each, with no widening or conversion; x
// is permuted into that order once per call, and the 16 comes off through x's group sums with
// the zero point and the offset:
//   sum_k w x = sum_g [ scale_g * sum_{k in g} (16 + q) x + (offset_g - (zero_g + 16) * scale_g) * sum_{k in g} x ]
// (the exponent of 128 would take a code without a shift; 16 keeps the part that cancels 8x
// smaller). Products of bf16 values are exact in fp32 and accumulate in fp32.
//
// A product's dword lane p sums words 2p and 2p + 1, both of block p / 4: a group of 32 or 64
// inputs keeps to its own lanes, so each lane is scaled by its group's scale; a group of 128 or
// more sums unscaled and is scaled once.
// Measured (Xeon, 30 layers of SmolLM2's shapes, one row, two threads, in turn with the register
// path): Q4_1 gate_up 62 against 80 us (1.29x), int4 g64 55 against 59, int4 g128 down 25.5
// against 27.3; a one-stream step of the GGUF Q4_1 model ~1.2x faster.
// (AMX was tried: with one row of x a tile product leaves 15 of C's 16 columns idle, and on the
// Xeon measured a 16-row tile load took ~7 ns and a product ~10, so decoded A tiles ran at the
// register path's speed.)
// -DQR_NO_BF16_ROW builds without it (the register path of quant_linear.cpp takes the row).
#pragma once
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && PAGELLM_VEC_WIDTH == 16 && !defined(QR_NO_BF16_ROW)
#define QR_BF16_ROW 1

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <immintrin.h>

#include "cpu_common.h"
#include "quant_layout.h"

namespace pagellm {

constexpr int ROW_CHUNK = 128;      // inputs per 64 bytes of 4-bit codes
constexpr float ROW_BIAS = 16.f;    // what a decoded word adds to its code
#ifndef QR_ROWS
#define QR_ROWS 4  // rows of W a pass over x
#endif

inline bool row_applies(const Layout& L) {
  return !L.fp8 && L.bits == 4 &&
         (L.group == 32 || L.group == 64 || L.group % ROW_CHUNK == 0);
}

constexpr int row_input(int t, int word) {  // the chunk input that code vector t has at word
  return 32 * (word / 8) + 2 * (word % 8) + (t & 1) * 16 + (t >> 1);
}

// Code vector t (0-3) of a 64-byte chunk: bf16 words of 16 + q.
template <int T>
inline __m512i row_codes(__m512i b) {
  const __m512i keep = _mm512_set1_epi16(0x78), exponent = _mm512_set1_epi16(0x4180);  // 16.0
  const __m512i at3 = T == 0 ? _mm512_slli_epi16(b, 3) : _mm512_srli_epi16(b, 4 * T - 3);
  return _mm512_ternarylogic_epi32(at3, keep, exponent, 0xEA);  // (at3 & keep) | exponent
}

// The 64 bytes of chunk c of a row (masked past the row's end: the row may be the tensor's last).
inline __m512i row_chunk(const uint8_t* row, int64_t row_bytes, int c) {
  const int64_t left = row_bytes - static_cast<int64_t>(c) * 64;
  const __mmask64 m = left >= 64 ? ~__mmask64{0} : (__mmask64{1} << left) - 1;
  return _mm512_maskz_loadu_epi8(m, row + static_cast<int64_t>(c) * 64);
}

// 16 group values (fp16 or fp32) of row n from group g, zeros past the row's groups.
inline __m512 row_group_values(const Layout& L, const void* p, int n, int g) {
  const int64_t i = static_cast<int64_t>(n) * L.groups() + g;
  const __mmask16 m = static_cast<__mmask16>((1u << std::min(16, L.groups() - g)) - 1);
  if (L.scale_half)
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(p) + i));
  return _mm512_maskz_loadu_ps(m, static_cast<const float*>(p) + i);
}

// Scales of row n's groups [g, g + 16) and their corrections offset - (zero + 16) * scale
// (zeros past the row's groups).
inline void row_group_consts(const Layout& L, int n, int g, __m512& s, __m512& cv) {
  s = row_group_values(L, L.scales, n, g);
  const __m512 off = L.offsets ? row_group_values(L, L.offsets, n, g) : _mm512_setzero_ps();
  __m512 zero = _mm512_set1_ps(static_cast<float>(L.zero_const));
  if (L.zeros) {
    const __mmask16 m = static_cast<__mmask16>((1u << std::min(16, L.groups() - g)) - 1);
    const int64_t i = static_cast<int64_t>(n) * L.groups() + g;
    zero = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, L.zeros + i)));
  }
  cv = _mm512_fnmadd_ps(_mm512_add_ps(zero, _mm512_set1_ps(ROW_BIAS)), s, off);
}

// x's sum over each group (16 zeros past the last).
inline std::vector<float> group_sums(const uint16_t* x, const Layout& L) {
  std::vector<float> sums(L.groups() + 16, 0.f);
  for (int g = 0; g < L.groups(); ++g)
    for (int c = g * L.group; c < (g + 1) * L.group; ++c) sums[g] += to_float(x[c]);
  return sums;
}

// x permuted into the code vectors' order, [chunks][4][32], zeros past k.
inline std::vector<uint16_t> row_order(const uint16_t* x, int k) {
  const int chunks = (k + ROW_CHUNK - 1) / ROW_CHUNK;
  std::vector<uint16_t> xp(static_cast<size_t>(chunks) * ROW_CHUNK, 0);
  for (int base = 0; base < k; base += ROW_CHUNK)
    for (int t = 0; t < 4; ++t)
      for (int i = 0; i < 32; ++i)
        if (base + row_input(t, i) < k) xp[base + t * 32 + i] = x[base + row_input(t, i)];
  return xp;
}

struct RowCall {
  const Layout& L;
  const uint16_t* xp;  // x in row order (row_order)
  const float* sums;   // x's group sums (group_sums)
  int chunks;
};

// Row n's group scales into s[0, groups + 16) (zeros past the last) and its correction sum_g
// (offset_g - (zero_g + 16) * scale_g) * xsum_g.
inline float row_prologue(const RowCall& call, int n, float* s) {
  __m512 corr = _mm512_setzero_ps();
  for (int g = 0; g < call.L.groups(); g += 16) {
    __m512 sv, cv;
    row_group_consts(call.L, n, g, sv, cv);
    _mm512_storeu_ps(s + g, sv);
    corr = _mm512_fmadd_ps(cv, _mm512_loadu_ps(call.sums + g), corr);
  }
  return _mm512_reduce_add_ps(corr);
}

// sum (16 + q) x over chunk c of a row (x: the chunk's four vectors), per lane.
inline __m512 chunk_dot(const uint8_t* row, int64_t row_bytes, int c, const __m512bh* xv) {
  const __m512i b = row_chunk(row, row_bytes, c);
  const __m512 lo = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)row_codes<0>(b), xv[0]), (__m512bh)row_codes<1>(b), xv[1]);
  const __m512 hi = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)row_codes<2>(b), xv[2]), (__m512bh)row_codes<3>(b), xv[3]);
  return _mm512_add_ps(lo, hi);
}

// out[r] = rows n.. n + R of W times x, less their corrections; s: the rows' scales (stride).
template <int R>
void dot_rows(const RowCall& call, int n, const float* s, int stride, float* out) {
  const Layout& L = call.L;
  const uint8_t* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = L.q + (n + r) * L.row_bytes();
  // lane p's group within its chunk: p / 4 (groups of 32 inputs) or p / 8 (64)
  const __m512i lane_group = L.group == 32
                                 ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
                                 : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const int per_group = L.group / ROW_CHUNK;  // chunks a group (0: groups of 32 or 64)
  __m512 acc[R], part[R];
  for (int r = 0; r < R; ++r) acc[r] = part[r] = _mm512_setzero_ps();
  for (int c = 0; c < call.chunks; ++c) {
    __m512bh xv[4];
    for (int t = 0; t < 4; ++t)
      xv[t] = (__m512bh)_mm512_loadu_si512(call.xp + c * ROW_CHUNK + 32 * t);
    if (per_group == 0) {
      const int g = c * (ROW_CHUNK / L.group);
      for (int r = 0; r < R; ++r) {
        const __m512 sv = _mm512_permutexvar_ps(lane_group, _mm512_loadu_ps(s + r * stride + g));
        acc[r] = _mm512_fmadd_ps(chunk_dot(rows[r], L.row_bytes(), c, xv), sv, acc[r]);
      }
    } else {
      for (int r = 0; r < R; ++r) part[r] = _mm512_add_ps(part[r], chunk_dot(rows[r], L.row_bytes(), c, xv));
      if ((c + 1) % per_group == 0) {  // a group's last chunk
        const int g = c / per_group;
        for (int r = 0; r < R; ++r) {
          acc[r] = _mm512_fmadd_ps(part[r], _mm512_set1_ps(s[r * stride + g]), acc[r]);
          part[r] = _mm512_setzero_ps();
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}

// Rows [n0, n1) of x W^T into res[0..].
inline void dot_range(const RowCall& call, int n0, int n1, float* res) {
  constexpr int R = QR_ROWS;
  const int stride = call.L.groups() + 16;
  thread_local std::vector<float> scales;
  if (static_cast<int>(scales.size()) < R * stride) scales.resize(static_cast<size_t>(R) * stride);
  float corr[R];
  for (int n = n0; n < n1; n += R) {
    const int rows = std::min(R, n1 - n);
    for (int r = 0; r < rows; ++r) corr[r] = row_prologue(call, n + r, scales.data() + r * stride);
    if (rows == R) {
      dot_rows<R>(call, n, scales.data(), stride, res + (n - n0));
    } else {
      for (int r = 0; r < rows; ++r) dot_rows<1>(call, n + r, scales.data() + r * stride, stride, res + (n - n0) + r);
    }
    for (int r = 0; r < rows; ++r) res[n - n0 + r] += corr[r];
  }
}

// y = x W^T (+ bias) for one row of bf16 x, output features split over the threads.
template <typename T>
void bf16_row_linear(const Layout& L, const uint16_t* x, const T* bias, T* out, int n_out,
                     int threads) {
  const std::vector<uint16_t> xp = row_order(x, L.k);
  const std::vector<float> sums = group_sums(x, L);
  const RowCall call{L, xp.data(), sums.data(), (L.k + ROW_CHUNK - 1) / ROW_CHUNK};
  constexpr int SLICE = 4 * QR_ROWS;
  const int slices = (n_out + SLICE - 1) / SLICE;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int slice = 0; slice < slices; ++slice) {
    float res[SLICE];
    const int n0 = slice * SLICE, n1 = std::min(n_out, n0 + SLICE);
    dot_range(call, n0, n1, res);
    for (int n = n0; n < n1; ++n) store(out + n, res[n - n0] + (bias ? to_float(bias[n]) : 0.f));
  }
}

}  // namespace pagellm
#endif
