// Batch-invariant linear layers: out = x W^T (+ bias) where every output element is reduced over
// K in one fixed order, whatever the number of rows of x, the row's place among them and the
// number of threads. Library GEMMs pick their blocking (and on few rows, a split of K over the
// threads) from the shape, so a row's result changes with the batch it shares a step with.
//
// The fixed order: K is consumed from 0 upwards, in pairs of inputs (bf16) or one at a time
// (fp32), each output element accumulating in float32 in its own vector lane or tile cell.
// Rows are never mixed: a row block that is not full is padded with zeros, or runs the same
// per-element instruction sequence with fewer rows. Threads split the output columns only.
//
// Weights are packed once, 16 output columns to a block:
//   bf16: [N/16][Kp/2][16][2] (VNNI pairs; Kp = K rounded up to 32, the padding zero), the
//         layout of both AMX's B tiles and AVX-512 BF16's dot products;
//   fp32: [N/16][K][16].
// Paths (one per machine; results are the same for every batch on a machine, not across paths):
//   2  AMX (Xeon Sapphire Rapids and later): 16x16 fp32 tiles, TDPBF16PS over 32 inputs a step;
//   1  AVX-512 BF16 (Zen 4 / Zen 5, Cooper Lake): VDPBF16PS, 16 columns a vector, 8 rows x 32
//      columns of accumulators;
//   0  any CPU: FMA in float32 (explicit fused multiply-adds, so vectorization cannot reorder).
// bf16 inputs may take any path (the tests run every path on one machine); fp32 takes path 0.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <immintrin.h>
#include <omp.h>

#include "amx_common.h"
#include "cpu_common.h"

namespace {

using namespace pagellm;

constexpr int NB = 16;       // output columns per packed block
constexpr int KBLK = 32;     // bf16 inputs per AMX step (K is padded to it)
constexpr int MCHUNK = 256;  // rows of x kept hot in L2 while a thread sweeps its columns
#ifndef PAGELLM_INV_AVX2_ROWS
#define PAGELLM_INV_AVX2_ROWS 6  // rows per register tile on AVX2 (12 accumulators)
#endif

struct Args {
  int dtype;  // 0 fp32, 1 bf16 (x, W and out share it)
  const void* x;
  const void* w;
  const float* bias;
  void* out;
  int m, n, k, kp;  // kp: K as packed (bf16: a multiple of 32; fp32: k)
};

inline float bf16_to_float(uint16_t v) { return to_float(v); }

template <typename T>
inline void store_row(const Args& a, const float* acc, int row, int col0, int cols) {
  T* out = static_cast<T*>(a.out) + static_cast<int64_t>(row) * a.n + col0;
  for (int j = 0; j < cols; ++j) {
    float v = acc[j];
    if (a.bias != nullptr) v += a.bias[col0 + j];
    store(out + j, v);
  }
}

inline void store_any(const Args& a, const float* acc, int row, int col0, int cols) {
#if defined(__AVX512BF16__)
  if (a.dtype == 1 && cols == NB) {  // a whole block: add the bias and round 16 lanes at once
    __m512 v = _mm512_loadu_ps(acc);
    if (a.bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(a.bias + col0));
    uint16_t* out = static_cast<uint16_t*>(a.out) + static_cast<int64_t>(row) * a.n + col0;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
    return;
  }
#endif
  if (a.dtype == 0) {
    store_row<float>(a, acc, row, col0, cols);
  } else {
    store_row<uint16_t>(a, acc, row, col0, cols);
  }
}

// The column blocks [lo, hi) of the thread `t` of `threads`: contiguous, as even as can be.
inline void my_blocks(int blocks, int t, int threads, int& lo, int& hi) {
  const int base = blocks / threads, extra = blocks % threads;
  lo = t * base + std::min(t, extra);
  hi = lo + base + (t < extra ? 1 : 0);
}

// Rows [mc, mc + MCHUNK) of x and out as a call of their own.
inline Args chunk_of(const Args& a, int mc) {
  Args part = a;
  const int64_t elem = a.dtype == 0 ? 4 : 2;
  part.m = std::min(MCHUNK, a.m - mc);
  part.x = static_cast<const char*>(a.x) + mc * (a.dtype == 0 ? a.k : a.kp) * elem;
  part.out = static_cast<char*>(a.out) + mc * static_cast<int64_t>(a.n) * elem;
  return part;
}

// ----- path 0: float32 FMAs, any CPU ---------------------------------------------------------

typedef float v16 __attribute__((vector_size(64)));
typedef uint32_t u16x __attribute__((vector_size(64)));

inline v16 fma16(v16 a, v16 b, v16 c) {
#if defined(__AVX512F__)
  return reinterpret_cast<v16>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a),
                                               reinterpret_cast<__m512>(b),
                                               reinterpret_cast<__m512>(c)));
#elif defined(__FMA__)
  __m256 lo_a, hi_a, lo_b, hi_b, lo_c, hi_c;
  std::memcpy(&lo_a, &a, 32), std::memcpy(&hi_a, reinterpret_cast<char*>(&a) + 32, 32);
  std::memcpy(&lo_b, &b, 32), std::memcpy(&hi_b, reinterpret_cast<char*>(&b) + 32, 32);
  std::memcpy(&lo_c, &c, 32), std::memcpy(&hi_c, reinterpret_cast<char*>(&c) + 32, 32);
  lo_c = _mm256_fmadd_ps(lo_a, lo_b, lo_c);
  hi_c = _mm256_fmadd_ps(hi_a, hi_b, hi_c);
  v16 r;
  std::memcpy(&r, &lo_c, 32), std::memcpy(reinterpret_cast<char*>(&r) + 32, &hi_c, 32);
  return r;
#else
  v16 r;
  for (int i = 0; i < 16; ++i) r[i] = std::fma(a[i], b[i], c[i]);
  return r;
#endif
}

inline v16 splat(float v) { return v16{} + v; }

// R rows x one block of 16 columns. float: weights [K][16], one FMA per input; bf16: VNNI-pair
// weights, two FMAs per pair (element 0, then 1), every value widened to float32 exactly.
template <typename T, int R>
void rows_fma(const Args& a, int m0, int blk) {
  const T* x = static_cast<const T*>(a.x);
  const T* w = static_cast<const T*>(a.w) + static_cast<int64_t>(blk) * a.kp * NB;
  v16 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = v16{};
  if constexpr (std::is_same_v<T, float>) {
    for (int kk = 0; kk < a.k; ++kk) {
      v16 wv;
      std::memcpy(&wv, w + static_cast<int64_t>(kk) * NB, 64);
      for (int r = 0; r < R; ++r)
        acc[r] = fma16(splat(x[static_cast<int64_t>(m0 + r) * a.k + kk]), wv, acc[r]);
    }
  } else {
    const u16x hi_mask = u16x{} + 0xFFFF0000u;
    for (int kk = 0; kk < a.kp / 2; ++kk) {
      u16x raw;
      std::memcpy(&raw, w + static_cast<int64_t>(kk) * 2 * NB, 64);
      const v16 w0 = reinterpret_cast<v16>(raw << 16);
      const v16 w1 = reinterpret_cast<v16>(raw & hi_mask);
      for (int r = 0; r < R; ++r) {
        const uint16_t* xr = x + static_cast<int64_t>(m0 + r) * a.kp + 2 * kk;
        acc[r] = fma16(splat(bf16_to_float(xr[0])), w0, acc[r]);
        acc[r] = fma16(splat(bf16_to_float(xr[1])), w1, acc[r]);
      }
    }
  }
  const int cols = std::min(NB, a.n - blk * NB);
  for (int r = 0; r < R; ++r) {
    float tmp[NB];
    std::memcpy(tmp, &acc[r], 64);
    store_any(a, tmp, m0 + r, blk * NB, cols);
  }
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// rows_fma for AVX2's 16 registers: each element takes the same FMA sequence as there (so the
// results are the same bits), in two 8-lane halves, with more rows per tile (R x 2 accumulators,
// the weights' 16 lanes loaded once for all R rows). bf16: every row's step-0 FMA of a pair,
// then every row's step-1 FMA, so each accumulator still sees element 0, then element 1.
template <typename T, int R>
void rows_fma_avx2(const Args& a, int m0, int blk) {
  const T* x = static_cast<const T*>(a.x);
  const T* w = static_cast<const T*>(a.w) + static_cast<int64_t>(blk) * a.kp * NB;
  __m256 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  if constexpr (std::is_same_v<T, float>) {
    const float* xr[R];
    for (int r = 0; r < R; ++r) xr[r] = x + static_cast<int64_t>(m0 + r) * a.k;
    for (int kk = 0; kk < a.k; ++kk) {
      const __m256 wl = _mm256_loadu_ps(w + static_cast<int64_t>(kk) * NB);
      const __m256 wh = _mm256_loadu_ps(w + static_cast<int64_t>(kk) * NB + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_broadcast_ss(xr[r] + kk);
        lo[r] = _mm256_fmadd_ps(xv, wl, lo[r]);
        hi[r] = _mm256_fmadd_ps(xv, wh, hi[r]);
      }
    }
  } else {
    const uint16_t* xr[R];
    for (int r = 0; r < R; ++r) xr[r] = x + static_cast<int64_t>(m0 + r) * a.kp;
    const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int kk = 0; kk < a.kp / 2; ++kk) {
      const __m256i* pw = reinterpret_cast<const __m256i*>(w + static_cast<int64_t>(kk) * 2 * NB);
      __m256 wl = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(pw), 16));
      __m256 wh = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(pw + 1), 16));
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_set1_ps(bf16_to_float(xr[r][2 * kk]));
        lo[r] = _mm256_fmadd_ps(xv, wl, lo[r]);
        hi[r] = _mm256_fmadd_ps(xv, wh, hi[r]);
      }
      wl = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(pw), hi_mask));
      wh = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(pw + 1), hi_mask));
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_set1_ps(bf16_to_float(xr[r][2 * kk + 1]));
        lo[r] = _mm256_fmadd_ps(xv, wl, lo[r]);
        hi[r] = _mm256_fmadd_ps(xv, wh, hi[r]);
      }
    }
  }
  const int cols = std::min(NB, a.n - blk * NB);
  for (int r = 0; r < R; ++r) {
    float tmp[NB];
    _mm256_storeu_ps(tmp, lo[r]);
    _mm256_storeu_ps(tmp + 8, hi[r]);
    store_any(a, tmp, m0 + r, blk * NB, cols);
  }
}
#endif

// Rows of x in register tiles of R (full tiles by Full, the rest one by one), column block blk.
template <int R, void (*Full)(const Args&, int, int), void (*One)(const Args&, int, int)>
void sweep(const Args& a, int blk) {
  int m0 = 0;
  for (; m0 + R <= a.m; m0 += R) Full(a, m0, blk);
  for (; m0 < a.m; ++m0) One(a, m0, blk);
}

// Each thread takes a contiguous run of `units` (column blocks, or pairs of them) and, chunk of
// rows by chunk, calls fn(rows, unit) for each: the columns alone are split.
template <typename Fn>
void over_columns(const Args& a, int threads, int units, Fn fn) {
#pragma omp parallel num_threads(threads)
  {
    int lo, hi;
    my_blocks(units, omp_get_thread_num(), omp_get_num_threads(), lo, hi);
    for (int mc = 0; mc < a.m; mc += MCHUNK) {
      const Args part = chunk_of(a, mc);
      for (int u = lo; u < hi; ++u) fn(part, u);
    }
  }
}

constexpr int RMAX = 4;

void run_path0(const Args& a, int threads) {
  over_columns(a, threads, (a.n + NB - 1) / NB, [](const Args& part, int blk) {
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    constexpr int R2 = PAGELLM_INV_AVX2_ROWS;
    if (part.dtype == 0) {
      sweep<R2, rows_fma_avx2<float, R2>, rows_fma_avx2<float, 1>>(part, blk);
    } else {
      sweep<R2, rows_fma_avx2<uint16_t, R2>, rows_fma_avx2<uint16_t, 1>>(part, blk);
    }
    return;
#endif
    if (part.dtype == 0) {
      sweep<RMAX, rows_fma<float, RMAX>, rows_fma<float, 1>>(part, blk);
    } else {
      sweep<RMAX, rows_fma<uint16_t, RMAX>, rows_fma<uint16_t, 1>>(part, blk);
    }
  });
}

// ----- path 1: AVX-512 BF16 dot products -----------------------------------------------------

#if defined(__AVX512BF16__)
// R rows x C (1 or 2) column blocks from blk: C x R accumulators, each weight vector loaded once
// for the R rows; every element still sums its pairs from kk = 0 up, whatever R and C are.
template <int R, int C>
void rows_dpbf16(const Args& a, int m0, int blk) {
  const uint16_t* x = static_cast<const uint16_t*>(a.x);
  const int64_t blk_elems = static_cast<int64_t>(a.kp) * NB;
  const uint16_t* w = static_cast<const uint16_t*>(a.w) + blk * blk_elems;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int kk = 0; kk < a.kp / 2; ++kk) {
    __m512bh wv[C];
    for (int c = 0; c < C; ++c)
      wv[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + c * blk_elems + static_cast<int64_t>(kk) * 2 * NB));
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      std::memcpy(&pair, x + static_cast<int64_t>(m0 + r) * a.kp + 2 * kk, 4);
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pair)));
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
    }
  }
  for (int c = 0; c < C; ++c) {
    const int cols = std::min(NB, a.n - (blk + c) * NB);
    for (int r = 0; r < R; ++r) {
      float tmp[NB];
      _mm512_storeu_ps(tmp, acc[r][c]);
      store_any(a, tmp, m0 + r, (blk + c) * NB, cols);
    }
  }
}

constexpr int RDP = 8;  // rows per register tile: 2 x 8 accumulators, 2 weight vectors

void run_path1(const Args& a, int threads) {
  const int blocks = (a.n + NB - 1) / NB;
  over_columns(a, threads, (blocks + 1) / 2, [blocks](const Args& part, int p) {
    if (2 * p + 1 < blocks) {
      sweep<RDP, rows_dpbf16<RDP, 2>, rows_dpbf16<1, 2>>(part, 2 * p);
    } else {
      sweep<RDP, rows_dpbf16<RDP, 1>, rows_dpbf16<1, 1>>(part, 2 * p);
    }
  });
}
#endif

// ----- path 2: AMX tiles ---------------------------------------------------------------------

#if defined(PAGELLM_HAS_AMX)
// Tiles: 0-3 C (rows 0-15 / 16-31 x columns of block b0 / b1), 4-5 A (the two row halves),
// 6-7 B (the two column blocks). Every tile is 16 rows of 64 bytes (amx_common.h).
// rows [m0, m0 + 32) of x (a 32-row panel padded with zero rows when x has fewer) times column
// blocks b0 and b1 (b1 < 0: none); acc holds C [32][32].
void amx_panel(const Args& a, const uint16_t* xp, int64_t x_stride, int rows, int b0, int b1,
               float* acc) {
  const uint16_t* w = static_cast<const uint16_t*>(a.w);
  const int64_t blk_elems = static_cast<int64_t>(a.kp) * NB;
  const uint16_t* w0 = w + b0 * blk_elems;
  const uint16_t* w1 = b1 >= 0 ? w + b1 * blk_elems : w0;
  const int steps = a.kp / KBLK;
  const bool two_rows = rows > 16, two_cols = b1 >= 0;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int s = 0; s < steps; ++s) {
    _tile_loadd(4, xp + s * KBLK, x_stride * 2);
    _tile_loadd(6, w0 + static_cast<int64_t>(s) * KBLK * NB, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (two_cols) {
      _tile_loadd(7, w1 + static_cast<int64_t>(s) * KBLK * NB, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (two_rows) {
      _tile_loadd(5, xp + 16 * x_stride + s * KBLK, x_stride * 2);
      _tile_dpbf16ps(2, 5, 6);
      if (two_cols) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, acc, 32 * 4);
  if (two_cols) _tile_stored(1, acc + 16, 32 * 4);
  if (two_rows) {
    _tile_stored(2, acc + 16 * 32, 32 * 4);
    if (two_cols) _tile_stored(3, acc + 16 * 32 + 16, 32 * 4);
  }
}

void run_path2(const Args& a, int threads) {
  const int blocks = (a.n + NB - 1) / NB;
  const int pairs = (blocks + 1) / 2;
  const uint16_t* x = static_cast<const uint16_t*>(a.x);
#pragma omp parallel num_threads(threads)
  {
    amx_load_config();
    int lo, hi;
    my_blocks(pairs, omp_get_thread_num(), omp_get_num_threads(), lo, hi);
    alignas(64) float acc[32 * 32];
    std::vector<uint16_t> pad;  // the chunk's last panel when it has fewer than 32 rows
    for (int mc = 0; mc < a.m; mc += MCHUNK) {
      const int mend = std::min(a.m, mc + MCHUNK);
      const int tail0 = mc + (mend - mc) / 32 * 32;
      if (tail0 < mend) {
        pad.assign(static_cast<size_t>(32) * a.kp, 0);
        std::memcpy(pad.data(), x + static_cast<int64_t>(tail0) * a.kp,
                    static_cast<size_t>(mend - tail0) * a.kp * 2);
      }
      for (int p = lo; p < hi; ++p) {
        const int b0 = 2 * p, b1 = 2 * p + 1 < blocks ? 2 * p + 1 : -1;
        for (int m0 = mc; m0 < mend; m0 += 32) {
          const int rows = std::min(32, mend - m0);
          const uint16_t* xp = rows < 32 ? pad.data() : x + static_cast<int64_t>(m0) * a.kp;
          amx_panel(a, xp, a.kp, rows, b0, b1, acc);
          for (int r = 0; r < rows; ++r) {
            store_any(a, acc + r * 32, m0 + r, b0 * NB, std::min(NB, a.n - b0 * NB));
            if (b1 >= 0) store_any(a, acc + r * 32 + 16, m0 + r, b1 * NB, std::min(NB, a.n - b1 * NB));
          }
        }
      }
    }
    _tile_release();
  }
}
#endif

int best_path() { return best_bf16_path(); }

}  // namespace

// The fastest path this build and CPU have for bf16 (fp32 always takes 0).
extern "C" int invariant_linear_best_path() { return best_path(); }

// x: [m, k] (fp32) or [m, kp] (bf16, zero-padded past k), contiguous; w packed as above; bias
// float32 [n] or null; out [m, n] in x's dtype. Returns 0, or an error code.
extern "C" int invariant_linear(int path, int dtype, const void* x, const void* w,
                                const float* bias, void* out, int m, int n, int k, int kp,
                                int threads) {
  if (m <= 0 || n <= 0) return 0;
  if (dtype != 0 && dtype != 1) return 1;
  if (dtype == 0 && path != 0) return 2;
  if (dtype == 1 && kp % KBLK != 0) return 3;
  if (path > best_path()) return 4;
  Args a{dtype, x, w, bias, out, m, n, k, dtype == 0 ? k : kp};
  const int blocks = (n + NB - 1) / NB;
  threads = std::max(1, std::min(threads, blocks));
  switch (path) {
#if defined(PAGELLM_HAS_AMX)
    case 2: run_path2(a, threads); return 0;
#endif
#if defined(__AVX512BF16__)
    case 1: run_path1(a, threads); return 0;
#endif
    case 0: run_path0(a, threads); return 0;
    default: return 4;
  }
}
