// y = x W^T (+ bias) for a few rows of x (at most 32): decode steps' linear layers, and the
// small mixed steps of a long prompt cut into chunks while others decode. With few tokens a step
// streams every weight once and does little arithmetic with it, so the step is
// bounded by memory bandwidth; torch's CPU GEMM reads such a weight on one core (~9.5 GB/s on
// a Zen 2/3 EPYC, where two cores read ~19 GB/s). Here the output features are split over
// torch's OpenMP pool (the library links libgomp by its soname), each thread streaming its own
// rows of W once for all the tokens. fp32 accumulation; W and x are fp32 or bf16.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <immintrin.h>

#include "cpu_common.h"
#include "packed_call.h"

namespace {

using namespace pagellm;
using pagellm::loadv;  // overloaded below for bf16

inline vf loadv(const uint16_t* p) {  // bf16 -> fp32
  uint32_t bits[VW];
  for (int i = 0; i < VW; ++i) bits[i] = static_cast<uint32_t>(p[i]) << 16;
  vf v;
  std::memcpy(&v, bits, sizeof v);
  return v;
}
inline float hsum(vf v) {
  float s = 0.f;
  for (int i = 0; i < VW; ++i) s += v[i];
  return s;
}

// R rows of W against the M rows of x (fp32 copies in xf, row stride k): out[m][n + r].
// A decode step is a stream of W from memory, and the hardware's prefetch left the few-rows
// kernel waiting on it: fetched by hand, 30 layers of SmolLM2's shapes and its LM head took, at
// 1 / 2 / 4 / 8 / 16 / 32 rows of x, bf16 1.10 / 1.16 / 1.31 / 1.17 / 1.09 / 1.04x less time,
// fp32 1.00 / 1.06 / 1.11 / 1.07 / 1.04 / 0.99x (AVX2 Zen 3, 2 threads, medians of 7). Only the
// first block of x against a slice of W fetches the rows PREFETCH_ROWS on: later blocks find the
// slice in L1, and fetching there too cost 32 rows of x 1.1x.
constexpr int PREFETCH_ROWS = 8;

template <typename T, int M, int R>
void rows_block(const T* w, const float* xf, int k, int n, float* acc_out, bool fetch_ahead) {
  vf acc[M][R] = {};
  const int kv = k - k % VW;
  constexpr int LINE = 64 / sizeof(T);  // elements of a cache line
  for (int c = 0; c < kv; c += VW) {
#if !defined(SK_NO_PREFETCH)
    if (fetch_ahead && c % LINE == 0)
      for (int r = 0; r < R; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w + static_cast<int64_t>(n + r + PREFETCH_ROWS) * k + c), _MM_HINT_T0);
#endif
    vf wv[R];
    for (int r = 0; r < R; ++r) wv[r] = loadv(w + static_cast<int64_t>(n + r) * k + c);
    for (int m = 0; m < M; ++m) {
      const vf xv = loadv(xf + static_cast<int64_t>(m) * k + c);
      for (int r = 0; r < R; ++r) acc[m][r] += wv[r] * xv;
    }
  }
  for (int m = 0; m < M; ++m) {
    for (int r = 0; r < R; ++r) {
      float s = hsum(acc[m][r]);
      for (int c = kv; c < k; ++c) {
        s += to_float(w[static_cast<int64_t>(n + r) * k + c]) * xf[static_cast<int64_t>(m) * k + c];
      }
      acc_out[m * R + r] = s;
    }
  }
}

// Register blocking: RW rows of W against XB rows of x, RW * XB accumulators + RW + 1 loads in
// registers, so each step of the K loop loads RW + XB vectors for RW * XB FMAs. Eight rows of x
// against one W row (the obvious loop) loaded 9 vectors for 8 FMAs and was bound by loads; 4 x 2
// (13 registers of AVX2's 16) read the weights of a 135M model ~1.2x faster at 8-32 tokens; the
// other shapes tried (3x4, 3x3, 2x4, 5x2, 6x2, 8x1) were within the noise of this machine.
#ifndef SK_RW
#define SK_RW 4
#endif
#ifndef SK_XB
#define SK_XB 2
#endif
constexpr int RW = SK_RW;
constexpr int XB = SK_XB;

// Rows [n, n + nrows) of W (nrows <= RW) against an MB-row block of x: out rows of that block.
template <typename T, int MB>
void block_rows(const T* w, const float* xf, int k, int n, int nrows, const T* bias, T* out,
                int n_out, bool fetch_ahead) {
  float res[MB * RW];
  if (nrows == RW) {
    rows_block<T, MB, RW>(w, xf, k, n, res, fetch_ahead);
  } else {
    for (int r = 0; r < nrows; ++r) {
      float part[MB];
      rows_block<T, MB, 1>(w, xf, k, n + r, part, fetch_ahead);
      for (int m = 0; m < MB; ++m) res[m * RW + r] = part[m];
    }
  }
  for (int r = 0; r < nrows; ++r) {
    const float b0 = bias ? to_float(bias[n + r]) : 0.f;
    for (int m = 0; m < MB; ++m) store(out + static_cast<int64_t>(m) * n_out + n + r, res[m * RW + r] + b0);
  }
}

using BlockFn = void (*)(const void*, const float*, int, int, int, const void*, void*, int, bool);

template <typename T, int MB>
void block_entry(const void* w, const float* xf, int k, int n, int nrows, const void* bias,
                 void* out, int n_out, bool fetch_ahead) {
  block_rows<T, MB>(static_cast<const T*>(w), xf, k, n, nrows, static_cast<const T*>(bias),
                    static_cast<T*>(out), n_out, fetch_ahead);
}

template <typename T>
BlockFn block_fn(int mb) {
  static_assert(XB >= 1 && XB <= 4, "x blocks of 1 to 4 rows");
  switch (mb) {
    case 1: return block_entry<T, 1>;
    case 2: return block_entry<T, 2 <= XB ? 2 : 1>;
    case 3: return block_entry<T, 3 <= XB ? 3 : 1>;
    default: return block_entry<T, XB>;
  }
}

constexpr int MAX_ROWS = 32;  // past this torch's GEMM catches up

#if defined(__AVX512BF16__) && PAGELLM_VEC_WIDTH == 16
#define SK_BF16_DOT 1
// bf16 W and x where the CPU has AVX-512 BF16 (Zen 4 / Zen 5): VDPBF16PS multiplies 32 inputs
// of a row of W by the same 32 of a row of x into 16 fp32 lanes (pairs summed), and a thread
// takes 16 rows of W at a time and sums their lanes together at the end (one transposing
// reduction and one store of 16 outputs a row of x). W is read as stored.
//
// Where such a CPU has no AMX, torch's bf16 GEMM (oneDNN, weights packed once) read the weights
// of SmolLM2's 30 layers at 19 GB/s at one row of x (a 2-core Zen 4 whose memory streams ~29-35
// GB/s). Here, one row of W at a time (one stream a thread: four rows of W side by side read at
// 22 GB/s, one at 27-29), they take 7.2-7.9 ms against oneDNN's 11.1 at one row and 8.4
// against 11.7 at two; from four rows on oneDNN is as fast or faster (even with four rows of W a
// pass sharing each load of x: 4: 10.0 against 9.8, 8: 12.3 against 11.6, 16: 16.7 against
// 14.7), so the layers send this path at most DOT_MAX_ROWS rows (it computes up to MAX_ROWS).
constexpr int DOT_BLOCK = 16;  // rows of W a thread takes at a time
constexpr int DOT_MAX_ROWS = 3;
#ifndef SK_DOT_PREFETCH_ROWS
#define SK_DOT_PREFETCH_ROWS 8
#endif

// Row n of W against rows [x0, x0 + XR) of x, per lane, into acc[row of x][16] (from the block's
// first row of W). W's rows are fetched ahead on the first pass over them (x0 0).
template <int XR>
void dot_pass(const uint16_t* x, const uint16_t* w, int k, int x0, int n, __m512* acc) {
  __m512 a[XR];
  for (int i = 0; i < XR; ++i) a[i] = _mm512_setzero_ps();
  const uint16_t* wr = w + static_cast<int64_t>(n) * k;
  const uint16_t* xr[XR];
  for (int i = 0; i < XR; ++i) xr[i] = x + static_cast<int64_t>(x0 + i) * k;
  const int64_t ahead = x0 == 0 ? static_cast<int64_t>(SK_DOT_PREFETCH_ROWS) * k : 0;
  const int whole = k - k % 32;
  auto step = [&](int c, __mmask32 mask, bool full) {
    if (ahead) _mm_prefetch(reinterpret_cast<const char*>(wr + ahead + c), _MM_HINT_T0);
    const __m512bh wv = reinterpret_cast<__m512bh>(full ? _mm512_loadu_si512(wr + c) : _mm512_maskz_loadu_epi16(mask, wr + c));
    for (int i = 0; i < XR; ++i) {
      const __m512bh xv = reinterpret_cast<__m512bh>(full ? _mm512_loadu_si512(xr[i] + c) : _mm512_maskz_loadu_epi16(mask, xr[i] + c));
      a[i] = _mm512_dpbf16_ps(a[i], xv, wv);
    }
  };
  for (int c = 0; c < whole; c += 32) step(c, ~__mmask32{0}, true);
  if (whole < k) step(whole, static_cast<__mmask32>((1u << (k - whole)) - 1), false);
  for (int i = 0; i < XR; ++i) acc[(x0 + i) * DOT_BLOCK] = a[i];
}

// Row n of W against every row of x: passes of 4, 2 and 1 rows of x.
void dot_row(const uint16_t* x, const uint16_t* w, int m, int k, int n, __m512* acc) {
  int x0 = 0;
  for (; x0 + 4 <= m; x0 += 4) dot_pass<4>(x, w, k, x0, n, acc);
  if (x0 + 2 <= m) dot_pass<2>(x, w, k, x0, n, acc), x0 += 2;
  if (x0 < m) dot_pass<1>(x, w, k, x0, n, acc);
}

int run_bf16_dot(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* out, int m,
                 int n_out, int k, int threads) {
  if (m < 1 || m > MAX_ROWS) return 3;
  const int blocks = (n_out + DOT_BLOCK - 1) / DOT_BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int b = 0; b < blocks; ++b) {
    const int n0 = b * DOT_BLOCK, rows = std::min(DOT_BLOCK, n_out - n0);
    __m512 acc[MAX_ROWS * DOT_BLOCK];
    for (int r = 0; r < rows; ++r) dot_row(x, w, m, k, n0 + r, acc + r);
    for (int i = 0; i < m; ++i)
      for (int t = rows; t < DOT_BLOCK; ++t) acc[i * DOT_BLOCK + t] = _mm512_setzero_ps();
    const __mmask16 mask = static_cast<__mmask16>((1u << rows) - 1);
    const __m512 b16 = bias ? load16(bias + n0, mask) : _mm512_setzero_ps();
    for (int i = 0; i < m; ++i) {
      const __m512 y = _mm512_add_ps(sum_lanes16(acc + i * DOT_BLOCK), b16);
      _mm256_mask_storeu_epi16(out + static_cast<int64_t>(i) * n_out + n0, mask,
                               reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(y)));
    }
  }
  return 0;
}
#endif

// Each thread takes whole RW-row slices of W and applies them to every XB-row block of x while
// they are in L1: W is read from memory once whatever the number of rows.
template <typename T>
int run(const T* x, const T* w, const T* bias, T* out, int m, int n_out, int k, int threads) {
  if (m < 1 || m > MAX_ROWS) return 3;
  std::vector<float> xf(static_cast<size_t>(m) * k);
  for (size_t i = 0; i < xf.size(); ++i) xf[i] = to_float(x[i]);
  const int slices = (n_out + RW - 1) / RW;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int s = 0; s < slices; ++s) {
    const int n = s * RW;
    const int nrows = std::min(RW, n_out - n);
    for (int m0 = 0; m0 < m; m0 += XB) {
      const int mb = std::min(XB, m - m0);
      block_fn<T>(mb)(w, xf.data() + static_cast<size_t>(m0) * k, k, n, nrows, bias,
                      out + static_cast<int64_t>(m0) * n_out, n_out, m0 == 0);
    }
  }
  return 0;
}

}  // namespace

extern "C" int skinny_linear(int dtype_code,  // 0 = float32, 1 = bfloat16
                             const void* x, const void* w, const void* bias, void* out, int m,
                             int n, int k, int num_threads) {
  num_threads = std::max(1, num_threads);
  if (dtype_code == 0) {
    return run(static_cast<const float*>(x), static_cast<const float*>(w),
               static_cast<const float*>(bias), static_cast<float*>(out), m, n, k, num_threads);
  }
  if (dtype_code == 1) {
#if defined(SK_BF16_DOT)
    return run_bf16_dot(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(w),
                        static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(out), m, n, k,
                        num_threads);
#endif
    return run(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(w),
               static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(out), m, n, k,
               num_threads);
  }
  return 2;
}

// The most rows of x the kernel computes (every path).
extern "C" int skinny_linear_max_rows() { return MAX_ROWS; }

// The most rows of bf16 x its AVX-512 BF16 dot products are for (0: bf16 is read and computed
// in fp32, for at most skinny_linear_max_rows()).
extern "C" int skinny_linear_bf16_dot_rows() {
#if defined(SK_BF16_DOT)
  return DOT_MAX_ROWS;
#else
  return 0;
#endif
}

// Entries for a captured step's list of calls (packed_call.h).
PAGELLM_PACKED(skinny_linear)
