// AMX (Intel Sapphire Rapids and later) set-up shared by the kernels that use its tiles: the
// process asks Linux once for the tile state, and each thread loads a configuration of eight
// 16-row x 64-byte tiles before its first tile instruction. best_bf16_path() says which bf16
// product path a machine has.
#pragma once
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace pagellm {

#define PAGELLM_HAS_AMX 1

// Whether this process may use AMX tiles (asked once: the kernel grants the permission per
// process; a refusal leaves the callers on their other paths).
inline bool amx_permitted() {
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023;
  constexpr long XFEATURE_XTILEDATA = 18;
  static const bool ok = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-7, each 16 rows of 64 bytes (16 fp32 or 32 bf16 values a row).
inline void amx_load_config() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

}  // namespace pagellm
#endif

namespace pagellm {

// The fastest bf16 product path this build and CPU have: 2 AMX tiles, 1 AVX-512 BF16 dot
// products, 0 neither (the kernels with such paths pick theirs by it).
inline int best_bf16_path() {
#if defined(PAGELLM_HAS_AMX)
  if (amx_permitted()) return 2;
#endif
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

}  // namespace pagellm
