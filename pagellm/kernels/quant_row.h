// A few rows of bf16 x (decode steps of one to ten streams) against 4-bit weights
// (quant_layout.h) by 8-bit integer dot products: y = x W^T (+ bias), W read as stored, for
// groups of 32 or 64 inputs or a multiple of 128, on CPUs with AVX-512 VNNI.
//
// x is quantized on the fly, per weight group (the same 32 inputs as llama.cpp's Q8_0
// activations for Q4_0 / Q4_1; vLLM's CPU AWQ / GPTQ path, IPEX's WoqLowpMode.INT8, quantizes
// activations dynamically per token and input block in the same way): symmetric int8, scale
// max|x| / 127, rounded to nearest even. Then per group g, with codes q, zero point z, scale s,
// offset o and x's scale t:
//   sum_k w x = s t sum_k q x8 - z s t sum_k x8 + o sum_k x
// The first sum is exact in int32 (vpdpbusd: four u8 x s8 products a dword lane); the second and
// third are per group (x8's and x's group sums) and start the accumulators.
//
// A chunk is 128 inputs of a row, 64 bytes (four 32-input blocks of 16 bytes: input j in the low
// nibble of byte j, input j + 16 in the high one). One AND gives the 64 low codes as bytes, a
// shift and an AND the 64 high ones: two dot products with x8 laid out in the same order (per
// chunk, 64 bytes of the blocks' first halves, then 64 of their second). A dword lane p sums
// bytes 4p .. 4p + 3, all of block p / 4: a group of 32 or 64 inputs keeps to its own lanes,
// each scaled by its group's s t every chunk; a group of 128 or more sums in int32 over its
// chunks and is scaled once. A thread takes 16 rows of W at a time and sums their lanes together
// at the end (one transposing reduction, one vector store of 16 outputs).
//
// The CPU this was tuned on (a 2-core Xeon VM) runs about one 512-bit instruction a cycle, so
// the count of vector instructions a chunk is the cost: here 3 to decode and 2 dot products
// (and a conversion and a scaling for groups of 32 / 64), where bf16 dot products of decoded
// words (this file's previous form) took 8 to decode and 4 products.
// -DQR_NO_INT8_ROW builds without it (the register path of quant_linear.cpp takes the rows).
#pragma once
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && PAGELLM_VEC_WIDTH == 16 && !defined(QR_NO_INT8_ROW)
#define QR_INT8_ROW 1

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <immintrin.h>

#include "amx_common.h"
#include "cpu_common.h"
#include "quant_layout.h"

namespace pagellm {

constexpr int ROW_CHUNK = 128;  // inputs per 64 bytes of 4-bit codes
#ifndef QR_ROWS
#define QR_ROWS 4  // rows of W a pass over the rows of x
#endif
constexpr int QR_BLOCK = 16;  // rows of W a thread takes at a time
// Rows of x this path can take (more: quant_linear.cpp's register paths, or the bf16 tiles of
// quant_tiles.cpp where the CPU has bf16 products); row_max_rows says how many it does take.
#ifndef QR_MAX_X
#define QR_MAX_X 10
#endif

// 8-bit codes in Q8_0's form (signed, symmetric, groups of 32: GGUF's Q8_0, llama.cpp's Q8_0 x
// Q8_0 product) take the same products, 64 inputs a chunk in their natural order: each code
// byte XOR 0x80 is q + 128 as an unsigned byte, so sum q x8 = sum (q + 128) x8 - 128 sum x8, the
// 128 a zero point. Lanes 0-7 of a chunk's products are its first group, 8-15 its second.
inline bool row8_applies(const Layout& L) {
  return !L.fp8 && L.bits == 8 && L.group == 32 && L.zeros == nullptr && L.zero_const == 0 &&
         L.offsets == nullptr;
}

inline bool row_applies(const Layout& L) {
  return row8_applies(L) || (!L.fp8 && L.bits == 4 &&
                             (L.group == 32 || L.group == 64 || L.group % ROW_CHUNK == 0));
}

// The fewest rows of x this path takes for weights of this form: 8-bit codes from 2, 4-bit from
// 1. SmolLM2's 49152 x 576 Q8_0 LM head in the served model on a 2-core Zen 4 (ad-hoc, one
// build after the other): 2.6 -> 1.0 ms at 2 rows, 3.7 -> 2.2-2.8 at 4, 4.7 -> 2.7-3.4 at 6;
// at one row quant_linear.cpp's exact register path reads it at ~33 GB/s (0.95 ms), what this
// VM's memory gives, and this path was no faster (again after the span pass: 1.8 against 1.6).
inline int row_min_rows(const Layout& L) { return L.bits == 8 ? 2 : 1; }

// The most rows of x it takes. Each pair of rows of x costs its dot products and scaling a
// chunk, the decoding is shared, against the bf16 tiles' one decoding a call. On AMX, 30 layers
// of SmolLM2's shapes, two threads, on a Xeon: 1.18x / 1.21x the tiles at five rows (int4 /
// Q4_1), 1.10x / 1.06x at six, 0.89x / 0.79x at eight. Where the tiles are AVX-512 BF16 dot
// products (a 2-core Zen 4, the span pass, the best of five alternations): the same layers in
// Q4_1 at 7 / 8 / 9 / 10 / 11 / 12 rows took 0.79 / 0.87 / 0.92 / 0.96 / 1.01 / 1.11x the tiles'
// time, so 4-bit codes go to 10 rows there; the Q8_0 LM head at 6 / 7 rows 0.93 / 0.97x, and
// 8-bit codes keep six everywhere, as measured first.
inline int row_max_rows(const Layout& L) {
  const int most = best_bf16_path() == 1 && L.bits == 4 ? 10 : 6;
  return std::min(most, QR_MAX_X);
}

// One row of x (k inputs, groups of `group`) as int8 in chunk order [chunks][2][64] (dst zeroed
// by the caller), or in input order where `natural` (8-bit codes), with each group's scale, sum
// of int8 values and sum of x.
inline void quantize_x(const uint16_t* x, int k, int group, bool natural, int8_t* dst,
                       float* scale, float* qsum, float* sum) {
  const __m512 sign = _mm512_set1_ps(-0.f);
  for (int g = 0, g0 = 0; g0 < k; ++g, g0 += group) {
    __m512 top = _mm512_setzero_ps(), total = _mm512_setzero_ps();
    for (int c = g0; c < g0 + group; c += 16) {
      const __m512 v = load16(x + c, 0xFFFF);
      top = _mm512_max_ps(top, _mm512_andnot_ps(sign, v));
      total = _mm512_add_ps(total, v);
    }
    const float m = _mm512_reduce_max_ps(top);
    const __m512 inv = _mm512_set1_ps(m > 0.f ? 127.f / m : 0.f);
    scale[g] = m / 127.f;
    sum[g] = _mm512_reduce_add_ps(total);
    __m512i qs = _mm512_setzero_si512();
    for (int c = g0; c < g0 + group; c += 16) {
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x + c, 0xFFFF), inv));  // to nearest even
      qs = _mm512_add_epi32(qs, q);
      // inputs c .. c + 15: chunk c / 128, half (c % 32) / 16, block (c % 128) / 32
      int8_t* at = natural ? dst + c
                           : dst + (c / ROW_CHUNK) * 128 + ((c % 32) / 16) * 64 + ((c % ROW_CHUNK) / 32) * 16;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(at), _mm512_cvtsepi32_epi8(q));
    }
    qsum[g] = static_cast<float>(_mm512_reduce_add_epi32(qs));
  }
}

// A call's x: rows quantized [m][chunks][2][64] (or [m][2 * chunks][64] in input order for
// 8-bit codes; zeros past k) and per group [m][groups + 16]
// (zeros past the last) their scales, int8 sums and sums, in the calling thread's buffers (read
// by the OpenMP threads during the call).
struct RowCall {
  const Layout& L;
  const int8_t* xq;
  const float* scales;  // [3][m][groups_stride]: scale, int8 sum, sum
  int m, chunks, groups_stride;

  RowCall(const Layout& layout, const uint16_t* x, int rows)
      : L(layout), m(rows), chunks((layout.k + ROW_CHUNK - 1) / ROW_CHUNK),
        groups_stride(layout.groups() + 16) {
    thread_local std::vector<int8_t> xbuf;
    thread_local std::vector<float> gbuf;
    xbuf.assign(static_cast<size_t>(m) * chunks * 128, 0);
    gbuf.assign(static_cast<size_t>(3) * m * groups_stride, 0.f);
    for (int i = 0; i < m; ++i)
      quantize_x(x + static_cast<int64_t>(i) * L.k, L.k, L.group, L.bits == 8,
                 xbuf.data() + static_cast<size_t>(i) * chunks * 128,
                 gbuf.data() + static_cast<size_t>(i) * groups_stride,
                 gbuf.data() + static_cast<size_t>(m + i) * groups_stride,
                 gbuf.data() + static_cast<size_t>(2 * m + i) * groups_stride);
    xq = xbuf.data();
    scales = gbuf.data();
  }
  const int8_t* x_row(int i) const { return xq + static_cast<size_t>(i) * chunks * 128; }
  const float* x_scale(int i) const { return scales + static_cast<size_t>(i) * groups_stride; }
  const float* x_qsum(int i) const { return scales + static_cast<size_t>(m + i) * groups_stride; }
  const float* x_sum(int i) const { return scales + static_cast<size_t>(2 * m + i) * groups_stride; }
};

// Row n of W against every row of x: s[i] gets the groups' s t (for the chunk loop), and the
// returned vectors' lanes sum to the corrections o sum x - z s t sum x8 (zeros past the groups).
inline void row_prologue(const RowCall& call, int n, float* s, int x_stride, __m512* corr) {
  const Layout& L = call.L;
  for (int i = 0; i < call.m; ++i) corr[i] = _mm512_setzero_ps();
  for (int g = 0; g < L.groups(); g += 16) {
    const __m512 ws = group_values16(L, L.scales, n, g);
    const __m512 off = L.offsets ? group_values16(L, L.offsets, n, g) : _mm512_setzero_ps();
    const __m512 zero = group_zeros16(L, n, g);
    for (int i = 0; i < call.m; ++i) {
      const __m512 st = _mm512_mul_ps(ws, _mm512_loadu_ps(call.x_scale(i) + g));
      _mm512_storeu_ps(s + i * x_stride + g, st);
      const __m512 c = _mm512_fnmadd_ps(_mm512_mul_ps(zero, st), _mm512_loadu_ps(call.x_qsum(i) + g),
                                        _mm512_mul_ps(off, _mm512_loadu_ps(call.x_sum(i) + g)));
      corr[i] = _mm512_add_ps(corr[i], c);
    }
  }
}

// Lane p of a chunk's products sums inputs of block p / 4: its group, counted from the chunk's
// first, is p / 4 for groups of 32 inputs, p / 8 for 64.
template <int G>
inline __m512i lane_groups() {
  if constexpr (G == 32) return _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  return _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
}

// What a pass of dot_rows / span_rows reads: R rows of W from row n, M rows of x from x0 and
// their rows of s t ([x row][QR_BLOCK][stride] from s).
template <int M, int R>
struct PassRows {
  const uint8_t* w[R];
  const int8_t* x[M];
  const float* st[M];
  PassRows(const RowCall& call, int x0, int n, const float* s, int stride) {
    for (int r = 0; r < R; ++r) w[r] = call.L.q + (n + r) * call.L.row_bytes();
    for (int i = 0; i < M; ++i) {
      x[i] = call.x_row(x0 + i);
      st[i] = s + static_cast<size_t>(x0 + i) * QR_BLOCK * stride;
    }
  }
};

#ifndef QR_PREFETCH_ROWS
#define QR_PREFETCH_ROWS 8
#endif

// acc[i * QR_BLOCK + r] += row n + r of W times x row x0 + i, per lane (M rows of x, R of W), for
// groups of whole chunks (128 inputs or a multiple): their int32 sums are scaled once a group
// (s: the rows' s t, [x row][QR_BLOCK][stride] from row n). Each chunk of W is decoded once for
// the M rows of x, each chunk of x loaded once for the R rows of W.
template <int M, int R>
void dot_rows(const RowCall& call, int x0, int n, const float* s, int stride, __m512* a) {
  const Layout& L = call.L;
  const PassRows<M, R> p(call, x0, n, s, stride);
  __m512 acc[M][R];
  __m512i part[M][R];
  for (int i = 0; i < M; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = a[i * QR_BLOCK + r], part[i][r] = _mm512_setzero_si512();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const int per_group = L.group / ROW_CHUNK;
  for (int c = 0, g = 0; c < call.chunks; g = ++c / per_group) {
    __m512i xlo[M], xhi[M];
    for (int i = 0; i < M; ++i) {
      xlo[i] = _mm512_loadu_si512(p.x[i] + c * 128);
      xhi[i] = _mm512_loadu_si512(p.x[i] + c * 128 + 64);
    }
    for (int r = 0; r < R; ++r) {
      const __m512i b = _mm512_loadu_si512(p.w[r] + static_cast<int64_t>(c) * 64);
      const __m512i lo = _mm512_and_si512(b, low4);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), low4);
      for (int i = 0; i < M; ++i)
        part[i][r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(part[i][r], lo, xlo[i]), hi, xhi[i]);
    }
    if ((c + 1) % per_group == 0) {  // a group's last chunk: scale its sums
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < M; ++i) {
          acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(part[i][r]), _mm512_set1_ps(p.st[i][r * stride + g]), acc[i][r]);
          part[i][r] = _mm512_setzero_si512();
        }
    }
  }
  for (int i = 0; i < M; ++i)
    for (int r = 0; r < R; ++r) a[i * QR_BLOCK + r] = acc[i][r];
}

// Groups within a chunk (4-bit codes in groups of 32 or 64, 8-bit ones in Q8_0's form) go a span
// of 16 groups at a time: a row's 16 scales (and offsets, zero points) for the span are one
// vector, loaded once, and each chunk's lanes take their group's s t from the span's s t vector
// by one permutation. The corrections, o sum x - z s t sum x8, are products of span vectors too,
// added to the lanes once a span (the lanes are summed at the end). Nothing is stored between
// rows: the previous form wrote each row's s t and corrections to a scratch first, which on a
// Zen 4 cost a 576-input row more than its 4.5 chunks did.
template <int BITS, int G>
struct Span {
  static constexpr int inputs = BITS == 8 ? 64 : ROW_CHUNK;  // a chunk: 64 bytes of codes
  static constexpr int per_chunk = inputs / G;               // groups a chunk covers (2 or 4)
  static constexpr int chunks = 16 / per_chunk;              // chunks a span
};

// The products of row n + r of W (R rows) and x row x0 + i (M rows), per lane, into
// a[i * QR_BLOCK + r]. Codes are fetched QR_PREFETCH_ROWS rows ahead on the first pass over a
// slice (x0 0); later passes find them in L1 (the hardware's prefetch alone left a one-row step
// of a 49152 x 576 Q8_0 LM head at ~7 GB/s on a Zen 4).
template <int M, int R, int BITS, int G>
void span_rows(const RowCall& call, int x0, int n, __m512* a) {
  using S = Span<BITS, G>;
  const Layout& L = call.L;
  const int64_t row_bytes = L.row_bytes();
  const PassRows<M, R> p(call, x0, n, nullptr, 0);
  const int64_t ahead = x0 == 0 ? static_cast<int64_t>(QR_PREFETCH_ROWS) * row_bytes : 0;
  const bool offsets = L.offsets != nullptr;
  const bool zero = BITS == 8 || L.zeros != nullptr || L.zero_const != 0;
  const __m512i base = lane_groups<S::per_chunk == 4 ? 32 : 64>();
  const __m512i low4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const int whole = static_cast<int>(row_bytes / 64), chunks = static_cast<int>((row_bytes + 63) / 64);
  const __mmask64 tail = (__mmask64{1} << (row_bytes - whole * 64)) - 1;
  __m512 acc[M][R];
  for (int i = 0; i < M; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
  for (int g0 = 0, c0 = 0; c0 < chunks; g0 += 16, c0 += S::chunks) {
    __m512 st[M][R];
    for (int r = 0; r < R; ++r) {
      const __m512 sw = group_values16(L, L.scales, n + r, g0);
      const __m512 ow = offsets ? group_values16(L, L.offsets, n + r, g0) : _mm512_setzero_ps();
      const __m512 zs = zero ? _mm512_mul_ps(BITS == 8 ? _mm512_set1_ps(128.f) : group_zeros16(L, n + r, g0), sw)
                             : _mm512_setzero_ps();
      for (int i = 0; i < M; ++i) {
        const __m512 t = _mm512_loadu_ps(call.x_scale(x0 + i) + g0);
        st[i][r] = _mm512_mul_ps(sw, t);
        if (offsets) acc[i][r] = _mm512_fmadd_ps(ow, _mm512_loadu_ps(call.x_sum(x0 + i) + g0), acc[i][r]);
        if (zero) acc[i][r] = _mm512_fnmadd_ps(_mm512_mul_ps(zs, t), _mm512_loadu_ps(call.x_qsum(x0 + i) + g0), acc[i][r]);
      }
    }
    const int c_end = std::min(chunks, c0 + S::chunks);
    for (int c = c0; c < c_end; ++c) {
      const __m512i idx = _mm512_add_epi32(base, _mm512_set1_epi32((c - c0) * S::per_chunk));
      __m512i x1[M], x2[M];
      for (int i = 0; i < M; ++i) {
        x1[i] = _mm512_loadu_si512(p.x[i] + c * S::inputs);
        if constexpr (BITS == 4) x2[i] = _mm512_loadu_si512(p.x[i] + c * S::inputs + 64);
      }
      for (int r = 0; r < R; ++r) {
        const uint8_t* codes = p.w[r] + static_cast<int64_t>(c) * 64;
        if (ahead) _mm_prefetch(reinterpret_cast<const char*>(codes + ahead), _MM_HINT_T0);
        const __m512i b = c < whole ? _mm512_loadu_si512(codes) : _mm512_maskz_loadu_epi8(tail, codes);
        __m512i lo, hi;
        if constexpr (BITS == 4) {
          lo = _mm512_and_si512(b, low4);
          hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), low4);
        } else {
          lo = _mm512_xor_si512(b, flip);  // q + 128 as unsigned bytes
        }
        for (int i = 0; i < M; ++i) {
          __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, x1[i]);
          if constexpr (BITS == 4) d = _mm512_dpbusd_epi32(d, hi, x2[i]);
          acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_permutexvar_ps(idx, st[i][r]), acc[i][r]);
        }
      }
    }
  }
  for (int i = 0; i < M; ++i)
    for (int r = 0; r < R; ++r) a[i * QR_BLOCK + r] = acc[i][r];
}

// Rows [n0, n0 + rows) of W (rows <= QR_BLOCK) against every row of x: res[m][QR_BLOCK].
// G: 32 or 64 (4-bit codes), 8 (8-bit codes), 0 (groups of whole chunks).
template <int G>
void dot_range(const RowCall& call, int n0, int rows, float* res) {
  __m512 acc[QR_MAX_X * QR_BLOCK];
  const float* s = nullptr;
  int stride = 0;
  if constexpr (G == 0) {  // s t of each row and group, and the corrections, first
    stride = call.groups_stride;
    thread_local std::vector<float> consts;
    const size_t need = static_cast<size_t>(QR_MAX_X) * QR_BLOCK * stride;
    if (consts.size() < need) consts.resize(need);
    for (int r = 0; r < QR_BLOCK; ++r) {
      __m512 corr[QR_MAX_X];
      if (r < rows) {
        row_prologue(call, n0 + r, consts.data() + r * stride, QR_BLOCK * stride, corr);
      } else {
        for (int i = 0; i < call.m; ++i) corr[i] = _mm512_setzero_ps();
      }
      for (int i = 0; i < call.m; ++i) acc[i * QR_BLOCK + r] = corr[i];
    }
    s = consts.data();
  } else {
    for (int i = 0; i < call.m; ++i)
      for (int r = rows; r < QR_BLOCK; ++r) acc[i * QR_BLOCK + r] = _mm512_setzero_ps();
  }
  constexpr int R = QR_ROWS;
  int r0 = 0;
  auto pass = [&](auto rows_of_x, auto rows_of_w, int x0) {
    constexpr int MX = decltype(rows_of_x)::value, RW = decltype(rows_of_w)::value;
    __m512* a = acc + x0 * QR_BLOCK + r0;
    if constexpr (G == 0)
      dot_rows<MX, RW>(call, x0, n0 + r0, s + r0 * stride, stride, a);
    else if constexpr (G == 8)
      span_rows<MX, RW, 8, 32>(call, x0, n0 + r0, a);
    else
      span_rows<MX, RW, 4, G>(call, x0, n0 + r0, a);
  };
  auto rows_of_x = [&](auto rows_of_w) {
    int x0 = 0;
    for (; x0 + 2 <= call.m; x0 += 2) pass(std::integral_constant<int, 2>{}, rows_of_w, x0);
    if (x0 < call.m) pass(std::integral_constant<int, 1>{}, rows_of_w, x0);
  };
  for (; r0 + R <= rows; r0 += R) rows_of_x(std::integral_constant<int, R>{});
  for (; r0 < rows; ++r0) rows_of_x(std::integral_constant<int, 1>{});
  for (int i = 0; i < call.m; ++i) _mm512_storeu_ps(res + i * QR_BLOCK, sum_lanes16(acc + i * QR_BLOCK));
}

// 16 values (mask: those that exist) stored as fp32, or as bf16 rounded to nearest even (by hand:
// a CPU with VNNI may lack AVX-512 BF16's conversion, e.g. Ice Lake).
inline void store16(float* p, __mmask16 m, __m512 v) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(uint16_t* p, __mmask16 m, __m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i rounded = _mm512_add_epi32(
      u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

// y = x W^T (+ bias) for m rows of bf16 x, output features split over the threads.
template <int G, typename T>
void int8_rows_linear_g(const RowCall& call, const T* bias, T* out, int n_out, int threads) {
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
void int8_rows_linear(const Layout& L, const uint16_t* x, const T* bias, T* out, int m,
                      int n_out, int threads) {
  const RowCall call(L, x, m);
  if (L.bits == 8) return int8_rows_linear_g<8>(call, bias, out, n_out, threads);  // row8_applies
  if (L.group == 32) return int8_rows_linear_g<32>(call, bias, out, n_out, threads);
  if (L.group == 64) return int8_rows_linear_g<64>(call, bias, out, n_out, threads);
  int8_rows_linear_g<0>(call, bias, out, n_out, threads);
}

}  // namespace pagellm
#endif
