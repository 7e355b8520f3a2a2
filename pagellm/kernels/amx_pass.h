// What the quantized tile kernels (quant_tiles.cpp: bf16, quant_int8.cpp: int8) share: the split
// of output blocks over threads, and on AMX the 2 x 2 pass over tiles with its out-box.
//
// A pass: C tiles 0-3 (0 = feature block a x row block tb, 1 = (a, tb + 1), 2 = (a + 1, tb),
// 3 = (a + 1, tb + 1)), A tiles 4-5 (the weight rows of blocks a, a + 1), B tiles 6-7 (x's
// packed row blocks tb, tb + 1), summed over K a step at a time. C holds C^T = W x^T: the
// callers' store turns each tile back into rows of the output.
#pragma once
#include <algorithm>
#include <cstdint>

#include "amx_common.h"
#include "tile_transpose.h"

namespace pagellm {

// The blocks [lo, hi) of thread t of `threads`: contiguous, as even as can be.
inline void my_blocks(int blocks, int t, int threads, int& lo, int& hi) {
  const int base = blocks / threads, extra = blocks % threads;
  lo = t * base + std::min(t, extra);
  hi = lo + base + (t < extra ? 1 : 0);
}

#if defined(PAGELLM_HAS_AMX)
// x's rows as B tiles: item i = (row block tb, step s) of `steps`; the tile's row j holds the
// j-th 32-bit group of inputs (a bf16 pair, an int8 quad) of each of the block's 16 rows,
// 64 bytes of each row from byte s * 64 (rows at or past m are zeros).
inline void pack_b_item(const char* x, int64_t row_bytes, int m, int steps, int item,
                        uint32_t* packed) {
  const int tb = item / steps, s = item % steps;
  __m512i r[16];
  for (int i = 0; i < 16; ++i) {
    const int t = tb * 16 + i;
    r[i] = t < m ? _mm512_loadu_si512(x + t * row_bytes + s * 64) : _mm512_setzero_si512();
  }
  transpose16(r);
  uint32_t* dst = packed + static_cast<int64_t>(item) * 256;
  for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + i * 16, r[i]);
}

// A pass's C tiles wait in memory until the next pass's products are issued, so that the vector
// units turn one pass out while the AMX unit computes the next (and read tiles whose stores have
// landed). Turning tiles out right after the pass took ~0.3 ms of a 0.8 ms 256 x 576 x 3072
// call (timed by leaving it out); one pass late, the call took 0.56 ms where it had taken 0.62
// in the same (noisy) run.
template <typename T>
struct Outbox {
  alignas(64) T tiles[4][256];
  int block = 0, tb = 0;
  bool two_t = false, two_n = false, full = false;

  // store(tile, block, tb) for each tile held, then empty.
  template <typename Store>
  void flush(Store&& store) {
    if (!full) return;
    store(tiles[0], block, tb);
    if (two_t) store(tiles[1], block, tb + 1);
    if (two_n) {
      store(tiles[2], block + 1, tb);
      if (two_t) store(tiles[3], block + 1, tb + 1);
    }
    full = false;
  }
};

// Where a pass reads its tiles (bytes): step s's A tile of a block at a + s * a_step with rows
// a_stride apart (a1 null: one feature block); B tiles of row block tb at b + s * 1024, the next
// row block b_block further (when two_t).
struct PassTiles {
  const char *a0, *a1;
  int64_t a_step, a_stride;
  const char* b;
  int64_t b_block;
};

struct NoFetch {
  void operator()(int) const {}
};

// One pass over `steps` steps (INT8: TDPBSSD, else TDPBF16PS); the previous pass's out-box is
// emptied through `store` while this pass's products run, then refilled. fetch(s) runs before
// step s's tiles load (prefetches of what a later pass reads).
template <bool INT8, typename T, typename Store, typename Fetch = NoFetch>
void amx_pass(const PassTiles& p, int steps, bool two_t, int block, int tb, Outbox<T>& box,
              Store&& store, Fetch&& fetch = Fetch{}) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int s = 0; s < steps; ++s) {
    fetch(s);
    const char* b0 = p.b + static_cast<int64_t>(s) * 1024;
    _tile_loadd(4, p.a0 + s * p.a_step, p.a_stride);
    _tile_loadd(6, b0, 64);
    if constexpr (INT8) _tile_dpbssd(0, 4, 6); else _tile_dpbf16ps(0, 4, 6);
    if (p.a1 != nullptr) {
      _tile_loadd(5, p.a1 + s * p.a_step, p.a_stride);
      if constexpr (INT8) _tile_dpbssd(2, 5, 6); else _tile_dpbf16ps(2, 5, 6);
    }
    if (two_t) {
      _tile_loadd(7, b0 + p.b_block, 64);
      if constexpr (INT8) _tile_dpbssd(1, 4, 7); else _tile_dpbf16ps(1, 4, 7);
      if (p.a1 != nullptr) {
        if constexpr (INT8) _tile_dpbssd(3, 5, 7); else _tile_dpbf16ps(3, 5, 7);
      }
    }
  }
  box.flush(store);
  _tile_stored(0, box.tiles[0], 64);
  if (two_t) _tile_stored(1, box.tiles[1], 64);
  if (p.a1 != nullptr) {
    _tile_stored(2, box.tiles[2], 64);
    if (two_t) _tile_stored(3, box.tiles[3], 64);
  }
  box.block = block, box.tb = tb, box.two_t = two_t, box.two_n = p.a1 != nullptr;
  box.full = true;
}
#endif

}  // namespace pagellm
