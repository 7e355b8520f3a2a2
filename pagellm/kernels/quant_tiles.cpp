// Quantized linear layers for bf16 activations on CPUs with native bf16 products: y = x W^T for
// any number of rows of x, W kept in its stored form (quant_layout.h). Each thread decodes a
// block of 16 output features at a time (all of K) into bf16 and multiplies every row of x
// against it, so a weight is decoded once per call however many rows x has.
//
// A decoded weight is the format's reference dequantization rounded to bf16: (q - zero) * scale
// (+ offset), fp8 value * scale, in that order with no contraction (this file is built with
// -ffp-contract=off -fno-associative-math), then round-to-nearest-even. That is what `dequantize().to(bfloat16)` gives,
// the weight a bf16 model of the dequantized checkpoint holds; products are exact in fp32 and
// accumulate in fp32. 8-bit codes with one scale a row and no zero point (per-channel int8,
// FP8) are decoded without their scale (the codes are exact in bf16) and each sum is scaled
// once instead: the weights are then not rounded at all (per_row).
//
// Paths:
//   2  AMX (Xeon Sapphire Rapids and later). Features are the A tiles (16 rows of 32 bf16 inputs:
//      a decoded row as it comes), x is packed once per call into B tiles (pairs of inputs by
//      16 rows of x, VNNI order), and C^T = W x^T is turned back by a 16 x 16 transpose as it is
//      stored. 32 features x 32 rows of x per pass: four C tiles, two A, two B.
//   1  AVX-512 BF16 (Zen 4 / Zen 5, Cooper Lake): the decoded block is transposed into VNNI pairs
//      [K/2][16 features] and VDPBF16PS multiplies a broadcast pair of x's inputs into 16
//      features at once, 8 rows x 2 blocks of accumulators.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <immintrin.h>
#include <omp.h>

#include "amx_common.h"
#include "cpu_common.h"
#include "aligned_vector.h"
#include "amx_pass.h"
#include "quant_layout.h"
#include "tile_transpose.h"
#include "packed_call.h"

namespace {

using namespace pagellm;

#if defined(__AVX512BF16__)
constexpr int FB = 16;     // output features per decoded block
constexpr int KS = 32;     // inputs per step (one A tile row, 16 VNNI pairs)
constexpr int STEP = FB * KS;  // bf16 values of one step of a block

// Sixteen 8-bit codes of a row from input c as floats (fp8: value / 256).
template <Code C>
inline __m512 codes16(const uint8_t* row, int c) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c));
  if constexpr (C == FP8_E4M3) return _mm512_cvtph_ps(e4m3_half_bits16(bytes));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
}

// Thirty-two E4M3 codes of a row from input c straight to bf16 (value / 256, as codes16 reads
// them: exact in bf16). A normal code's exponent and mantissa move up 4 places into bf16's
// fields and the exponent is rebased by 112 (bf16's bias 127, less E4M3's 7, less 8 for the
// / 256): three instructions. Codes with exponent 0 (zero and the subnormals, rare in weights)
// are looked up, only in steps that have one. Every byte decodes to the bits the 128-entry
// table before it gave (checked exhaustively); 1.25x that table's speed alone.
struct Fp8TinyTable {
  alignas(64) uint16_t v[32];  // [m]: bf16 of m * 2^-17 (code 0 000 m / 256); rest unused
  Fp8TinyTable() {
    for (int m = 0; m < 32; ++m) {
      const float f = m < 8 ? static_cast<float>(m) / 131072.f : 0.f;
      uint32_t u;
      std::memcpy(&u, &f, 4);
      v[m] = static_cast<uint16_t>(u >> 16);  // exact: at most 3 significant bits
    }
  }
};

inline __m512i fp8_codes32_bf16(const uint8_t* row, int c) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c));
  const __m512i sx = _mm512_cvtepi8_epi16(bytes);  // the sign fills bits 7-15
  // (sx << 4) & 0x87F0: sign at 15, exponent at 7-10, mantissa at 4-6; | 0x3800 adds 112 to the
  // exponent (bits 11-13 are clear, so OR is the sum)
  const __m512i mask = _mm512_set1_epi16(static_cast<short>(0x87F0));
  const __m512i rebase = _mm512_set1_epi16(0x3800);
  __m512i v = _mm512_ternarylogic_epi32(_mm512_slli_epi16(sx, 4), mask, rebase, 0xEA);  // a & b | c
  const __mmask32 tiny = _mm512_testn_epi16_mask(sx, _mm512_set1_epi16(0x78));
  if (tiny != 0) {
    static const Fp8TinyTable table;
    // the index is the word's low 5 bits: the mantissa where the exponent is 0
    v = _mm512_mask_permutexvar_epi16(v, tiny, sx, _mm512_load_si512(table.v));
    const __m512i sign_bit = _mm512_set1_epi16(static_cast<short>(0x8000));
    v = _mm512_ternarylogic_epi32(v, sx, sign_bit, 0xF8);  // a | (b & c)
  }
  return v;
}

// A row's group constants as floats (fp8: the scale carries 256), converted sixteen groups at
// a time into a thread's arrays; the decoders broadcast a group's own from memory.
struct RowConsts {
  std::vector<float> s, z, o;

  void load(const Layout& L, int n) {
    const int groups = L.groups();
    if (static_cast<int>(s.size()) < groups + 16) s.resize(groups + 16), z.resize(groups + 16), o.resize(groups + 16);
    for (int g = 0; g < groups; g += 16) {
      __m512 sv = group_values16(L, L.scales, n, g);
      if (L.fp8) sv = _mm512_mul_ps(sv, _mm512_set1_ps(FP8_SCALE));
      const __m512 ov = L.offsets ? group_values16(L, L.offsets, n, g) : _mm512_setzero_ps();
      _mm512_storeu_ps(s.data() + g, sv);
      _mm512_storeu_ps(z.data() + g, group_zeros16(L, n, g));
      _mm512_storeu_ps(o.data() + g, ov);
    }
  }
};

// A row's constants where the decoders read them, and which group each 16 inputs are in.
struct RowView {
  const float *s, *z, *o;
  const int* group_of;  // [k / 16]
  bool offsets;

  // The reference's order: (q - zero) * scale, then + offset (fp8: value * scale).
  template <Code C>
  __m512 dequant(__m512 v, int g) const {
    const __m512 sv = _mm512_set1_ps(s[g]);
    if constexpr (C == FP8_E4M3) return _mm512_mul_ps(v, sv);
    const __m512 w = _mm512_mul_ps(_mm512_sub_ps(v, _mm512_set1_ps(z[g])), sv);
    return offsets ? _mm512_add_ps(w, _mm512_set1_ps(o[g])) : w;
  }
};

// 32 inputs of an 8-bit row from c as bf16.
template <Code C>
inline __m512i step8(const uint8_t* row, int c, const RowView& k) {
  const __m512 a = k.dequant<C>(codes16<C>(row, c), k.group_of[c / 16]);
  const __m512 b = k.dequant<C>(codes16<C>(row, c + 16), k.group_of[c / 16 + 1]);
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a));
}

// 32 inputs of a 4-bit row from c (one 16-byte block) as bf16: every code of a group has one of
// 16 values, so the group's 16 values are computed (the reference's way) and rounded to bf16
// once, and the codes pick from them (VPERMW: entries 0-15 for the block's first 16 inputs'
// group, 16-31 for the last 16's).
inline __m512i step4(const uint8_t* row, int c, const RowView& k, int& table_group,
                     __m512i& table) {
  const int g = k.group_of[c / 16], g2 = k.group_of[c / 16 + 1];
  if (g != table_group || g2 != g) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 a = k.dequant<INT4>(iota, g);
    const __m512 b = g2 == g ? a : k.dequant<INT4>(iota, g2);
    table = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a));
    table_group = g2 == g ? g : -1;
  }
  const __m256i words = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c / 2)));
  const __m256i low = _mm256_and_si256(words, _mm256_set1_epi16(15));
  const __m256i high = _mm256_add_epi16(_mm256_srli_epi16(words, 4), _mm256_set1_epi16(16));
  const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
  return _mm512_permutexvar_epi16(idx, table);
}

// Features [n0, n0 + rows) to bf16, feature r's step s (32 inputs) at dst + r * row_stride +
// s * step_stride; features [rows, pad) are zeros.
template <Code C>
void decode_rows(const Layout& L, int n0, int rows, int pad, uint16_t* dst, int64_t row_stride,
                 int64_t step_stride, bool unit) {
  const int steps = L.k / KS;
  thread_local RowConsts consts;
  thread_local std::vector<int> group_of;
  group_of.resize(L.k / 16);
  for (int i = 0; i < L.k / 16; ++i) group_of[i] = i * 16 / L.group;
  for (int r = 0; r < pad; ++r) {
    uint16_t* out = dst + r * row_stride;
    if (r >= rows) {
      for (int s = 0; s < steps; ++s) _mm512_storeu_si512(out + s * step_stride, _mm512_setzero_si512());
      continue;
    }
    const int n = n0 + r;
    const uint8_t* row = L.q + n * L.row_bytes();
    if (!unit) consts.load(L, n);  // unit (per_row below): the codes alone, scaled later
    const RowView view{consts.s.data(), consts.z.data(), consts.o.data(), group_of.data(),
                       L.offsets != nullptr};
    int table_group = -1;
    __m512i table = _mm512_setzero_si512();
    for (int s = 0; s < steps; ++s) {
      __m512i v;
      if constexpr (C == INT4) {
        v = step4(row, s * KS, view, table_group, table);
      } else if (unit) {  // the codes themselves (fp8: value / 256), exact in bf16
        if constexpr (C == FP8_E4M3)
          v = fp8_codes32_bf16(row, s * KS);
        else
          v = reinterpret_cast<__m512i>(
              _mm512_cvtne2ps_pbh(codes16<C>(row, s * KS + 16), codes16<C>(row, s * KS)));
      } else {
        v = step8<C>(row, s * KS, view);
      }
      _mm512_storeu_si512(out + s * step_stride, v);
    }
  }
}

// Features [n0, n0 + rows) (rows <= 16; the rest zero) into dst[K/32][16][32] bf16: step s of
// feature r is dst + s * STEP + r * 32, an A tile per step.
template <Code C>
void decode_block(const Layout& L, int n0, int rows, uint16_t* dst, bool unit) {
  decode_rows<C>(L, n0, rows, FB, dst, KS, STEP, unit);
}

// 8-bit codes with one scale a row and no zero point or offset (per-channel int8, FP8): every
// code is exact in bf16, so the tiles multiply the codes and scale each sum once (one rounding
// fewer than scaling each weight first).
inline bool per_row(const Layout& L) {
  return L.bits == 8 && L.groups() == 1 && !L.zeros && L.zero_const == 0 && !L.offsets;
}

using DecodeFn = void (*)(const Layout&, int, int, uint16_t*, bool);

inline DecodeFn decoder_for(const Layout& L) {
  if (L.fp8) return decode_block<FP8_E4M3>;
  return L.bits == 8 ? decode_block<INT8> : decode_block<INT4>;
}

// 16 fp32 values + nothing -> bf16 at dst (the first `cols` of them).
inline void store_bf16(uint16_t* dst, __m512 v, int cols) {
  const __m256i b = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
  if (cols == 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), b);
  } else {
    _mm256_mask_storeu_epi16(dst, static_cast<__mmask16>((1u << cols) - 1), b);
  }
}

struct Call {
  Layout L;
  const uint16_t* x;        // [m][k] bf16
  uint16_t* out;            // [m][n] bf16
  int m, n;
  const float* col_scale;   // [n]: per_row's scales, applied to the sums (null: none)
  int steps() const { return L.k / KS; }
  int rows_of(int block) const { return std::min(FB, n - block * FB); }
};

// The sums of features [f0, f0 + cols) times their scales (when the call has them).
inline __m512 scaled(const Call& c, __m512 v, int f0, int cols) {
  if (c.col_scale == nullptr) return v;
  return _mm512_mul_ps(v, _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << cols) - 1), c.col_scale + f0));
}

// Cache blocking of path 2 (GEMM's usual): a thread decodes a panel of its feature blocks (all
// of K, about PANEL_KB) once, then multiplies it by x a chunk of rows at a time (about CHUNK_KB
// of packed x, kept in L2 while the panel's blocks stream past it). Path 1 decodes two blocks
// at a time.
#ifndef QT_PANEL_KB
#define QT_PANEL_KB 1024
#endif
#ifndef QT_CHUNK_KB
#define QT_CHUNK_KB 512
#endif

uint16_t* block_buffer(size_t values) {
  thread_local AlignedVector<uint16_t> buf;
  if (buf.size() < values) buf.resize(values);
  return buf.data();
}

// ----- path 1: AVX-512 BF16 -----------------------------------------------------------------

// A decoded block in place from A-tile order [step][feature][32] into VNNI pairs [K/2][16].
inline void to_pairs(uint16_t* blk, int steps) {
  for (int s = 0; s < steps; ++s) {
    __m512i r[16];
    uint16_t* p = blk + s * STEP;
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(p + i * KS);
    transpose16(r);
    for (int i = 0; i < 16; ++i) _mm512_storeu_si512(p + i * KS, r[i]);
  }
}

// R rows of x from t0 times NBK decoded blocks (pairs order) from block b0.
template <int R, int NBK>
void rows_dp(const Call& c, const uint16_t* blks, int b0, int t0) {
  const int pairs = c.L.k / 2;
  __m512 acc[R][NBK];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NBK; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int kk = 0; kk < pairs; ++kk) {
    __m512bh w[NBK];
    for (int j = 0; j < NBK; ++j)
      w[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(blks + (static_cast<int64_t>(j) * pairs + kk) * 32));
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      std::memcpy(&pair, c.x + static_cast<int64_t>(t0 + r) * c.L.k + 2 * kk, 4);
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pair)));
      for (int j = 0; j < NBK; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, w[j]);
    }
  }
  for (int j = 0; j < NBK; ++j) {
    const int cols = c.rows_of(b0 + j);
    for (int r = 0; r < R; ++r)
      store_bf16(c.out + static_cast<int64_t>(t0 + r) * c.n + (b0 + j) * FB,
                 scaled(c, acc[r][j], (b0 + j) * FB, cols), cols);
  }
}

// Every row of x against NBK decoded blocks: 8 rows a pass, the rest in passes of 4, 2 and 1
// (one pass a row cost 7 rows of SmolLM2's Q4_1 layers 1.35x 8 rows' time on a Zen 4).
template <int NBK>
void sweep_dp(const Call& c, const uint16_t* blks, int b0) {
  int t = 0;
  for (; t + 8 <= c.m; t += 8) rows_dp<8, NBK>(c, blks, b0, t);
  if (t + 4 <= c.m) rows_dp<4, NBK>(c, blks, b0, t), t += 4;
  if (t + 2 <= c.m) rows_dp<2, NBK>(c, blks, b0, t), t += 2;
  if (t < c.m) rows_dp<1, NBK>(c, blks, b0, t);
}

void run_path1(const Call& c, int threads) {
  const int blocks = (c.n + FB - 1) / FB, steps = c.steps();
  const DecodeFn decode = decoder_for(c.L);
#pragma omp parallel num_threads(threads)
  {
    int lo, hi;
    my_blocks(blocks, omp_get_thread_num(), omp_get_num_threads(), lo, hi);
    uint16_t* buf = block_buffer(static_cast<size_t>(2) * steps * STEP);
    for (int b = lo; b < hi; b += 2) {
      const int nb = std::min(2, hi - b);
      for (int j = 0; j < nb; ++j) {
        uint16_t* blk = buf + static_cast<size_t>(j) * steps * STEP;
        decode(c.L, (b + j) * FB, c.rows_of(b + j), blk, c.col_scale != nullptr);
        to_pairs(blk, steps);
      }
      if (nb == 2) {
        sweep_dp<2>(c, buf, b);
      } else {
        sweep_dp<1>(c, buf, b);
      }
    }
  }
}

// ----- path 2: AMX tiles --------------------------------------------------------------------

#if defined(PAGELLM_HAS_AMX)
// One C^T tile [16 features][16 rows of x] (fp32, stride 16) into out, transposed.
void store_tile(const Call& c, const float* tile, int block, int tb) {
  __m512i r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(tile + i * 16);
  transpose16(r);
  const int cols = c.rows_of(block), rows = std::min(16, c.m - tb * 16);
  for (int t = 0; t < rows; ++t)
    store_bf16(c.out + static_cast<int64_t>(tb * 16 + t) * c.n + block * FB,
               scaled(c, reinterpret_cast<__m512>(r[t]), block * FB, cols), cols);
}

void run_path2(const Call& c, int threads) {
  const int blocks = (c.n + FB - 1) / FB, steps = c.steps();
  const int tblocks = (c.m + 15) / 16, items = tblocks * steps;
  thread_local AlignedVector<uint32_t> packed;
  uint32_t* xp = grown(packed, static_cast<size_t>(items) * 256);
  const DecodeFn decode = decoder_for(c.L);
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int i = 0; i < items; ++i)
      pack_b_item(reinterpret_cast<const char*>(c.x), c.L.k * 2, c.m, steps, i, xp);
    amx_load_config();
    int lo, hi;
    my_blocks(blocks, omp_get_thread_num(), omp_get_num_threads(), lo, hi);
    const size_t blk = static_cast<size_t>(steps) * STEP;
    // blocks per panel (even: A tiles go in pairs) and row blocks per chunk (even: B too)
    const int panel = std::max<int>(2, (QT_PANEL_KB << 10) / (blk * 2) / 2 * 2);
    const int chunk = std::max<int>(2, (QT_CHUNK_KB << 10) / (static_cast<size_t>(steps) * 1024) / 2 * 2);
    uint16_t* buf = block_buffer(std::min(panel, hi - lo) * blk);
    Outbox<float> box;
    const auto store = [&c](const float* tile, int block, int tb) {
      store_tile(c, tile, block, tb);
    };
    for (int b = lo; b < hi; b += panel) {
      const int nb = std::min(panel, hi - b);
      for (int j = 0; j < nb; ++j)
        decode(c.L, (b + j) * FB, c.rows_of(b + j), buf + j * blk, c.col_scale != nullptr);
      for (int t0 = 0; t0 < tblocks; t0 += chunk) {
        const int t1 = std::min(tblocks, t0 + chunk);
        for (int tb = t0; tb < t1; tb += 2) {
          for (int j = 0; j < nb; j += 2) {
            const auto* a0 = reinterpret_cast<const char*>(buf + j * blk);
            const char* a1 = j + 1 < nb ? a0 + blk * 2 : nullptr;
            const auto* bt = reinterpret_cast<const char*>(xp + static_cast<int64_t>(tb) * steps * 256);
            const PassTiles tiles{a0, a1, STEP * 2, 64, bt, static_cast<int64_t>(steps) * 1024};
            amx_pass<false>(tiles, steps, tb + 1 < t1, b + j, tb, box, store);
          }
        }
      }
    }
    box.flush(store);
    _tile_release();
  }
}
#endif
#endif

int best_path() { return best_bf16_path(); }

}  // namespace

// 2 AMX, 1 AVX-512 BF16, 0 neither (this build has no bf16 path: callers keep their others).
extern "C" int quant_tiles_best_path() { return best_path(); }

// out[m][n] = x[m][k] W^T, x and out bf16, W as quant_linear.cpp describes it. K must be a
// multiple of 32 and the group of 16. Returns 0, or an error code.
extern "C" int quant_tiles_linear(int path, const uint16_t* x, const uint8_t* q,
                                  const void* scales, const void* offsets, const uint8_t* zeros,
                                  int scale_half, int zero_const, int bits, int fp8, int group,
                                  uint16_t* out, int m, int n, int k, int threads) {
  const Layout L{q, scales, offsets, zeros, scale_half, zero_const, bits, fp8, k, group};
  if (m <= 0 || n <= 0) return 0;
  if (bits != 4 && bits != 8) return 4;
  if (group <= 0 || k % group != 0 || group % 16 != 0 || k % 32 != 0) return 5;
  if (path < 1 || path > best_path()) return 6;
#if defined(__AVX512BF16__)
  thread_local std::vector<float> col_scale;
  float* sum_scales = nullptr;  // per_row's, applied to the sums
  if (per_row(L)) {
    sum_scales = grown(col_scale, n);
    for (int j = 0; j < n; ++j) sum_scales[j] = L.scale(j, 0);  // fp8: x 256, as decoded
  }
  const Call c{L, x, out, m, n, sum_scales};
  threads = std::max(1, std::min(threads, (n + FB - 1) / FB));
#if defined(PAGELLM_HAS_AMX)
  if (path == 2) {
    run_path2(c, threads);
    return 0;
  }
#endif
  run_path1(c, threads);
  return 0;
#else
  (void)L, (void)x, (void)out, (void)threads;
  return 6;
#endif
}

// Rows [row0, row0 + rows) of W decoded to bf16 into out[rows][k], as the tile paths decode them
// (the large-batch path hands such panels to a bf16 GEMM). Returns 0, or an error code.
extern "C" int quant_tiles_dequantize(const uint8_t* q, const void* scales, const void* offsets,
                                      const uint8_t* zeros, int scale_half, int zero_const,
                                      int bits, int fp8, int group, int row0, int rows, int k,
                                      uint16_t* out, int threads) {
  const Layout L{q, scales, offsets, zeros, scale_half, zero_const, bits, fp8, k, group};
  if (bits != 4 && bits != 8) return 4;
  if (group <= 0 || k % group != 0 || group % 16 != 0 || k % 32 != 0) return 5;
  if (best_path() == 0) return 6;
#if defined(__AVX512BF16__)
  const int pieces = (rows + FB - 1) / FB;
#pragma omp parallel for num_threads(std::max(1, threads)) schedule(static)
  for (int i = 0; i < pieces; ++i) {
    const int r0 = i * FB, count = std::min(FB, rows - r0);
    uint16_t* dst = out + static_cast<int64_t>(r0) * k;
    if (L.fp8) {
      decode_rows<FP8_E4M3>(L, row0 + r0, count, count, dst, k, KS, false);
    } else if (bits == 8) {
      decode_rows<INT8>(L, row0 + r0, count, count, dst, k, KS, false);
    } else {
      decode_rows<INT4>(L, row0 + r0, count, count, dst, k, KS, false);
    }
  }
  return 0;
#else
  (void)L, (void)row0, (void)rows, (void)out, (void)threads;
  return 6;
#endif
}

// Entries for a captured step's list of calls (packed_call.h).
PAGELLM_PACKED(quant_tiles_linear)
