// y = x W^T (+ bias) for bf16 x and W on AMX tiles, W read as it is stored ([n][k] row-major):
// the few-rows steps (decodes, a long prompt's cut chunks beside them) that oneDNN serves at
// 11-20 GB/s of weight where the weight stream alone allows ~30 (Xeon, SmolLM2's shapes, 1-32
// rows). Sixteen rows of W and 32 of its inputs are an A tile as they lie (row stride k), so a
// weight needs no packing and no second copy; x is packed once per call into B tiles (pairs of
// inputs by 16 rows of x, VNNI order) and each C^T = W x^T tile is transposed as it is stored.
// Threads split the output features; each streams its rows of W once for all rows of x, the
// next pair of feature blocks fetched into L2 while this pair multiplies. fp32 accumulation, one
// rounding to bf16 at the end (after the bias, in fp32).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <immintrin.h>
#include <omp.h>

#include "amx_common.h"
#include "aligned_vector.h"
#include "amx_pass.h"
#include "tile_transpose.h"
#include "packed_call.h"

namespace {

using namespace pagellm;

#ifndef BT_PREFETCH  // 0: no software prefetch (A/B)
#define BT_PREFETCH 1
#endif
#if defined(PAGELLM_HAS_AMX)
constexpr int FB = 16;  // output features per block (rows of an A tile)
constexpr int KS = 32;  // inputs per step (bf16 values of an A tile row)

struct Call {
  const uint16_t* x;    // [m][k]
  const uint16_t* w;    // [n][k]
  const float* bias;    // [n] or null
  uint16_t* out;        // [m][n]
  int m, n, k;
  int steps() const { return k / KS; }
  int cols_of(int block) const { return std::min(FB, n - block * FB); }
};

// One C^T tile [16 features][16 rows of x] (fp32, stride 16) into out as rows, plus the bias.
void store_tile(const Call& c, const float* tile, int block, int tb) {
  __m512i r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(tile + i * 16);
  transpose16(r);
  const int cols = c.cols_of(block), rows = std::min(16, c.m - tb * 16);
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
  const __m512 bias = c.bias ? _mm512_maskz_loadu_ps(mask, c.bias + block * FB) : _mm512_setzero_ps();
  for (int t = 0; t < rows; ++t) {
    const __m512 v = _mm512_add_ps(reinterpret_cast<__m512>(r[t]), bias);
    const __m256i b = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
    _mm256_mask_storeu_epi16(c.out + static_cast<int64_t>(tb * 16 + t) * c.n + block * FB, mask, b);
  }
}

void run(const Call& c, int threads) {
  const int blocks = (c.n + FB - 1) / FB, steps = c.steps();
  const int tblocks = (c.m + 15) / 16, items = tblocks * steps;
  thread_local AlignedVector<uint32_t> packed;
  uint32_t* xp = grown(packed, static_cast<size_t>(items) * 256);
  const int64_t row_bytes = static_cast<int64_t>(c.k) * 2;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int i = 0; i < items; ++i)
      pack_b_item(reinterpret_cast<const char*>(c.x), row_bytes, c.m, steps, i, xp);
    amx_load_config();
    int lo, hi;
    my_blocks(blocks, omp_get_thread_num(), omp_get_num_threads(), lo, hi);
    // a last block of fewer than 16 features is copied into zero-padded rows: a tile reads 16
    thread_local AlignedVector<uint16_t> tail;
    Outbox<float> box;
    const auto store = [&c](const float* tile, int block, int tb) { store_tile(c, tile, block, tb); };
    const auto block_rows = [&](int b) -> const char* {
      if (c.cols_of(b) == FB) return reinterpret_cast<const char*>(c.w + static_cast<int64_t>(b) * FB * c.k);
      tail.assign(static_cast<size_t>(FB) * c.k, 0);
      std::memcpy(tail.data(), c.w + static_cast<int64_t>(b) * FB * c.k, c.cols_of(b) * row_bytes);
      return reinterpret_cast<const char*>(tail.data());
    };
    for (int b = lo; b < hi; b += 2) {
      const char* a0 = block_rows(b);
      const char* a1 = b + 1 < hi ? block_rows(b + 1) : nullptr;
      // Step s of the first row block's pass fetches step s of the next pair's rows into L2:
      // a few lines per step keep the stream ahead (fetching the whole next pair at once cost
      // 1.1-1.2x: the prefetches queue behind each other).
      const char* next = BT_PREFETCH && b + 2 < hi ? reinterpret_cast<const char*>(c.w + static_cast<int64_t>(b + 2) * FB * c.k) : nullptr;
      const int next_rows = next ? std::min(2 * FB, c.n - (b + 2) * FB) : 0;
      for (int tb = 0; tb < tblocks; tb += 2) {
        const auto* bt = reinterpret_cast<const char*>(xp + static_cast<int64_t>(tb) * steps * 256);
        const PassTiles tiles{a0, a1, KS * 2, row_bytes, bt, static_cast<int64_t>(steps) * 1024};
        const int fetch_rows = tb == 0 ? next_rows : 0;
        const auto fetch = [&](int s) {
          for (int r = 0; r < fetch_rows; ++r) _mm_prefetch(next + r * row_bytes + s * 64, _MM_HINT_T1);
        };
        amx_pass<false>(tiles, steps, tb + 1 < tblocks, b, tb, box, store, fetch);
      }
    }
    box.flush(store);
    _tile_release();
  }
}
#endif

}  // namespace

// Whether this build and CPU run the kernel (AMX permitted).
extern "C" int bf16_tiles_available() {
#if defined(PAGELLM_HAS_AMX)
  return amx_permitted() ? 1 : 0;
#else
  return 0;
#endif
}

// out[m][n] = x[m][k] W[n][k]^T (+ bias[n], fp32), x, W and out bf16; k a multiple of 32.
// Returns 0, or an error code (5: k, 6: no AMX here).
extern "C" int bf16_tiles_linear(const uint16_t* x, const uint16_t* w, const float* bias,
                                 uint16_t* out, int m, int n, int k, int threads) {
  if (m <= 0 || n <= 0) return 0;
  if (k <= 0 || k % 32 != 0) return 5;
#if defined(PAGELLM_HAS_AMX)
  if (!amx_permitted()) return 6;
  const Call c{x, w, bias, out, m, n, k};
  run(c, std::max(1, std::min(threads, (n + FB - 1) / FB)));
  return 0;
#else
  (void)x, (void)w, (void)bias, (void)out, (void)threads;
  return 6;
#endif
}

// Entries for a captured step's list of calls (packed_call.h).
PAGELLM_PACKED(bf16_tiles_linear)
