// W8A8 linear layers computed as integers, as compressed-tensors' W8A8 scheme (llm-compressor's
// SmoothQuant / GPTQ W8A8) defines them and vLLM runs them: x is quantized per token, dynamic
// and symmetric,
//
//     sx[t] = max_k |x[t][k]| / 127  (1 where the row is all zero)
//     xq[t][k] = round-half-even(x[t][k] / sx[t]), clamped to [-128, 127]
//
// and y[t][n] = float(sum_k xq[t][k] * wq[n][k]) * sx[t] * sw[n] (int32 sums, exact; then two
// float products in that order), wq int8 per output channel with scale sw[n].
//
// AMX-INT8 (Xeon Sapphire Rapids and later): the weight rows are the A tiles as stored (64
// inputs a row, no decoding), x's codes are packed once per call into B tiles (quads of inputs
// by 16 tokens, VNNI order, through the 16 x 16 dword transpose), TDPBSSD sums them; C^T tiles
// go out transposed one pass late (as in quant_tiles.cpp).
//
// AVX2 (every x86 kind here, AVX-512 ones included), a decode step's few rows of x: the
// integer dot products of llama.cpp's q8 kernels. _mm256_maddubs_epi16 multiplies unsigned by
// signed bytes, so each 32-input block of a weight row goes in as |w| and x's codes take w's
// signs (_mm256_sign_epi8); a pair's sum is at most 2 * 128 * 127 = 32512, inside int16 (an x
// code is never -128: |x| <= amax makes |x / sx| <= 127), and _mm256_madd_epi16 widens the
// pairs to int32. The sums are exact, then scaled as above. More rows (prefills) and other
// CPUs: the callers quantize x the same way (quant_int8_quantize) and multiply its codes with
// the weight-only kernels.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <immintrin.h>
#include <omp.h>

#include "amx_common.h"
#include "aligned_vector.h"
#include "amx_pass.h"
#include "cpu_common.h"
#include "tile_transpose.h"
#include "packed_call.h"

namespace {

using namespace pagellm;

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}
#elif defined(__AVX2__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
}
#endif

// Row t of x (fp32 or bf16 bits) quantized into q[k]; returns its scale.
template <typename T>
float quantize_row(const T* x, int k, int8_t* q) {
  float amax = 0.f;
  int j = 0;
#if defined(__AVX512F__)
  __m512 mv = _mm512_setzero_ps();
  for (; j + 16 <= k; j += 16) mv = _mm512_max_ps(mv, _mm512_abs_ps(load16(x + j)));
  amax = _mm512_reduce_max_ps(mv);
#elif defined(__AVX2__)
  __m256 mv = _mm256_setzero_ps();
  const __m256 no_sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (; j + 8 <= k; j += 8) mv = _mm256_max_ps(mv, _mm256_and_ps(load8(x + j), no_sign));
  float lanes[8];
  _mm256_storeu_ps(lanes, mv);
  for (const float v : lanes) amax = std::max(amax, v);
#endif
  for (; j < k; ++j) amax = std::max(amax, std::abs(to_float(x[j])));
  const float s = amax > 0.f ? amax / 127.f : 1.f;
  int i = 0;
#if defined(__AVX512F__)
  const __m512 sv = _mm512_set1_ps(s);
  for (; i + 16 <= k; i += 16) {
    const __m512 v = load16(x + i);
    // the current rounding mode (nearest-even) as torch.round; then saturate to int8
    const __m512i r = _mm512_cvtps_epi32(_mm512_div_ps(v, sv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtsepi32_epi8(r));
  }
#elif defined(__AVX2__)
  const __m256 sv = _mm256_set1_ps(s);
  for (; i + 8 <= k; i += 8) {
    // nearest-even as above; |x / s| <= 127, so the two packs never saturate
    const __m256i r = _mm256_cvtps_epi32(_mm256_div_ps(load8(x + i), sv));
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm_packs_epi16(w, w));
  }
#endif
  for (; i < k; ++i) {
    const float r = __builtin_nearbyintf(to_float(x[i]) / s);
    q[i] = static_cast<int8_t>(std::min(127.f, std::max(-128.f, r)));
  }
  return s;
}

void quantize_rows(int dtype, const void* x, int m, int k, int8_t* q, float* s, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (m > 1)
  for (int t = 0; t < m; ++t) {
    const int64_t off = static_cast<int64_t>(t) * k;
    s[t] = dtype == 0 ? quantize_row(static_cast<const float*>(x) + off, k, q + off)
                      : quantize_row(static_cast<const uint16_t*>(x) + off, k, q + off);
  }
}

// The scaled result of one output (sum of x row t's codes times weight row n's) into out.
inline void store_sum(int dtype, void* out, int64_t at, int32_t sum, float sx, float sw) {
  const float v = static_cast<float>(sum) * sx * sw;
  if (dtype == 0) {
    static_cast<float*>(out)[at] = v;
  } else {
    store(static_cast<uint16_t*>(out) + at, v);
  }
}

#if defined(__AVX2__)
#define QI_HAS_DOT 1
constexpr int DOT_MAX_ROWS = 32;  // rows of x the dot kernel takes (decode steps)

inline int32_t hsum(__m256i v) {
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i t = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
}

// NR weight rows from n against TB rows of x from t0: each weight block is loaded and made
// unsigned once for the TB rows. K a multiple of 32.
template <int NR, int TB>
void dot_block(int dtype, const int8_t* w, const float* sw, const int8_t* xq, const float* sx,
               void* out, int n, int t0, int nout, int k) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[NR][TB];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < TB; ++t) acc[r][t] = _mm256_setzero_si256();
  for (int c = 0; c < k; c += 32) {
    __m256i wv[NR], aw[NR];
#if !defined(QI_NO_PREFETCH)
    if (c % 64 == 0)  // as the weight-only kernel: 8 rows ahead
      for (int r = 0; r < NR; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w + static_cast<int64_t>(n + r + 8) * k + c), _MM_HINT_T0);
#endif
    for (int r = 0; r < NR; ++r) {
      wv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + static_cast<int64_t>(n + r) * k + c));
      aw[r] = _mm256_abs_epi8(wv[r]);
    }
    for (int t = 0; t < TB; ++t) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + static_cast<int64_t>(t0 + t) * k + c));
      for (int r = 0; r < NR; ++r) {
        const __m256i pairs = _mm256_maddubs_epi16(aw[r], _mm256_sign_epi8(xv, wv[r]));
        acc[r][t] = _mm256_add_epi32(acc[r][t], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
  for (int t = 0; t < TB; ++t)
    for (int r = 0; r < NR; ++r)
      store_sum(dtype, out, static_cast<int64_t>(t0 + t) * nout + n + r, hsum(acc[r][t]), sx[t0 + t], sw[n + r]);
}

// Weight rows [n0, n1) against every row of x: four rows at a time for one row of x (the
// step is a stream of weights), two against four rows of x otherwise (16 registers).
template <int TB>
void dot_rows(int dtype, const int8_t* w, const float* sw, const int8_t* xq, const float* sx,
              void* out, int n0, int n1, int t0, int nout, int k) {
  constexpr int NR = TB == 1 ? 4 : 2;
  int n = n0;
  for (; n + NR <= n1; n += NR) dot_block<NR, TB>(dtype, w, sw, xq, sx, out, n, t0, nout, k);
  for (; n < n1; ++n) dot_block<1, TB>(dtype, w, sw, xq, sx, out, n, t0, nout, k);
}

void run_dot(int dtype, const int8_t* w, const float* sw, const int8_t* xq, const float* sx,
             void* out, int m, int n, int k, int threads) {
  // contiguous runs of weight rows per thread (multiples of 4), streamed from memory for the
  // first four rows of x and read again from cache for each further four
  const int units = (n + 3) / 4;
  threads = std::max(1, std::min(threads, units));
#pragma omp parallel num_threads(threads)
  {
    const int id = omp_get_thread_num(), count = omp_get_num_threads();
    const int n0 = std::min(n, units * id / count * 4), n1 = std::min(n, units * (id + 1) / count * 4);
    int t = 0;
    for (; t + 4 <= m; t += 4) dot_rows<4>(dtype, w, sw, xq, sx, out, n0, n1, t, n, k);
    for (; t + 2 <= m; t += 2) dot_rows<2>(dtype, w, sw, xq, sx, out, n0, n1, t, n, k);
    for (; t < m; ++t) dot_rows<1>(dtype, w, sw, xq, sx, out, n0, n1, t, n, k);
  }
}
#endif

#if defined(PAGELLM_HAS_AMX) && defined(__AMX_INT8__)
#define QI_HAS_AMX_INT8 1
constexpr int FB = 16;  // output features per A tile
constexpr int KS = 64;  // int8 inputs per step

struct Call {
  int dtype;               // out: 0 fp32, 1 bf16
  const int8_t* w;         // [n][k]
  const float* sw;         // [n]
  const int8_t* xq;        // [m][k]
  const float* sx;         // [m]
  void* out;               // [m][n]
  int m, n, k;
  int steps() const { return k / KS; }
  int rows_of(int block) const { return std::min(FB, n - block * FB); }
};

// One C^T tile [16 features][16 tokens] (int32) scaled into out, transposed.
void store_tile(const Call& c, const int32_t* tile, int block, int tb) {
  __m512i r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(tile + i * 16);
  transpose16(r);
  const int cols = c.rows_of(block), rows = std::min(16, c.m - tb * 16);
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
  const __m512 sw = _mm512_maskz_loadu_ps(mask, c.sw + block * FB);
  for (int t = 0; t < rows; ++t) {
    const int row = tb * 16 + t;
    const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(r[t]), _mm512_set1_ps(c.sx[row])), sw);
    const int64_t at = static_cast<int64_t>(row) * c.n + block * FB;
    if (c.dtype == 0) {
      _mm512_mask_storeu_ps(static_cast<float*>(c.out) + at, mask, v);
    } else {
      const __m256i b = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
      _mm256_mask_storeu_epi16(static_cast<uint16_t*>(c.out) + at, mask, b);
    }
  }
}

// Row blocks of packed x kept in L2 while a thread's weight blocks pass over them.
constexpr int CHUNK_KB = 512;

void run_amx(const Call& c, int threads) {
  const int blocks = (c.n + FB - 1) / FB, steps = c.steps();
  const int tblocks = (c.m + 15) / 16, items = tblocks * steps;
  thread_local AlignedVector<uint32_t> packed;
  uint32_t* xp = grown(packed, static_cast<size_t>(items) * 256);
  const int chunk = std::max(2, (CHUNK_KB << 10) / (steps * 1024) / 2 * 2);
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int i = 0; i < items; ++i)
      pack_b_item(reinterpret_cast<const char*>(c.xq), c.k, c.m, steps, i, xp);
    amx_load_config();
    int lo, hi;
    my_blocks(blocks, omp_get_thread_num(), omp_get_num_threads(), lo, hi);
    AlignedVector<int8_t> pad;  // the last block's rows and zero rows, when n is not a multiple
    Outbox<int32_t> box;
    const auto store = [&c](const int32_t* tile, int block, int tb) {
      store_tile(c, tile, block, tb);
    };
    for (int t0 = 0; t0 < tblocks; t0 += chunk) {
      const int t1 = std::min(tblocks, t0 + chunk);
      for (int b = lo; b < hi; b += 2) {
        const int8_t* a[2] = {nullptr, nullptr};
        for (int j = 0; j < 2 && b + j < hi; ++j) {
          a[j] = c.w + static_cast<int64_t>(b + j) * FB * c.k;
          if (c.rows_of(b + j) < FB) {  // only the very last block: a copy padded with zeros
            pad.assign(static_cast<size_t>(FB) * c.k, 0);
            std::memcpy(pad.data(), a[j], static_cast<size_t>(c.rows_of(b + j)) * c.k);
            a[j] = pad.data();
          }
        }
        for (int tb = t0; tb < t1; tb += 2) {
          const auto* bt = reinterpret_cast<const char*>(xp + static_cast<int64_t>(tb) * steps * 256);
          const PassTiles tiles{reinterpret_cast<const char*>(a[0]),
                                reinterpret_cast<const char*>(a[1]), KS, c.k, bt,
                                static_cast<int64_t>(steps) * 1024};
          amx_pass<true>(tiles, steps, tb + 1 < t1, b, tb, box, store);
        }
      }
    }
    box.flush(store);
    _tile_release();
  }
}
#endif

bool amx_int8() {
#if defined(QI_HAS_AMX_INT8)
  return amx_permitted();
#else
  return false;
#endif
}

}  // namespace

// 1 where this build and CPU multiply int8 on AMX tiles, 0 elsewhere.
extern "C" int quant_int8_has_amx() { return amx_int8() ? 1 : 0; }

// The most rows of x the AVX2 dot path takes (0 where this build has none).
extern "C" int quant_int8_dot_max_rows() {
#if defined(QI_HAS_DOT)
  return DOT_MAX_ROWS;
#else
  return 0;
#endif
}

// x [m][k] (0: fp32, 1: bf16) -> q [m][k] int8 and s [m] as described above.
extern "C" int quant_int8_quantize(int dtype, const void* x, int m, int k, int8_t* q, float* s,
                                   int threads) {
  if (dtype != 0 && dtype != 1) return 1;
  quantize_rows(dtype, x, m, k, q, s, std::max(1, threads));
  return 0;
}

// out [m][n] (x's dtype) = the W8A8 product of x [m][k] and w [n][k] int8 with fp32 scales sw
// [n], on path 2 (AMX tiles: K a multiple of 64) or 1 (AVX2 dot products: K a multiple of 32,
// at most quant_int8_dot_max_rows() rows). Returns 0, or an error code.
extern "C" int quant_int8_linear(int path, int dtype, const void* x, const int8_t* w,
                                 const float* sw, void* out, int m, int n, int k, int threads) {
  if (m <= 0 || n <= 0) return 0;
  if (dtype != 0 && dtype != 1) return 1;
  if (path != 1 && path != 2) return 4;
  if (k % (path == 2 ? 64 : 32) != 0) return 2;
  if (path == 2 ? !amx_int8() : m > quant_int8_dot_max_rows()) return 3;
  threads = std::max(1, threads);
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> sx;
  grown(xq, static_cast<size_t>(m) * k);
  grown(sx, m);
  quantize_rows(dtype, x, m, k, xq.data(), sx.data(), threads);
  if (path == 1) {
#if defined(QI_HAS_DOT)
    run_dot(dtype, w, sw, xq.data(), sx.data(), out, m, n, k, threads);
#endif
    return 0;
  }
#if defined(QI_HAS_AMX_INT8)
  const Call c{dtype, w, sw, xq.data(), sx.data(), out, m, n, k};
  run_amx(c, std::min(threads, (n + FB - 1) / FB));
#endif
  return 0;
}

// Entries for a captured step's list of calls (packed_call.h).
PAGELLM_PACKED(quant_int8_linear)
