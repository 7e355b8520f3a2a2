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
// go out transposed one pass late (as in quant_tiles.cpp). Other CPUs: the callers quantize x
// the same way (quant_int8_quantize) and multiply with the weight-only kernels.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <immintrin.h>
#include <omp.h>

#include "amx_common.h"
#include "cpu_common.h"
#include "tile_transpose.h"

namespace {

using namespace pagellm;

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
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
#endif
  for (; i < k; ++i) {
    const float r = __builtin_nearbyintf(to_float(x[i]) / s);
    q[i] = static_cast<int8_t>(std::min(127.f, std::max(-128.f, r)));
  }
  return s;
}

void quantize_rows(int dtype, const void* x, int m, int k, int8_t* q, float* s, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int t = 0; t < m; ++t) {
    const int64_t off = static_cast<int64_t>(t) * k;
    s[t] = dtype == 0 ? quantize_row(static_cast<const float*>(x) + off, k, q + off)
                      : quantize_row(static_cast<const uint16_t*>(x) + off, k, q + off);
  }
}

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

// Item (token block, step) of x's codes as a B tile: row j = input quad j of each of 16 tokens.
void pack_item(const Call& c, int item, uint32_t* xp) {
  const int tb = item / c.steps(), s = item % c.steps();
  __m512i r[16];
  for (int i = 0; i < 16; ++i) {
    const int t = tb * 16 + i;
    r[i] = t < c.m ? _mm512_loadu_si512(c.xq + static_cast<int64_t>(t) * c.k + s * KS)
                   : _mm512_setzero_si512();
  }
  transpose16(r);
  uint32_t* dst = xp + static_cast<int64_t>(item) * 256;
  for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + i * 16, r[i]);
}

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

// A pass's C tiles, turned out while the next pass's products run (see quant_tiles.cpp).
struct Outbox {
  alignas(64) int32_t tiles[4][256];
  int block = 0, tb = 0;
  bool two_t = false, two_n = false, full = false;

  void flush(const Call& c) {
    if (!full) return;
    store_tile(c, tiles[0], block, tb);
    if (two_t) store_tile(c, tiles[1], block, tb + 1);
    if (two_n) {
      store_tile(c, tiles[2], block + 1, tb);
      if (two_t) store_tile(c, tiles[3], block + 1, tb + 1);
    }
    full = false;
  }
};

// Tiles: 0-3 C (0 = (block a, tokens tb), 1 = (a, tb+1), 2 = (a+1, tb), 3 = (a+1, tb+1)), 4-5 A
// (weight rows of blocks a, a+1: stride k), 6-7 B.
void amx_pass(const Call& c, const int8_t* a0, const int8_t* a1, int64_t a_stride,
              const uint32_t* xp, int tb, bool two_t, int block, Outbox& box) {
  const int steps = c.steps();
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const uint32_t* b0 = xp + static_cast<int64_t>(tb) * steps * 256;
  const uint32_t* b1 = b0 + static_cast<int64_t>(steps) * 256;
  for (int s = 0; s < steps; ++s) {
    _tile_loadd(4, a0 + s * KS, a_stride);
    _tile_loadd(6, b0 + s * 256, 64);
    _tile_dpbssd(0, 4, 6);
    if (a1 != nullptr) {
      _tile_loadd(5, a1 + s * KS, a_stride);
      _tile_dpbssd(2, 5, 6);
    }
    if (two_t) {
      _tile_loadd(7, b1 + s * 256, 64);
      _tile_dpbssd(1, 4, 7);
      if (a1 != nullptr) _tile_dpbssd(3, 5, 7);
    }
  }
  box.flush(c);
  _tile_stored(0, box.tiles[0], 64);
  if (two_t) _tile_stored(1, box.tiles[1], 64);
  if (a1 != nullptr) {
    _tile_stored(2, box.tiles[2], 64);
    if (two_t) _tile_stored(3, box.tiles[3], 64);
  }
  box.block = block, box.tb = tb, box.two_t = two_t, box.two_n = a1 != nullptr, box.full = true;
}

inline void my_blocks(int blocks, int t, int threads, int& lo, int& hi) {
  const int base = blocks / threads, extra = blocks % threads;
  lo = t * base + std::min(t, extra);
  hi = lo + base + (t < extra ? 1 : 0);
}

// Row blocks of packed x kept in L2 while a thread's weight blocks pass over them.
constexpr int CHUNK_KB = 512;

void run_amx(const Call& c, int threads) {
  const int blocks = (c.n + FB - 1) / FB, steps = c.steps();
  const int tblocks = (c.m + 15) / 16, items = tblocks * steps;
  thread_local std::vector<uint32_t> packed;
  packed.resize(static_cast<size_t>(items) * 256);
  uint32_t* xp = packed.data();
  const int chunk = std::max(2, (CHUNK_KB << 10) / (steps * 1024) / 2 * 2);
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int i = 0; i < items; ++i) pack_item(c, i, xp);
    amx_load_config();
    int lo, hi;
    my_blocks(blocks, omp_get_thread_num(), omp_get_num_threads(), lo, hi);
    std::vector<int8_t> pad;  // the last block's rows and zero rows, when n is not a multiple
    Outbox box;
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
        for (int tb = t0; tb < t1; tb += 2) amx_pass(c, a[0], a[1], c.k, xp, tb, tb + 1 < t1, b, box);
      }
    }
    box.flush(c);
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

// x [m][k] (0: fp32, 1: bf16) -> q [m][k] int8 and s [m] as described above.
extern "C" int quant_int8_quantize(int dtype, const void* x, int m, int k, int8_t* q, float* s,
                                   int threads) {
  if (dtype != 0 && dtype != 1) return 1;
  quantize_rows(dtype, x, m, k, q, s, std::max(1, threads));
  return 0;
}

// out [m][n] (x's dtype) = the W8A8 product of x [m][k] and w [n][k] int8 with fp32 scales sw
// [n]. K must be a multiple of 64. Returns 0, or an error code.
extern "C" int quant_int8_linear(int dtype, const void* x, const int8_t* w, const float* sw,
                                 void* out, int m, int n, int k, int threads) {
  if (m <= 0 || n <= 0) return 0;
  if (dtype != 0 && dtype != 1) return 1;
  if (k % 64 != 0) return 2;
  if (!amx_int8()) return 3;
#if defined(QI_HAS_AMX_INT8)
  threads = std::max(1, threads);
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> sx;
  xq.resize(static_cast<size_t>(m) * k);
  sx.resize(m);
  quantize_rows(dtype, x, m, k, xq.data(), sx.data(), threads);
  const Call c{dtype, w, sw, xq.data(), sx.data(), out, m, n, k};
  run_amx(c, std::min(threads, (n + FB - 1) / FB));
  return 0;
#else
  (void)x, (void)w, (void)sw, (void)out;
  return 3;
#endif
}
