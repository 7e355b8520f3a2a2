// Linear layers over weights kept quantized: 8-bit (signed) or 4-bit (unsigned, two per byte)
// integers in groups along K, each group with a scale, a zero point and an optional offset:
//
//     w[n][k] = (q[n][k] - zero[n][g]) * scale[n][g] + offset[n][g]      g = k / group
//
// That one form holds every format pagellm loads: GGUF Q8_0 (zero 0) / Q4_0 (zero 8) / Q4_1
// (offset = min), AWQ and GPTQ (integer zeros per group), symmetric int8/int4 (zero 0 / 8).
// FP8 weights are the same form with float codes: each byte an E4M3 (float8_e4m3fn) value,
// zero 0, no offset. A byte's fp16 bits are the byte with its exponent and mantissa moved up 3
// places (and the sign up 8): E4M3's exponent bias is 7, fp16's 15, so that half is the value
// times 2^-8 exactly, subnormals included. The decoders produce value / 256 (F16C converts
// eight at a time) and the 256 is folded into every scale; (value / 256) * (scale * 256)
// rounds once, as value * scale does. The NaN codes 0x7F / 0xFF decode as +-480: loaders
// refuse them.
// Scales and offsets are fp16 (as the checkpoints store them) or fp32; zeros are one byte per
// group or one constant. A 4-bit row is blocks of 32 inputs in 16 bytes, GGUF's order: byte j
// of a block holds input j in its low nibble and input j + 16 in its high one, so eight inputs
// are eight consecutive bytes, widened and shifted (not gathered from a word).
//
// quant_linear: y = x W^T (+ bias) for at most 32 rows of x (decode steps). The weights are
// decoded in registers (never written out), RW output rows at a time against XB rows of x, and
// the output features are split over torch's OpenMP pool: each thread streams its rows of W
// once for every token, so a step reads 1 or 0.5 bytes per weight instead of 4.
// A few rows of bf16 x against 4-bit codes (and 8-bit ones in Q8_0's form) go to quant_row.h where the CPU has AVX-512
// VNNI: x quantized to int8 per weight group, integer dot products.
// quant_dequantize: rows [row0, row0 + rows) of W into fp32, for the large-batch path, which
// decodes a panel that fits in cache and hands it to torch's GEMM (the decode is paid once for
// all the rows of x), and for the tests' comparison with each format's reference.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <immintrin.h>

#include "cpu_common.h"
#include "quant_layout.h"
#include "quant_row.h"
#include "packed_call.h"

namespace {

using namespace pagellm;

typedef int32_t vi __attribute__((vector_size(VW * 4)));
typedef uint32_t vu __attribute__((vector_size(VW * 4)));
typedef int8_t vi8 __attribute__((vector_size(VW)));

// value / 256 of every E4M3 byte, built once when the library loads (the portable decoder).
struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) v[b] = half_to_float(fp8_half_bits(static_cast<uint8_t>(b)));
  }
};
const Fp8Table kFp8;

template <Code C>
inline float decode1(const uint8_t* row, int c) {
  if constexpr (C == INT8) return static_cast<float>(static_cast<int8_t>(row[c]));
  if constexpr (C == INT4) return static_cast<float>(nibble(row, c));
  return kFp8.v[row[c]];
}

#if defined(__AVX2__) && defined(__F16C__)
#define QL_AVX2_DECODE 1
// Eight codes from column c of a row, as floats (fp8: value / 256).
template <Code C>
inline __m256 decode8(const uint8_t* row, int c) {
  if constexpr (C == FP8_E4M3) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c));
    return _mm256_cvtph_ps(e4m3_half_bits8(bytes));
  }
  __m256i v;
  if constexpr (C == INT8) {
    v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c)));
  } else {  // inputs c..c+7 of a 32-input block: 8 bytes, low nibbles or high ones
    const uint8_t* bytes = row + (c >> 5) * 16 + (c & 15);
    v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
    if (c & 16) v = _mm256_srli_epi32(v, 4);
    v = _mm256_and_si256(v, _mm256_set1_epi32(15));
  }
  return _mm256_cvtepi32_ps(v);
}
#endif

// VW codes of a row from column c (a multiple of VW), as floats. With AVX2 and F16C (which
// AVX-512 CPUs have too) eight at a time by the instructions; otherwise element by element.
template <Code C>
inline vf decode(const uint8_t* row, int c) {
#if defined(__AVX512F__)
  // sixteen integer codes widened by one instruction (a 4-bit half-block: its 16 bytes, low
  // nibbles for the block's first 16 inputs, high ones for the rest)
  if constexpr (VW == 16 && C == FP8_E4M3) {  // sixteen E4M3 bytes as halves, one conversion
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c));
    const __m512 f = _mm512_cvtph_ps(e4m3_half_bits16(bytes));
    vf out;
    std::memcpy(&out, &f, sizeof out);
    return out;
  }
  if constexpr (VW == 16 && C != FP8_E4M3) {
    __m512i v;
    if constexpr (C == INT8) {
      v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c)));
    } else {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + (c >> 5) * 16));
      v = _mm512_cvtepu8_epi32(bytes);
      v = (c & 16) ? _mm512_srli_epi32(v, 4) : _mm512_and_si512(v, _mm512_set1_epi32(15));
    }
    const __m512 f = _mm512_cvtepi32_ps(v);
    vf out;
    std::memcpy(&out, &f, sizeof out);
    return out;
  }
#endif
  vf out;
#if defined(QL_AVX2_DECODE)
  static_assert(VW % 8 == 0, "vector width a multiple of 8");
  for (int i = 0; i < VW; i += 8) {
    const __m256 part = decode8<C>(row, c + i);
    std::memcpy(reinterpret_cast<float*>(&out) + i, &part, sizeof part);
  }
#else
  for (int i = 0; i < VW; ++i) out[i] = decode1<C>(row, c + i);
#endif
  return out;
}

// The 32 codes of the 4-bit block holding column c, as four vectors of eight in input order
// (VW 8): one load of its 16 bytes, split into nibbles once, instead of reading each byte twice
// (low nibbles, then high ones) eight codes at a time. Used where weights are decoded into a
// buffer (8-32 rows of x: 0.82-0.90x the call time on an AVX2 Zen 3, medians of 15 interleaved
// runs); at one row, in registers, it changed nothing. -DQL_NO_SPAN32 builds without it.
#if defined(QL_AVX2_DECODE) && PAGELLM_VEC_WIDTH == 8 && !defined(QL_NO_SPAN32)
#define QL_SPAN32 1
inline void decode_int4_block(const uint8_t* row, int c, vf out[4]) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + (c >> 5) * 16));
  const __m128i mask = _mm_set1_epi8(15);
  const __m128i lo = _mm_and_si128(b, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
  out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  out[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  out[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}
#endif

// One row of x against 4-bit rows (VW 8): a block's 16 bytes go into both halves of a register,
// each 32-bit lane (one of the block's four words, twice) is shifted right by its own count
// (vpsrlvd) and masked, so every shift yields eight codes with no byte widening; four shifts give
// the block's 32 codes in kSrlvInput's order, and x is permuted into that order once per call.
// 1.1-1.3x the widening decoder (one row, 30 layers of SmolLM2's shapes, Q4_1 and int4, AVX2
// Zen 3). -DQL_NO_SRLV builds without it.
#if defined(QL_AVX2_DECODE) && PAGELLM_VEC_WIDTH == 8 && !defined(QL_NO_SRLV)
#define QL_SRLV 1
// shift counts of lanes 0-3 and 4-7 for the four codes vectors of a block: nibble p of a word
// is byte p / 2's low (p even) or high (p odd) half, i.e. input 4 * word + p / 2 or 16 + that
alignas(32) constexpr int kSrlvShift[4][8] = {{0, 0, 0, 0, 8, 8, 8, 8},
                                              {16, 16, 16, 16, 24, 24, 24, 24},
                                              {4, 4, 4, 4, 12, 12, 12, 12},
                                              {20, 20, 20, 20, 28, 28, 28, 28}};

constexpr int srlv_input(int i) {  // the block input whose code lands at position i (0-31)
  const int word = i % 4, p = kSrlvShift[i / 8][i % 8] / 4;
  return (p % 2 ? 16 : 0) + 4 * word + p / 2;
}

// whole blocks in every group (GGUF's 32, AWQ/GPTQ's 128, ...): the groups' x sums stay put
inline bool srlv_applies(const Layout& L) { return L.group % 32 == 0; }

inline void srlv_permute_x(const float* x, int k, float* xp) {
  for (int b = 0; b < k; b += 32)
    for (int i = 0; i < 32; ++i) xp[b + i] = x[b + srlv_input(i)];
}

// part[r] += codes of rows[r], inputs [c0, c1) (whole blocks) times xp (permuted x) there
template <int R>
inline void srlv_dot(const uint8_t* const* rows, const float* xp, int c0, int c1, vf* part) {
  __m256i shift[4];
  for (int t = 0; t < 4; ++t) shift[t] = _mm256_load_si256(reinterpret_cast<const __m256i*>(kSrlvShift[t]));
  const __m256i mask = _mm256_set1_epi32(15);
  for (int c = c0; c < c1; c += 32) {
    __m256 xv[4];
    for (int t = 0; t < 4; ++t) xv[t] = _mm256_loadu_ps(xp + c + 8 * t);
    for (int r = 0; r < R; ++r) {
      const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[r] + c / 2)));
      __m256 acc = part[r];
      for (int t = 0; t < 4; ++t) {
        const __m256i q = _mm256_and_si256(_mm256_srlv_epi32(b, shift[t]), mask);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), xv[t], acc);
      }
      part[r] = acc;
    }
  }
}
#endif

inline float hsum(vf v) {
  float s = 0.f;
  for (int i = 0; i < VW; ++i) s += v[i];
  return s;
}

// R rows of W (from n) against M rows of x (fp32, row stride k): acc_out[m * R + r].
template <Code C, int M, int R>
void rows_block(const Layout& L, const float* xf, int n, float* acc_out) {
  vf acc[M][R] = {};
  const uint8_t* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = L.q + (n + r) * L.row_bytes();
  const int groups = L.groups();
  for (int g = 0; g < groups; ++g) {
    vf s[R];
    vf b[R];
    for (int r = 0; r < R; ++r) {
      const float sc = L.scale(n + r, g);
      s[r] = vf{} + sc;
      b[r] = vf{} + (L.offset(n + r, g) - static_cast<float>(L.zero(n + r, g)) * sc);
    }
    const int c1 = (g + 1) * L.group;
    for (int c = g * L.group; c < c1; c += VW) {
      vf wv[R];
      for (int r = 0; r < R; ++r) wv[r] = decode<C>(rows[r], c) * s[r] + b[r];
      for (int m = 0; m < M; ++m) {
        const vf xv = loadv(xf + static_cast<int64_t>(m) * L.k + c);
        for (int r = 0; r < R; ++r) acc[m][r] += wv[r] * xv;
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc_out[m * R + r] = hsum(acc[m][r]);
}

// SG groups' decoder scales of row n from group g (scale_half: fp16, converted eight at a
// time with F16C) into dst.
constexpr int SG = 8;
inline void group_scales(const Layout& L, int n, int g, float* dst) {
  const int64_t i = static_cast<int64_t>(n) * L.groups() + g;
#if defined(__F16C__)
  if (L.scale_half) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(L.scales) + i));
    __m256 v = _mm256_cvtph_ps(h);
    if (L.fp8) v = _mm256_mul_ps(v, _mm256_set1_ps(FP8_SCALE));
    _mm256_storeu_ps(dst, v);
    return;
  }
#endif
  static_assert(SG == 8, "eight scales a load");
  for (int j = 0; j < SG; ++j) dst[j] = L.scale(n, g + j);
}

// sum_g (offset_g - zero_g * scale_g) * xsum_g of row n: the zero points' and offsets' share of
// its dot product with x (0 where the format has neither).
inline float row_correction(const Layout& L, int n, const float* xsum) {
  if (!L.offsets && !L.zeros && L.zero_const == 0) return 0.f;
  float corr = 0.f;
  for (int g = 0; g < L.groups(); ++g)
    corr += (L.offset(n, g) - static_cast<float>(L.zero(n, g)) * L.scale(n, g)) * xsum[g];
  return corr;
}

// One row of x (a single decode): R rows of W, the integers multiplied with x as they are and
// each group's sum scaled once, the zero point and offset added through the group's sum of x:
//   sum_k w x = sum_g [ scale_g * sum_{k in g} q x + (offset_g - zero_g * scale_g) * sum_{k in g} x ]
// which takes the per-weight multiply-add of the decoding out of the inner loop. The scales
// are read SG groups at a time and the zero/offset share is one pass over the groups after:
// per-group scalar work cost small groups (GGUF's 32) 1.5x the decoding (Q8_0 at 2.5x the time
// of per-channel int8).
// 8-bit rows are fetched ahead by hand: the hardware's prefetch left a one-row step of int8 or
// Q8_0 weights 25-35% slower (30 layers of SmolLM2's shapes, DRAM-resident, AVX2 Zen 3; 4-32
// rows ahead alike). 4-bit rows gained nothing from it. 16 rows ahead on the AMX Xeon (30
// layers of SmolLM2's shapes at one row, 8 / 16 / 32 / 64 rows in turn three times: int8
// 7.6-7.8 / 6.8-6.9 / 7.2-7.7 / 7.5-7.7 ms, FP8 8.4-9.5 / 6.8-7.5 / 7.3-7.6 / 7.3-7.5, Q8_0
// alike at 7.1-7.9).
constexpr int PREFETCH_ROWS = 16;
// A row read alone (8-bit codes) sums a group of 64+ inputs in four vectors side by side, added
// at the group's end, so that a multiply-add need not wait for the one before (int8 1.04x, FP8
// 1.02x on the Xeon; groups of 32, Q8_0's, keep one sum: split they took 1.08x the time).
constexpr int SPLIT_SUMS = 4;
constexpr int SPLIT_MIN_GROUP = 64;  // inputs, at either vector width
static_assert(SPLIT_SUMS == 4, "single_row_block adds the four sums by name");
// x is in srlv_dot's order where that decoder applies (run_single permutes it).

template <Code C, int R>
void single_row_block(const Layout& L, const float* x, const float* xsum, int n, float* out) {
  vf acc[R] = {};
  const uint8_t* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = L.q + (n + r) * L.row_bytes();
  const int groups = L.groups();
  alignas(32) float sc[R][SG];
  for (int g0 = 0; g0 < groups; g0 += SG) {
    const int gn = std::min(SG, groups - g0);
    for (int r = 0; r < R; ++r) {
      if (gn == SG) {
        group_scales(L, n + r, g0, sc[r]);
      } else {
        for (int j = 0; j < gn; ++j) sc[r][j] = L.scale(n + r, g0 + j);
      }
    }
    for (int j = 0; j < gn; ++j) {
      const int g = g0 + j;
#if !defined(QL_NO_PREFETCH)
      if constexpr (C != INT4) {  // this group's bytes, PREFETCH_ROWS rows on
        const int64_t gb = L.group, ahead = PREFETCH_ROWS * L.row_bytes() + g * gb;
        for (int r = 0; r < R; ++r)
          for (int64_t b = 0; b < gb; b += 64)
            _mm_prefetch(reinterpret_cast<const char*>(rows[r] + ahead + b), _MM_HINT_T0);
      }
#endif
      vf part[R] = {};
      const int c1 = (g + 1) * L.group;
#if defined(QL_SRLV)
      if (C == INT4 && srlv_applies(L)) {
        srlv_dot<R>(rows, x, g * L.group, c1, part);
      } else {
#else
      {
#endif
        int c = g * L.group;
        if (C != INT4 && R == 1 && L.group >= SPLIT_MIN_GROUP) {  // four sums side by side
          vf split[SPLIT_SUMS] = {};
          for (; c + SPLIT_SUMS * VW <= c1; c += SPLIT_SUMS * VW)
            for (int j = 0; j < SPLIT_SUMS; ++j)
              split[j] += decode<C>(rows[0], c + j * VW) * loadv(x + c + j * VW);
          part[0] = (split[0] + split[1]) + (split[2] + split[3]);
        }
        for (; c < c1; c += VW) {
          const vf xv = loadv(x + c);
          for (int r = 0; r < R; ++r) part[r] += decode<C>(rows[r], c) * xv;
        }
      }
      for (int r = 0; r < R; ++r) acc[r] += part[r] * sc[r][j];
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) + row_correction(L, n + r, xsum);
}

// Rows [n, n + nrows) of W decoded to fp32 into buf[nrows][k].
template <Code C>
void decode_rows(const Layout& L, int n, int nrows, float* buf) {
  for (int r = 0; r < nrows; ++r) {
    const uint8_t* row = L.q + (n + r) * L.row_bytes();
    float* dst = buf + static_cast<int64_t>(r) * L.k;
    for (int g = 0; g < L.groups(); ++g) {
      const float sc = L.scale(n + r, g);
      const vf s = vf{} + sc;
      const vf b = vf{} + (L.offset(n + r, g) - static_cast<float>(L.zero(n + r, g)) * sc);
      int c = g * L.group;
#if defined(QL_SPAN32)
      if constexpr (C == INT4) {
        for (; L.group % 32 == 0 && c < (g + 1) * L.group; c += 32) {
          vf d[4];
          decode_int4_block(row, c, d);
          for (int i = 0; i < 4; ++i) storev(dst + c + 8 * i, d[i] * s + b);
        }
      }
#endif
      for (; c < (g + 1) * L.group; c += VW) storev(dst + c, decode<C>(row, c) * s + b);
    }
  }
}

// R decoded rows (buf, stride k) against M rows of x: acc_out[m * R + r].
template <int M, int R>
void decoded_block(const float* buf, const float* xf, int k, float* acc_out) {
  vf acc[M][R] = {};
  for (int c = 0; c < k; c += VW) {
    vf wv[R];
    for (int r = 0; r < R; ++r) wv[r] = loadv(buf + static_cast<int64_t>(r) * k + c);
    for (int m = 0; m < M; ++m) {
      const vf xv = loadv(xf + static_cast<int64_t>(m) * k + c);
      for (int r = 0; r < R; ++r) acc[m][r] += wv[r] * xv;
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc_out[m * R + r] = hsum(acc[m][r]);
}

#ifndef QL_RW
#define QL_RW 4
#endif
#ifndef QL_XB
#if defined(__AVX512F__) && PAGELLM_VEC_WIDTH == 16
// 32 vector registers hold a 4 x 4 block of accumulators: at 3-4 rows of x (a decode step of a
// few streams, a verify step) the weights are decoded in registers once instead of twice (Q4_1
// gate_up at 3 rows: 310 -> 145 us); at 1-2 and 8-32 rows no worse
#define QL_XB 4
#else
#define QL_XB 2
#endif
#endif
constexpr int RW = QL_RW;
constexpr int XB = QL_XB;
constexpr int MAX_ROWS = 32;

template <Code C, int MB>
void block_rows(const Layout& L, const float* xf, int n, int nrows, float* res) {
  if (nrows == RW) {
    rows_block<C, MB, RW>(L, xf, n, res);
    return;
  }
  for (int r = 0; r < nrows; ++r) {
    float part[MB];
    rows_block<C, MB, 1>(L, xf, n + r, part);
    for (int m = 0; m < MB; ++m) res[m * RW + r] = part[m];
  }
}

template <int MB>
void decoded_rows(const float* buf, const float* xf, int k, int nrows, float* res) {
  if (nrows == RW) {
    decoded_block<MB, RW>(buf, xf, k, res);
    return;
  }
  for (int r = 0; r < nrows; ++r) {
    float part[MB];
    decoded_block<MB, 1>(buf + static_cast<int64_t>(r) * k, xf, k, part);
    for (int m = 0; m < MB; ++m) res[m * RW + r] = part[m];
  }
}

using DecodedFn = void (*)(const float*, const float*, int, int, float*);

inline DecodedFn decoded_fn(int mb) {
  switch (mb) {
    case 1: return decoded_rows<1>;
    case 2: return decoded_rows<2 <= XB ? 2 : 1>;
    case 3: return decoded_rows<3 <= XB ? 3 : 1>;
    default: return decoded_rows<XB>;
  }
}

using BlockFn = void (*)(const Layout&, const float*, int, int, float*);

template <Code C>
BlockFn block_fn(int mb) {
  static_assert(XB >= 1 && XB <= 4, "x blocks of 1 to 4 rows");
  switch (mb) {
    case 1: return block_rows<C, 1>;
    case 2: return block_rows<C, 2 <= XB ? 2 : 1>;
    case 3: return block_rows<C, 3 <= XB ? 3 : 1>;
    default: return block_rows<C, XB>;
  }
}

// With up to FUSED_ROWS rows of x the weights are decoded in registers as they are used; with
// more, each thread decodes its RW rows once into an L1-sized buffer and every block of x reads
// them from there (decoding again for each block cost up to 2x at 8-32 rows).
constexpr int FUSED_ROWS = XB;

template <typename T, Code C>
void run_single(const Layout& L, const float* xf, const T* bias, T* out, int n_out, int threads) {
  std::vector<float> xsum(L.groups(), 0.f);
  for (int g = 0; g < L.groups(); ++g)
    for (int c = g * L.group; c < (g + 1) * L.group; ++c) xsum[g] += xf[c];
  const float* xd = xf;  // x in the order the decoder yields the codes
#if defined(QL_SRLV)
  std::vector<float> xp;
  if (C == INT4 && srlv_applies(L)) {
    xp.resize(L.k);
    srlv_permute_x(xf, L.k, xp.data());
    xd = xp.data();
  }
#endif
  const int slices = (n_out + RW - 1) / RW;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int s = 0; s < slices; ++s) {
    const int n = s * RW;
    const int nrows = std::min(RW, n_out - n);
    float res[RW];
    // 8-bit codes one row at a time: a thread then reads one stream of weights, which a 2-core
    // Zen 4 served at ~25 GB/s against ~14-18 for RW rows side by side (30 layers of SmolLM2's
    // shapes at one row: per-channel int8 1.83x, Q8_0 1.44x, FP8 1.11x faster). 4-bit codes
    // are decoded at more cost a byte, and RW rows share each load of x.
    if (C == INT4 && nrows == RW) {
      single_row_block<C, RW>(L, xd, xsum.data(), n, res);
    } else {
      for (int r = 0; r < nrows; ++r) single_row_block<C, 1>(L, xd, xsum.data(), n + r, res + r);
    }
    for (int r = 0; r < nrows; ++r) store(out + n + r, res[r] + (bias ? to_float(bias[n + r]) : 0.f));
  }
}

template <typename T, Code C>
void run(const Layout& L, const T* x, const T* bias, T* out, int m, int n_out, int threads) {
#if defined(QR_INT8_ROW)
  if constexpr (std::is_same_v<T, uint16_t> && (C == INT4 || C == INT8)) {
    if (row_applies(L) && m >= row_min_rows(L) && m <= row_max_rows(L)) {
      int8_rows_linear(L, x, bias, out, m, n_out, threads);
      return;
    }
  }
#endif
  std::vector<float> xf(static_cast<size_t>(m) * L.k);
  for (size_t i = 0; i < xf.size(); ++i) xf[i] = to_float(x[i]);
  if (m == 1) {
    run_single<T, C>(L, xf.data(), bias, out, n_out, threads);
    return;
  }
  const int slices = (n_out + RW - 1) / RW;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> buf(m > FUSED_ROWS ? static_cast<size_t>(RW) * L.k : 0);
#pragma omp for schedule(static)
    for (int s = 0; s < slices; ++s) {
      const int n = s * RW;
      const int nrows = std::min(RW, n_out - n);
      if (m > FUSED_ROWS) decode_rows<C>(L, n, nrows, buf.data());
      for (int m0 = 0; m0 < m; m0 += XB) {
        const int mb = std::min(XB, m - m0);
        float res[XB * RW];
        const float* xb = xf.data() + static_cast<size_t>(m0) * L.k;
        if (m > FUSED_ROWS) {
          decoded_fn(mb)(buf.data(), xb, L.k, nrows, res);
        } else {
          block_fn<C>(mb)(L, xb, n, nrows, res);
        }
        for (int r = 0; r < nrows; ++r) {
          const float b0 = bias ? to_float(bias[n + r]) : 0.f;
          for (int i = 0; i < mb; ++i)
            store(out + static_cast<int64_t>(m0 + i) * n_out + n + r, res[i * RW + r] + b0);
        }
      }
    }
  }
}

// x, bias and out in T (float, or bf16 bits); the weights' codes pick the decoder.
template <typename T>
void run_typed(const Layout& L, const void* x, const void* bias, void* out, int m, int n,
               int threads) {
  auto* xp = static_cast<const T*>(x);
  auto* bp = static_cast<const T*>(bias);
  auto* op = static_cast<T*>(out);
  if (L.fp8) {
    run<T, FP8_E4M3>(L, xp, bp, op, m, n, threads);
  } else if (L.bits == 8) {
    run<T, INT8>(L, xp, bp, op, m, n, threads);
  } else {
    run<T, INT4>(L, xp, bp, op, m, n, threads);
  }
}

// 0, or what is wrong with the codes' description (fp8: 8 bits, zero 0, no offsets).
int check_codes(const Layout& L) {
  if (L.bits != 4 && L.bits != 8) return 4;
  if (L.fp8 && (L.bits != 8 || L.zeros || L.zero_const || L.offsets)) return 7;
  return 0;
}

int check(const Layout& L) {
  if (const int rc = check_codes(L)) return rc;
  if (L.group <= 0 || L.k % L.group != 0 || L.group % VW != 0) return 5;
  if (L.bits == 4 && L.k % 32 != 0) return 6;
  return 0;
}

}  // namespace

extern "C" int quant_linear(int dtype_code,  // 0 = float32, 1 = bfloat16 (x, bias, out)
                            const void* x, const uint8_t* q, const void* scales,
                            const void* offsets, const uint8_t* zeros, int scale_half,
                            int zero_const, int bits, int fp8, int group, const void* bias,
                            void* out, int m, int n, int k, int num_threads) {
  const Layout L{q, scales, offsets, zeros, scale_half, zero_const, bits, fp8, k, group};
  if (const int rc = check(L)) return rc;
  if (m < 1 || m > MAX_ROWS) return 3;
  num_threads = std::max(1, num_threads);
  if (dtype_code == 0) {
    run_typed<float>(L, x, bias, out, m, n, num_threads);
    return 0;
  }
  if (dtype_code == 1) {
    run_typed<uint16_t>(L, x, bias, out, m, n, num_threads);
    return 0;
  }
  return 2;
}

// Rows [row0, row0 + rows) of W as fp32 into out[rows][k]: (q - zero) * scale, then + offset
// (two roundings, in the order the formats' reference dequantizations use: no FMA contraction);
// fp8: value * scale, one rounding.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

// Columns [c0, c1) of an fp8 row times s (the scale times 256) into dst.
static void fp8_dequantize(const uint8_t* row, int c0, int c1, float s, float* dst) {
  int c = c0;
#if defined(QL_AVX2_DECODE)
  const __m256 sv = _mm256_set1_ps(s);
  for (; c + 8 <= c1; c += 8) {
    _mm256_storeu_ps(dst + c, _mm256_mul_ps(decode8<FP8_E4M3>(row, c), sv));
  }
#endif
  for (; c < c1; ++c) dst[c] = decode1<FP8_E4M3>(row, c) * s;
}

extern "C" int quant_dequantize(const uint8_t* q, const void* scales, const void* offsets,
                                const uint8_t* zeros, int scale_half, int zero_const, int bits,
                                int fp8, int group, int row0, int rows, int k, float* out,
                                int num_threads) {
  const Layout L{q, scales, offsets, zeros, scale_half, zero_const, bits, fp8, k, group};
  if (const int rc = check_codes(L)) return rc;
  if (L.group <= 0 || L.k % L.group != 0) return 5;
#pragma omp parallel for num_threads(std::max(1, num_threads)) schedule(static)
  for (int r = 0; r < rows; ++r) {
    const int n = row0 + r;
    const uint8_t* row = L.q + n * L.row_bytes();
    float* dst = out + static_cast<int64_t>(r) * k;
    for (int g = 0; g < L.groups(); ++g) {
      const float s = L.scale(n, g);
      if (L.fp8) {
        fp8_dequantize(row, g * group, (g + 1) * group, s, dst);
        continue;
      }
      const float o = L.offset(n, g);
      const int z = L.zero(n, g);
      int c = g * group;
#if defined(QL_AVX2_DECODE)
      // 4-bit codes eight at a time (the compiler vectorizes the 8-bit loop below by itself;
      // by hand 4-bit is 4-6x faster than that loop): the same two roundings, (q - z) exact in
      // float, then * s, then + o
      const __m256 zv = _mm256_set1_ps(static_cast<float>(z)), sv = _mm256_set1_ps(s);
      const __m256 ov = _mm256_set1_ps(o);
      for (; bits == 4 && c % 8 == 0 && c + 8 <= (g + 1) * group; c += 8) {
        const __m256 q = decode8<INT4>(row, c);
        const __m256 w = _mm256_mul_ps(_mm256_sub_ps(q, zv), sv);
        _mm256_storeu_ps(dst + c, L.offsets ? _mm256_add_ps(w, ov) : w);
      }
#endif
      for (; c < (g + 1) * group; ++c) {
        const int v = bits == 8 ? static_cast<int8_t>(row[c]) : nibble(row, c);
        const float w = static_cast<float>(v - z) * s;
        dst[c] = L.offsets ? w + o : w;
      }
    }
  }
  return 0;
}
#pragma GCC pop_options

extern "C" int quant_linear_max_rows() { return MAX_ROWS; }

// The most rows of bf16 x that quant_row.h can take (x quantized to int8 per weight group), 0
// where it is not built.
extern "C" int quant_linear_int8_rows() {
#if defined(QR_INT8_ROW)
  return QR_MAX_X;
#else
  return 0;
#endif
}

// The rows of bf16 x quant_row.h takes for weights of this form (a symmetric form: no zero
// points or offsets where 8-bit): the fewest, and the most in *most; 0 if it takes none (the
// rule run() applies; callers ask instead of keeping a copy of it).
extern "C" int quant_linear_int8_applies(int bits, int fp8, int group, int symmetric, int* most) {
#if defined(QR_INT8_ROW)
  Layout L{};
  L.bits = bits, L.fp8 = fp8, L.group = group;
  L.zero_const = symmetric ? 0 : 1;  // stands for any zero point or offset
  if (!row_applies(L)) return 0;
  *most = row_max_rows(L);
  return row_min_rows(L);
#else
  (void)bits, (void)fp8, (void)group, (void)symmetric, (void)most;
  return 0;
#endif
}

// Entries for a captured step's list of calls (packed_call.h).
PAGELLM_PACKED(quant_linear)
