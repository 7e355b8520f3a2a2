// One or two rows of bf16 x (decode steps of one or two streams) against 4-bit weights
// (quant_layout.h) on CPUs with bf16 products: y = x W^T (+ bias), W read as stored, for groups
// of 32 or 64 inputs or a multiple of 128.
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
// more sums unscaled and is scaled once. A thread takes 16 rows of W at a time; each row's
// accumulators start from its corrections, and the 16 rows' lanes are summed together at the
// end (one transposing reduction, and one vector store of 16 outputs).
// The CPU this was tuned on (a 2-core Xeon VM) runs about one 512-bit instruction a cycle, so
// the count of vector instructions a chunk is the cost: four dot products, four shifts, four
// vpternlogs and the group scaling. Measured (30 layers of SmolLM2's four shapes, two threads,
// in turn with the register path): at one row Q4_1 1.22x and online int4 1.0x first; with the
// 16-row blocks (per-row horizontal sums, prologue branches and repeated x loads gone) 1.1x
// (groups of 128) to 1.5x (groups of 64) over that, and at two rows 1.13x (int4) / 1.38x (Q4_1)
// the register path.
// (AMX was tried: with one row of x a tile product leaves 15 of C's 16 columns idle, and on the
// Xeon measured a 16-row tile load took ~7 ns and a product ~10, so decoded A tiles ran at the
// register path's speed.)
// -DQR_NO_BF16_ROW builds without it (the register path of quant_linear.cpp takes the row).
#pragma once
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && PAGELLM_VEC_WIDTH == 16 && !defined(QR_NO_BF16_ROW)
#define QR_BF16_ROW 1

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include <immintrin.h>

#include "cpu_common.h"
#include "quant_layout.h"

namespace pagellm {

constexpr int ROW_CHUNK = 128;      // inputs per 64 bytes of 4-bit codes
constexpr float ROW_BIAS = 16.f;    // what a decoded word adds to its code
#ifndef QR_ROWS
#define QR_ROWS 4  // rows of W a pass over one row of x
#endif
constexpr int QR_BLOCK = 16;  // rows of W a thread takes at a time
// Rows of x this path takes (more: quant_linear.cpp's register paths, which multiply fp32).
// Each row of x costs its four dot products a chunk: at three or more rows that is more than
// the register path's fp32 products of weights decoded once (Xeon, 30 layers of SmolLM2's
// shapes, with the 16-row blocks: 0.88x int4 / 1.07x Q4_1 at 3, 0.83x / 1.0x at 4; at 2 rows
// 1.13x / 1.38x).
#ifndef QR_MAX_X
#define QR_MAX_X 2
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

// Scales of row n's groups [g, g + 16) and their corrections offset - (zero + 16) * scale
// (zeros past the row's groups).
inline void row_group_consts(const Layout& L, int n, int g, __m512& s, __m512& cv) {
  s = group_values16(L, L.scales, n, g);
  const __m512 off = L.offsets ? group_values16(L, L.offsets, n, g) : _mm512_setzero_ps();
  const __m512 zero = group_zeros16(L, n, g);
  cv = _mm512_fnmadd_ps(_mm512_add_ps(zero, _mm512_set1_ps(ROW_BIAS)), s, off);
}

// For code vector t, word w's input within its pair of 32-input blocks (row_input mod 64): the
// index of a two-source word permute.
struct RowOrderIndex {
  alignas(64) uint16_t v[4][32];
  constexpr RowOrderIndex() : v() {
    for (int t = 0; t < 4; ++t)
      for (int w = 0; w < 32; ++w) v[t][w] = static_cast<uint16_t>(row_input(t, w) % 64);
  }
};
inline constexpr RowOrderIndex kRowOrder{};

// A row of x (k inputs) in row order, [chunks][4][32], zeros past k: per chunk, code vector t's
// words come eight from each 32-input block, two two-source permutes and a blend.
inline void to_row_order(const uint16_t* x, int k, uint16_t* dst) {
  for (int base = 0; base < k; base += ROW_CHUNK) {
    __m512i v[4];
    for (int j = 0; j < 4; ++j) {
      const int left = std::max(0, std::min(32, k - base - 32 * j));
      const __mmask32 m = left == 32 ? ~__mmask32{0} : (__mmask32{1} << left) - 1;
      v[j] = _mm512_maskz_loadu_epi16(m, x + base + 32 * j);
    }
    for (int t = 0; t < 4; ++t) {
      const __m512i idx = _mm512_load_si512(kRowOrder.v[t]);
      const __m512i low = _mm512_permutex2var_epi16(v[0], idx, v[1]);   // words 0-15
      const __m512i high = _mm512_permutex2var_epi16(v[2], idx, v[3]);  // words 16-31
      _mm512_storeu_si512(dst + base + 32 * t, _mm512_mask_blend_epi16(0xFFFF0000u, low, high));
    }
  }
}

// A call's x: rows in row order [m][chunks][4][32] (zeros past k), their group sums
// [m][groups + 16] (zeros past the last), in the calling thread's buffers (read by the OpenMP
// threads during the call).
struct RowCall {
  const Layout& L;
  const uint16_t* xp;
  const float* sums;
  int m, chunks, groups_stride;

  RowCall(const Layout& layout, const uint16_t* x, int rows)
      : L(layout), m(rows), chunks((layout.k + ROW_CHUNK - 1) / ROW_CHUNK),
        groups_stride(layout.groups() + 16) {
    thread_local std::vector<uint16_t> xbuf;
    thread_local std::vector<float> sbuf;
    const int k = L.k;
    xbuf.resize(static_cast<size_t>(m) * chunks * ROW_CHUNK);
    sbuf.assign(static_cast<size_t>(m) * groups_stride, 0.f);
    for (int i = 0; i < m; ++i) {
      const uint16_t* xi = x + static_cast<int64_t>(i) * k;
      to_row_order(xi, k, xbuf.data() + static_cast<int64_t>(i) * chunks * ROW_CHUNK);
      for (int g = 0; g < L.groups(); ++g)
        for (int c = g * L.group; c < (g + 1) * L.group; ++c)
          sbuf[static_cast<size_t>(i) * groups_stride + g] += to_float(xi[c]);
    }
    xp = xbuf.data();
    sums = sbuf.data();
  }
  const uint16_t* x_row(int i) const { return xp + static_cast<int64_t>(i) * chunks * ROW_CHUNK; }
  const float* sums_row(int i) const { return sums + static_cast<int64_t>(i) * groups_stride; }
};

// Row n's group scales and corrections into s and cv [groups + 16] (zeros past the last).
inline void row_prologue(const Layout& L, int n, float* s, float* cv) {
  for (int g = 0; g < L.groups(); g += 16) {
    __m512 sv, cvv;
    row_group_consts(L, n, g, sv, cvv);
    _mm512_storeu_ps(s + g, sv);
    _mm512_storeu_ps(cv + g, cvv);
  }
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

// sum (16 + q) x over a chunk, per lane: codes w, x's four vectors xv.
inline __m512 chunk_dot(const __m512i* w, const __m512bh* xv) {
  const __m512 lo = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)w[0], xv[0]), (__m512bh)w[1], xv[1]);
  const __m512 hi = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)w[2], xv[2]), (__m512bh)w[3], xv[3]);
  return _mm512_add_ps(lo, hi);
}

// Lane p of a chunk's products sums inputs of block p / 4: its group, counted from the chunk's
// first, is p / 4 for groups of 32 inputs, p / 8 for 64.
template <int G>
inline __m512i lane_groups() {
  if constexpr (G == 32) return _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  return _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
}

// acc[i * QR_BLOCK + r] += row n + r of W times x row x0 + i, per lane (M rows of x, R of W); s:
// the rows' scales (stride apart). G: 32 or 64, groups within a chunk, each lane scaled by its
// own group's scale every chunk; 0, groups of whole chunks, their sums scaled once a group. Each
// chunk of W is decoded once for the M rows of x, each chunk of x loaded once for the R rows of W.
template <int M, int R, int G>
void dot_rows(const RowCall& call, int x0, int n, const float* s, int stride, __m512* a) {
  const Layout& L = call.L;
  const int64_t row_bytes = L.row_bytes();
  const uint8_t* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = L.q + (n + r) * row_bytes;
  const uint16_t* xs[M];
  for (int i = 0; i < M; ++i) xs[i] = call.x_row(x0 + i);
  __m512 acc[M][R], part[M][R];
  for (int i = 0; i < M; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = a[i * QR_BLOCK + r], part[i][r] = _mm512_setzero_ps();
  const int whole = L.k / ROW_CHUNK;  // the last chunk may be part of one (G 32 or 64 only)
  const __mmask64 tail_mask = (__mmask64{1} << (row_bytes - whole * 64)) - 1;
  const int per_group = G == 0 ? L.group / ROW_CHUNK : 1;
  int left_in_group = per_group;
  auto chunk = [&](int c, bool tail) {
    __m512bh xv[M][4];
    for (int i = 0; i < M; ++i)
      for (int t = 0; t < 4; ++t)
        xv[i][t] = (__m512bh)_mm512_loadu_si512(xs[i] + c * ROW_CHUNK + 32 * t);
    for (int r = 0; r < R; ++r) {
      const uint8_t* p = rows[r] + static_cast<int64_t>(c) * 64;
      const __m512i b = tail ? _mm512_maskz_loadu_epi8(tail_mask, p) : _mm512_loadu_si512(p);
      const __m512i w[4] = {row_codes<0>(b), row_codes<1>(b), row_codes<2>(b), row_codes<3>(b)};
      if constexpr (G != 0) {
        const __m512 sv = _mm512_permutexvar_ps(lane_groups<G>(), _mm512_loadu_ps(s + r * stride + c * (ROW_CHUNK / G)));
        for (int i = 0; i < M; ++i) acc[i][r] = _mm512_fmadd_ps(chunk_dot(w, xv[i]), sv, acc[i][r]);
      } else {
        for (int i = 0; i < M; ++i) part[i][r] = _mm512_add_ps(part[i][r], chunk_dot(w, xv[i]));
      }
    }
    if constexpr (G == 0) {
      if (--left_in_group == 0) {  // a group's last chunk: scale its sums
        const int g = c / per_group;
        for (int r = 0; r < R; ++r) {
          const __m512 sv = _mm512_set1_ps(s[r * stride + g]);
          for (int i = 0; i < M; ++i) {
            acc[i][r] = _mm512_fmadd_ps(part[i][r], sv, acc[i][r]);
            part[i][r] = _mm512_setzero_ps();
          }
        }
        left_in_group = per_group;
      }
    }
  };
  for (int c = 0; c < whole; ++c) chunk(c, false);
  if (whole < call.chunks) chunk(whole, true);
  for (int i = 0; i < M; ++i)
    for (int r = 0; r < R; ++r) a[i * QR_BLOCK + r] = acc[i][r];
}

// Rows [n0, n0 + rows) of W (rows <= QR_BLOCK) against every row of x: res[m][QR_BLOCK], each
// row's accumulators starting from its corrections (cv x the groups' x sums: the lanes sum to
// the zero points', offsets' and the decoder's 16's share) and summed across lanes 16 rows at
// once.
template <int G>
void dot_range(const RowCall& call, int n0, int rows, float* res) {
  const int stride = call.groups_stride;
  thread_local std::vector<float> consts;
  if (consts.size() < static_cast<size_t>(2 * QR_BLOCK) * stride) consts.resize(static_cast<size_t>(2 * QR_BLOCK) * stride);
  float* s = consts.data();
  float* cv = s + QR_BLOCK * stride;
  for (int r = 0; r < rows; ++r) row_prologue(call.L, n0 + r, s + r * stride, cv + r * stride);
  __m512 acc[QR_MAX_X * QR_BLOCK];
  for (int i = 0; i < call.m; ++i) {
    const float* xsum = call.sums_row(i);
    for (int r = 0; r < QR_BLOCK; ++r) {
      __m512 v = _mm512_setzero_ps();
      for (int g = 0; r < rows && g < call.L.groups(); g += 16)
        v = _mm512_fmadd_ps(_mm512_loadu_ps(cv + r * stride + g), _mm512_loadu_ps(xsum + g), v);
      acc[i * QR_BLOCK + r] = v;
    }
  }
  constexpr int R = QR_ROWS;
  int r0 = 0;
  auto rows_of_x = [&](auto rows_of_w) {
    constexpr int RW = decltype(rows_of_w)::value;
    int x0 = 0;
    for (; x0 + 2 <= call.m; x0 += 2)
      dot_rows<2, RW, G>(call, x0, n0 + r0, s + r0 * stride, stride, acc + x0 * QR_BLOCK + r0);
    if (x0 < call.m)
      dot_rows<1, RW, G>(call, x0, n0 + r0, s + r0 * stride, stride, acc + x0 * QR_BLOCK + r0);
  };
  for (; r0 + R <= rows; r0 += R) rows_of_x(std::integral_constant<int, R>{});
  for (; r0 < rows; ++r0) rows_of_x(std::integral_constant<int, 1>{});
  for (int i = 0; i < call.m; ++i) _mm512_storeu_ps(res + i * QR_BLOCK, sum_lanes16(acc + i * QR_BLOCK));
}

// 16 values (mask: those that exist) as fp32, and back.
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline void store16(float* p, __mmask16 m, __m512 v) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(uint16_t* p, __mmask16 m, __m512 v) {  // round to nearest even
  _mm256_mask_storeu_epi16(p, m, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}

// y = x W^T (+ bias) for m rows of bf16 x, output features split over the threads.
template <int G, typename T>
void bf16_rows_linear_g(const RowCall& call, const T* bias, T* out, int n_out, int threads) {
  const int m = call.m;
  const int blocks = (n_out + QR_BLOCK - 1) / QR_BLOCK;
#pragma omp parallel num_threads(threads)
  {
    alignas(64) float res[QR_MAX_X * QR_BLOCK];
#pragma omp for schedule(static)
    for (int blk = 0; blk < blocks; ++blk) {
      const int n0 = blk * QR_BLOCK, rows = std::min(QR_BLOCK, n_out - n0);
      const __mmask16 mask = static_cast<__mmask16>((1u << rows) - 1);
      dot_range<G>(call, n0, rows, res);
      const __m512 b = bias ? load16(bias + n0, mask) : _mm512_setzero_ps();
      for (int i = 0; i < m; ++i)
        store16(out + static_cast<int64_t>(i) * n_out + n0, mask,
                _mm512_add_ps(_mm512_load_ps(res + i * QR_BLOCK), b));
    }
  }
}

template <typename T>
void bf16_rows_linear(const Layout& L, const uint16_t* x, const T* bias, T* out, int m,
                      int n_out, int threads) {
  const RowCall call(L, x, m);
  if (L.group == 32) return bf16_rows_linear_g<32>(call, bias, out, n_out, threads);
  if (L.group == 64) return bf16_rows_linear_g<64>(call, bias, out, n_out, threads);
  bf16_rows_linear_g<0>(call, bias, out, n_out, threads);
}

}  // namespace pagellm
#endif
