// Q4_1 / Q8_0 weights x int8 activations on CPU: llama.cpp's arithmetic for a GGUF's Q4_1 projections
// and its Q8_0 embedding used as the LM head (kernels/q4_cpu.py builds and calls it).
//
// A weight group of 32 inputs is w = d * q + m (q in 0..15, d and m per group and output; a Q8_0 group
// d * s with s in -127..127 is the same form with q = s + 128 in 1..255 and m = -128 d). An input row
// is quantised per group of 32: x ~ dx * qx (qx int8, dx = max|x| / 127), so one output is
//   y = sum_g  d * (float(sum_k q * qx) * dx)  +  m * (dx * sum_k qx)
// The integer dot products are exact (any order gives the same sum), and every float operation of an
// output runs in one fixed sequence over the groups, whatever the number of rows in the call, the tile
// a row falls in, or the thread: a row's result is its own (row-invariant), so a token verified inside
// a block gets the same bits as when plain decoding computes it alone. Built with -ffp-contract=off.
//
// Weights are packed per 16 outputs and group: 4 vectors of 64 bytes, byte (j * 4 + b) of vector c
// holding q[j, 4c + b] in its low nibble and q[j, 16 + 4c + b] in its high one, so one AVX-512 VNNI
// instruction (vpdpbusd) adds 4 products for each of the 16 outputs; 8-bit weights take 8 vectors,
// byte (j * 4 + b) of vector c holding q[j, 4c + b]. Without VNNI, AVX2 computes the same integers 16 bits
// at a time (see its Unpacked), and without AVX2 a portable loop does.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#include <immintrin.h>
#define Q4_VNNI 1
#define Q4_AVX2 0
#elif defined(__AVX2__)
#include <immintrin.h>
#define Q4_VNNI 0
#define Q4_AVX2 1
#else
#define Q4_VNNI 0
#define Q4_AVX2 0
#endif

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));

constexpr int64_t GROUP = 32;
constexpr int64_t BLOCK = 16;       // outputs per packed block
template <int BITS>
constexpr int64_t PACKED = 64 * BITS;  // bytes per block and group (16 outputs x 32 inputs): 256 (4-bit), 512 (8-bit)
constexpr int64_t ROWS = 4;         // rows sharing each unpacked weight group
constexpr int PAIR = Q4_AVX2 ? 1 : 2;  // output blocks sharing each broadcast of a row's inputs (AVX2: 16 registers)

inline v16 load(const float* p) {
  v16 x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

// NB blocks of 16 outputs: their integer dot products for one group with one row's 32 quantised inputs
// (each 4-input broadcast of the row serves every block)
#if Q4_VNNI
template <int NB, int BITS>
struct Unpacked {
  __m512i w[NB][8];
  Unpacked(const uint8_t* p, int64_t stride) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int b = 0; b < NB; ++b)
      if (BITS == 8)
        for (int c = 0; c < 8; ++c) w[b][c] = _mm512_loadu_si512(p + b * stride + c * 64);
      else
        for (int c = 0; c < 4; ++c) {
          __m512i v = _mm512_loadu_si512(p + b * stride + c * 64);
          w[b][c] = _mm512_and_si512(v, low);
          w[b][c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
  }
  inline void dot(const int8_t* x, i16* out) const {
    __m512i s[NB];
    for (int b = 0; b < NB; ++b) s[b] = _mm512_setzero_si512();
    for (int c = 0; c < 8; ++c) {
      int32_t four;
      std::memcpy(&four, x + c * 4, 4);
      const __m512i xb = _mm512_set1_epi32(four);
      for (int b = 0; b < NB; ++b) s[b] = _mm512_dpbusd_epi32(s[b], w[b][c], xb);
    }
    std::memcpy(out, s, sizeof(s));
  }
};
#elif Q4_AVX2
// Without VNNI, AVX2's vpmaddubsw multiplies unsigned weight bytes by signed input bytes and adds pairs into
// 16-bit lanes, which saturate: weights are taken as 4-bit nibbles (8-bit ones as two, q = 16 hi + lo), so a
// pair is at most 2 * 15 * 127 = 3810 and the 8 pairs of a group's 32 inputs at most 30480, exact in 16 bits;
// vpmaddwd by ones then adds each output's two lanes into 32 bits. The same integers as the other paths.
// Sixteen 256-bit registers do not hold a group's unpacked weights for two blocks (VNNI's 32 do), so each
// nibble vector is unpacked where it is used, once for all R rows of the tile.
template <int NB, int BITS>
struct Unpacked {
  const uint8_t* p;
  int64_t stride;
  Unpacked(const uint8_t* p_, int64_t stride_) : p(p_), stride(stride_) {}
  // R rows' quantised inputs (row stride k) -> out[r][b]: their integer dot products with block b
  template <int R>
  inline void rows(const int8_t* x, int64_t k, i16 (*out)[NB]) const {
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int b = 0; b < NB; ++b) {
      if constexpr (BITS == 4) {  // both halves of the block at once: a quad of inputs is broadcast once for 16 outputs
        __m256i acc[R][2];  // 16-bit sums over low and high nibbles alike: 8 pairs, at most 30480
        for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
        for (int c = 0; c < 4; ++c) {
          __m256i wl[2], wh[2];
          for (int h = 0; h < 2; ++h) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + b * stride + c * 64 + h * 32));
            wl[h] = _mm256_and_si256(v, low);
            wh[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
          }
          for (int r = 0; r < R; ++r) {
            int32_t lo4, hi4;  // inputs 4c..4c+3 meet the low nibbles, 16 + 4c.. the high ones
            std::memcpy(&lo4, x + r * k + c * 4, 4);
            std::memcpy(&hi4, x + r * k + 16 + c * 4, 4);
            const __m256i xl = _mm256_set1_epi32(lo4), xh = _mm256_set1_epi32(hi4);
            for (int h = 0; h < 2; ++h)
              acc[r][h] = _mm256_add_epi16(acc[r][h], _mm256_add_epi16(_mm256_maddubs_epi16(wl[h], xl), _mm256_maddubs_epi16(wh[h], xh)));
          }
        }
        for (int r = 0; r < R; ++r)
          for (int h = 0; h < 2; ++h) {
            const __m256i s = _mm256_madd_epi16(acc[r][h], ones);
            std::memcpy(reinterpret_cast<int32_t*>(&out[r][b]) + 8 * h, &s, sizeof(s));
          }
      } else {
        for (int h = 0; h < 2; ++h) {  // 8-bit: q = 16 hi + lo, both nibbles times inputs 4c..4c+3, kept apart
          __m256i lo[R], hi[R];
          for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
          for (int c = 0; c < 8; ++c) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + b * stride + c * 64 + h * 32));
            const __m256i wl = _mm256_and_si256(v, low), wh = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            for (int r = 0; r < R; ++r) {
              int32_t four;
              std::memcpy(&four, x + r * k + c * 4, 4);
              const __m256i xl = _mm256_set1_epi32(four);
              lo[r] = _mm256_add_epi16(lo[r], _mm256_maddubs_epi16(wl, xl));
              hi[r] = _mm256_add_epi16(hi[r], _mm256_maddubs_epi16(wh, xl));
            }
          }
          for (int r = 0; r < R; ++r) {
            const __m256i s = _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(hi[r], ones), 4), _mm256_madd_epi16(lo[r], ones));
            std::memcpy(reinterpret_cast<int32_t*>(&out[r][b]) + 8 * h, &s, sizeof(s));
          }
        }
      }
    }
  }
};
#else
template <int NB, int BITS>
struct Unpacked {
  const uint8_t* p;
  int64_t stride;
  Unpacked(const uint8_t* p_, int64_t stride_) : p(p_), stride(stride_) {}
  inline void dot(const int8_t* x, i16* out) const {
    for (int nb = 0; nb < NB; ++nb) {
      i16 s = {};
      for (int c = 0; c < 4; ++c)
        for (int j = 0; j < 16; ++j)
          for (int b = 0; b < 4; ++b) {
            if (BITS == 8) {
              s[j] += p[nb * stride + c * 64 + j * 4 + b] * x[c * 4 + b] + p[nb * stride + (c + 4) * 64 + j * 4 + b] * x[16 + c * 4 + b];
            } else {
              const int32_t byte = p[nb * stride + c * 64 + j * 4 + b];
              s[j] += (byte & 0x0F) * x[c * 4 + b] + (byte >> 4) * x[16 + c * 4 + b];
            }
          }
      out[nb] = s;
    }
  }
};
#endif

// x [M, K] (float or bfloat16) -> qx int8 [M, K], dx [M, K/32] (the group's step), sx [M, K/32] (dx * sum qx)
template <typename T>
void quantise_rows(const T* x, int64_t rows, int64_t k, int8_t* qx, float* dx, float* sx) {
  const int64_t groups = k / GROUP;
  at::parallel_for(0, rows * groups, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      float xg[GROUP];
      for (int e = 0; e < GROUP; ++e) xg[e] = static_cast<float>(x[i * GROUP + e]);
      float amax = 0.0f;
      for (int e = 0; e < GROUP; ++e) amax = std::fmax(amax, std::fabs(xg[e]));
      const float step = amax / 127.0f;
      const float inv = step > 0.0f ? 1.0f / step : 0.0f;
      int32_t total = 0;
      for (int e = 0; e < GROUP; ++e) {
        const int32_t v = static_cast<int32_t>(std::nearbyint(xg[e] * inv));
        const int32_t c = v > 127 ? 127 : (v < -127 ? -127 : v);
        qx[i * GROUP + e] = static_cast<int8_t>(c);
        total += c;
      }
      dx[i] = step;
      sx[i] = step * static_cast<float>(total);
    }
  });
}

// R rows x 16 outputs into T (float, or bfloat16 rounded to nearest even as torch's .to() does)
template <typename T>
inline void store_rows(const float* acc, int rows, T* out, int64_t ldo) {
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < 16; ++j) out[r * ldo + j] = static_cast<T>(acc[r * 16 + j]);
}

// R rows x NB*16 outputs over all groups: out[r][0..NB*16) (row stride ldo); block b's weights at w + b * bstride
template <int R, int NB, int BITS, typename T>
void tile(const uint8_t* w, const float* d, const float* m, int64_t bstride, const int8_t* qx, const float* dx, const float* sx,
          int64_t k, int64_t groups, T* out, int64_t ldo) {
  v16 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = v16{};
  for (int64_t g = 0; g < groups; ++g) {
    const Unpacked<NB, BITS> u(w + g * PACKED<BITS>, bstride * PACKED<BITS>);
    v16 dv[NB], mv[NB];
    for (int b = 0; b < NB; ++b) {
      dv[b] = load(d + (b * bstride + g) * BLOCK);
      mv[b] = load(m + (b * bstride + g) * BLOCK);
    }
    auto add = [&](int r, const i16* dots) {  // row r's float operations for this group
      for (int b = 0; b < NB; ++b) {
        const v16 t = __builtin_convertvector(dots[b], v16) * dx[r * groups + g];
        acc[r][b] = acc[r][b] + dv[b] * t;
        acc[r][b] = acc[r][b] + mv[b] * sx[r * groups + g];
      }
    };
    if constexpr (Q4_AVX2) {  // every row's integers first (see AVX2's Unpacked)
      i16 dots[R][NB];
      u.template rows<R>(qx + g * GROUP, k, dots);
      for (int r = 0; r < R; ++r) add(r, dots[r]);
    } else {
      for (int r = 0; r < R; ++r) {
        i16 dots[NB];
        u.dot(qx + r * k + g * GROUP, dots);
        add(r, dots);
      }
    }
  }
  for (int b = 0; b < NB; ++b) {
    float flat[R * 16];
    for (int r = 0; r < R; ++r) std::memcpy(flat + r * 16, &acc[r][b], sizeof(v16));
    store_rows(flat, R, out + b * BLOCK, ldo);
  }
}

// rows x NB blocks starting at block b, ROWS rows at a time
template <int NB, int BITS, typename T>
void blocks_of(int64_t b, const uint8_t* w, const float* pd, const float* pm, const int8_t* pq, const float* pdx, const float* psx,
               int64_t rows, int64_t k, int64_t groups, T* po, int64_t n) {
  const uint8_t* wb = w + b * groups * PACKED<BITS>;
  const float *db = pd + b * groups * BLOCK, *mb = pm + b * groups * BLOCK;
  int64_t r = 0;
  for (; r + ROWS <= rows; r += ROWS)
    tile<ROWS, NB, BITS>(wb, db, mb, groups, pq + r * k, pdx + r * groups, psx + r * groups, k, groups, po + r * n + b * BLOCK, n);
  const int64_t left = rows - r;
  const int8_t* q = pq + r * k;
  T* o = po + r * n + b * BLOCK;
  if (left == 3) tile<3, NB, BITS>(wb, db, mb, groups, q, pdx + r * groups, psx + r * groups, k, groups, o, n);
  if (left == 2) tile<2, NB, BITS>(wb, db, mb, groups, q, pdx + r * groups, psx + r * groups, k, groups, o, n);
  if (left == 1) tile<1, NB, BITS>(wb, db, mb, groups, q, pdx + r * groups, psx + r * groups, k, groups, o, n);
}

template <int BITS, typename T>
void run(const T* x, int64_t rows, int64_t k, const uint8_t* w, const float* pd, const float* pm, int64_t blocks, int64_t groups, T* po) {
  const int64_t n = blocks * BLOCK;
  std::vector<int8_t> qx(rows * k);
  std::vector<float> dx(rows * groups), sx(rows * groups);
  quantise_rows(x, rows, k, qx.data(), dx.data(), sx.data());
  const int8_t* pq = qx.data();
  const float *pdx = dx.data(), *psx = sx.data();
  at::parallel_for(0, (blocks + PAIR - 1) / PAIR, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; ++p) {
      const int64_t b = p * PAIR;
      if (b + PAIR <= blocks)
        blocks_of<PAIR, BITS>(b, w, pd, pm, pq, pdx, psx, rows, k, groups, po, n);
      else
        for (int64_t e = b; e < blocks; ++e) blocks_of<1, BITS>(e, w, pd, pm, pq, pdx, psx, rows, k, groups, po, n);
    }
  });
}

}  // namespace

// x [..., K] float32 or bfloat16, packed uint8 [N/16, K/32, 256] (4-bit q) or [N/16, K/32, 512] (8-bit q),
// d and m float32 [N/16, K/32, 16] -> [..., N] in x's dtype
torch::Tensor q4_linear(torch::Tensor x_in, torch::Tensor packed, torch::Tensor d, torch::Tensor m) {
  const bool bf16 = x_in.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(x_in.dim() >= 1 && (bf16 || x_in.scalar_type() == torch::kFloat) && x_in.device().is_cpu(),
              "q4_linear: x must be a float32 or bfloat16 CPU tensor [..., K]");
  const bool eight = packed.dim() == 3 && packed.size(2) == PACKED<8>;
  TORCH_CHECK(packed.scalar_type() == torch::kByte && packed.is_contiguous() && packed.dim() == 3 && (eight || packed.size(2) == PACKED<4>),
              "q4_linear: packed must be uint8 [N/16, K/32, 256] (4-bit) or [N/16, K/32, 512] (8-bit)");
  TORCH_CHECK(d.scalar_type() == torch::kFloat && m.scalar_type() == torch::kFloat && d.is_contiguous() && m.is_contiguous(),
              "q4_linear: d and m must be contiguous float32 [N/16, K/32, 16]");
  const int64_t k = x_in.size(-1), blocks = packed.size(0), groups = packed.size(1);
  TORCH_CHECK(k == groups * GROUP, "q4_linear: x has ", k, " inputs, the weight ", groups * GROUP);
  const torch::Tensor x = x_in.reshape({-1, k}).contiguous();
  const int64_t rows = x.size(0);
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = blocks * BLOCK;
  auto out = torch::empty(shape, x.options());
  if (rows == 0) return out;
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const float *pd = d.data_ptr<float>(), *pm = m.data_ptr<float>();
  if (bf16 && eight)
    run<8>(x.data_ptr<at::BFloat16>(), rows, k, w, pd, pm, blocks, groups, out.data_ptr<at::BFloat16>());
  else if (bf16)
    run<4>(x.data_ptr<at::BFloat16>(), rows, k, w, pd, pm, blocks, groups, out.data_ptr<at::BFloat16>());
  else if (eight)
    run<8>(x.data_ptr<float>(), rows, k, w, pd, pm, blocks, groups, out.data_ptr<float>());
  else
    run<4>(x.data_ptr<float>(), rows, k, w, pd, pm, blocks, groups, out.data_ptr<float>());
  return out;
}

// which integer dot products this build runs: "avx512-vnni", "avx2" or "portable"
std::string isa() { return Q4_VNNI ? "avx512-vnni" : (Q4_AVX2 ? "avx2" : "portable"); }

#ifndef ADAFLASH_NO_MODULE  // kernels/stack_cpu.cpp includes this file for its functions
PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("q4_linear", &q4_linear, "Q4_1 / Q8_0 weights x int8-quantised activations, row-invariant (CPU)");
  mod.def("isa", &isa, "which integer dot products this build runs: avx512-vnni, avx2 or portable");
}
#endif
