// bfloat16 x bfloat16 -> bfloat16 matmul on AMX tiles, row-invariant (kernels/amx_cpu.py builds and calls it).
//
// oneDNN's bfloat16 matmul on AMX sums a row in another order when a call has more than 32 rows, so
// the model had to multiply in calls of at most 32 rows (layers.packed_mm), rereading every weight
// once per 32 rows: a verify step of 32 requests x 4 tokens read the weights four times. Here every
// output is one fixed sequence of tile dot products over the inputs, 32 at a time in order
// (TDPBF16PS: C[m][n] += pairs of bf16 products, in float32), whatever the number of rows in the call,
// the tile a row falls in or the thread: a row's result depends on its own inputs alone, so a token
// verified inside a block gets the bits plain decoding gives it alone, and one call takes any number
// of rows, reading each weight once.
//
// Weights are packed per 16 outputs and 32 inputs as one B tile (16 rows of 16 outputs x 2 inputs:
// row r holds inputs 2r, 2r+1 of each output, AMX's pair layout): packed [N/16, K/32, 16, 32].
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

#include "amx_tiles.h"
#if HAVE_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t TILE = 16;    // rows of an A or C tile, outputs per B tile
constexpr int64_t KSTEP = 32;   // inputs per tile dot product
constexpr int64_t MCHUNK = 256; // rows whose inputs stay in cache while every weight block passes them

#if HAVE_AMX
using adaflash_amx::configure_tiles;  // tmm0-3: C (2 x 2 tiles of 16 x 16 float32), tmm4-5: A (16 rows x 32 bf16), tmm6-7: B

// C tile `c` (16 x 16 float32 at `buf`, row stride 32) -> rows [0, rows) of out (row stride ld) as bf16
inline void store_rows(const float* buf, int64_t rows, at::BFloat16* out, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(buf + r * 32));
    std::memcpy(out + r * ld, &h, 32);
  }
}

// out[0 .. rows, 16 nb .. 16 nb + 16 * nn) for nn = 1 or 2 output blocks from 32 rows of x (rows beyond `rows` read, never stored)
template <int NN>
void block(const at::BFloat16* x, int64_t k, const at::BFloat16* w, int64_t kb, int64_t rows, at::BFloat16* out, int64_t n,
           const char* next) {
  alignas(64) float buf[2 * TILE * 32];
  const bool two = rows > TILE;  // a second A tile only where it has rows: rows are independent either way
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < kb; ++s) {
    if (next != nullptr)  // the next weight blocks (2 KB a step), fetched from memory while these tiles multiply
      for (int l = 0; l < 2048; l += 64) _mm_prefetch(next + s * 2048 + l, _MM_HINT_T0);
    _tile_loadd(4, x + s * KSTEP, k * 2);
    _tile_loadd(6, w + s * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (NN == 2) {
      _tile_loadd(7, w + (kb + s) * 512, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (two) {
      _tile_loadd(5, x + TILE * k + s * KSTEP, k * 2);
      _tile_dpbf16ps(2, 5, 6);
      if (NN == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, buf, 128);
  if (NN == 2) _tile_stored(1, buf + 16, 128);
  if (two) {
    _tile_stored(2, buf + TILE * 32, 128);
    if (NN == 2) _tile_stored(3, buf + TILE * 32 + 16, 128);
  }
  for (int j = 0; j < NN; ++j) {
    store_rows(buf + 16 * j, std::min<int64_t>(rows, TILE), out + 16 * j, n);
    if (two) store_rows(buf + TILE * 32 + 16 * j, rows - TILE, out + TILE * n + 16 * j, n);
  }
}
#endif

}  // namespace

// Ask Linux for the AMX tile state (once per process; oneDNN asks the same). -> whether tiles may be used.
bool enable() {
#if HAVE_AMX
  constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
  return false;
#endif
}

// x [M, K] bf16; packed [N/16, K/32, 16, 32] bf16 (see the header) -> [M, N] bf16
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && packed.scalar_type() == torch::kBFloat16 && x.dim() == 2 && packed.dim() == 4 &&
                  packed.is_contiguous(),
              "amx_linear: x bf16 [M, K], packed bf16 [N/16, K/32, 16, 32] contiguous");
  const int64_t m = x.size(0), k = x.size(1), nb = packed.size(0), kb = packed.size(1), n = nb * TILE;
  TORCH_CHECK(kb * KSTEP == k && packed.size(2) == TILE && packed.size(3) == 32, "amx_linear: packed weight is for ", kb * KSTEP,
              " inputs, x has ", k);
  auto out = torch::empty({m, n}, x.options());
#if HAVE_AMX
  if (m == 0) return out;
  x = x.contiguous();
  const int64_t full = m / 32 * 32;  // rows read from x in place; the rest from a zero-padded copy of 32 rows
  auto tail = m > full ? torch::zeros({32, k}, x.options()) : torch::Tensor();
  if (m > full) tail.narrow(0, 0, m - full).copy_(x.narrow(0, full, m - full));
  const at::BFloat16* xd = x.data_ptr<at::BFloat16>();
  const at::BFloat16* td = m > full ? tail.data_ptr<at::BFloat16>() : nullptr;
  const at::BFloat16* wd = packed.data_ptr<at::BFloat16>();
  at::BFloat16* od = out.data_ptr<at::BFloat16>();
  const int64_t pairs = (nb + 1) / 2;
  for (int64_t c0 = 0; c0 < m; c0 += MCHUNK) {
    const int64_t c1 = std::min(m, c0 + MCHUNK);
    at::parallel_for(0, pairs, 1, [&](int64_t lo, int64_t hi) {
      configure_tiles();
      for (int64_t p = lo; p < hi; ++p) {
        const int64_t b = 2 * p;
        const at::BFloat16* w = wd + b * kb * 512;
        for (int64_t r = c0; r < c1; r += 32) {
          const int64_t rows = std::min<int64_t>(32, c1 - r);
          const at::BFloat16* a = r < full ? xd + r * k : td;  // A tiles always read 16 whole rows
          const char* next = r == c0 && p + 1 < hi ? reinterpret_cast<const char*>(w + 2 * kb * 512) : nullptr;
          if (b + 1 < nb)
            block<2>(a, k, w, kb, rows, od + r * n + b * TILE, n, next);
          else
            block<1>(a, k, w, kb, rows, od + r * n + b * TILE, n, next);
        }
      }
      _tile_release();  // leave the tiles unconfigured: oneDNN configures its own before it uses them
    });
  }
#else
  TORCH_CHECK(false, "amx_linear: this build has no AMX (built without -mamx-tile -mamx-bf16)");
#endif
  return out;
}

#ifndef ADAFLASH_NO_MODULE  // kernels/stack_cpu.cpp includes this file for its functions
PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("enable", &enable, "request the AMX tile state from Linux; whether the kernel may run");
  mod.def("amx_linear", &amx_linear, "row-invariant bfloat16 matmul on AMX tiles");
}
#endif
