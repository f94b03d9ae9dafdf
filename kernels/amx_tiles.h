// AMX tile state for the kernels that multiply on tiles (amx_cpu.cpp, attention_cpu.cpp).
//
// HAVE_AMX: the build has AMX tiles with bfloat16 (and AVX-512 BF16 for rounding results to bfloat16).
// A process must ask Linux for the tile state once (amx_cpu.enable(), via kernels/amx_cpu.py) before
// any tile instruction runs; each thread loads a configuration before using tiles and releases the
// tiles after, so oneDNN, which configures its own, finds them unconfigured.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include <cstdint>
#define HAVE_AMX 1

namespace adaflash_amx {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// all eight tiles 16 rows of 64 bytes: 16 x 32 bfloat16 inputs, or 16 x 16 float32 sums
inline void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

}  // namespace adaflash_amx
#else
#define HAVE_AMX 0
#endif
