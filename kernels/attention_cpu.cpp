// Row-invariant ragged attention for CPU inference (kernels/attention_cpu.py builds and calls it).
//
// Every query's result is a function of its own visible keys, in slot order, and of nothing else:
// not of how many queries share the call, how far other rows reach, which slots are masked between
// them, or the thread count. So a token verified inside a block of 8 (or a tree) gets the same bits
// as when plain decoding computes it alone, and greedy speculative output equals plain decoding
// bit for bit in bfloat16 too. Built with -ffp-contract=off: the compiler fuses no multiply-add, so an
// operation gives the same bits wherever it runs (in a vector or alone).
//
// Per query, over its visible keys in order: s_j = (q . k_j) * scale (16 lanes over the head dim, a
// fixed halving sum; or, for bfloat16 K/V on a CPU with AMX, one tile dot product in a fixed order),
// m = max s, e_j = exp(s_j - m) (one polynomial for every element), their sum over 16 lanes of the
// visible-key index, out = (sum_j e_j v_j, in key order, a fused multiply-add each) / sum. GCC's vector
// extensions keep each of these one fixed sequence of IEEE operations on any x86 ISA.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif
#include "amx_tiles.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef int32_t i16 __attribute__((vector_size(64)));
typedef int32_t i8 __attribute__((vector_size(32)));

inline v16 load(const float* p) {
  v16 x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

// 16 bfloat16 K/V values widened to float32: exact, so bfloat16 K/V give the bits float32 copies of them give
inline v16 load(const at::BFloat16* p) {
  typedef uint16_t h16 __attribute__((vector_size(32)));
  h16 h;
  std::memcpy(&h, p, sizeof(h));
  const i16 bits = __builtin_convertvector(h, i16) << 16;
  v16 x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

inline void store(float* p, v16 x) { std::memcpy(p, &x, sizeof(x)); }

// Without AVX-512, GCC keeps a 16-lane vector in memory and moves its halves through the stack and general
// registers between operations (a store-forwarding stall each): one query's attention over 300 keys took 0.42 ms
// a layer on an AVX2-only CPU, 6x PyTorch's. The hot loops there run on the two 8-lane halves in registers
// (v8, native), with the same operations lane for lane, so the same bits.
#if !defined(__AVX512F__)
#define HALVES 1
inline void halves(const float* p, v8& lo, v8& hi) {
  std::memcpy(&lo, p, sizeof(lo));
  std::memcpy(&hi, p + 8, sizeof(hi));
}
inline void halves(const at::BFloat16* p, v8& lo, v8& hi) {
  const v16 x = load(p);
  std::memcpy(&lo, &x, sizeof(lo));
  std::memcpy(&hi, reinterpret_cast<const char*>(&x) + sizeof(lo), sizeof(hi));
}
inline float hsum8(v8 lo, v8 hi) {  // hsum's operations on the two halves
  const v8 a = lo + hi;
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}
#endif

inline float hsum(v16 x) {  // (lanes 0-7 + 8-15), then halves again: a fixed order
#ifdef HALVES
  v8 lo, hi;
  halves(reinterpret_cast<const float*>(&x), lo, hi);
  return hsum8(lo, hi);
#else
  v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
#endif
}

// exp(x) for x <= 0 on 16 (V = v16, I = i16) or 8 lanes (Cephes' expf polynomial; below -87 gives ~1e-38)
template <typename V, typename I>
inline V expv(V v) {
  const V lo = V{} - 87.0f;
  v = v < lo ? lo : v;
  V t = v * 1.44269504088896341f + 0.5f;
  V fx = __builtin_convertvector(__builtin_convertvector(t, I), V);  // truncation, then floor:
  fx = fx > t ? fx - 1.0f : fx;
  V r = v - fx * 0.693359375f;
  r = r + fx * 2.12194440e-4f;
  V p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  I bits = (__builtin_convertvector(fx, I) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// q . k on 16 lanes over the head dim (lane l sums dims l, l + 16, ... in order)
template <typename T>
inline v16 products(const float* q, const T* k, int64_t d) {
  v16 acc = load(q) * load(k);
  for (int64_t x = 16; x < d; x += 16) acc = acc + load(q + x) * load(k + x);
  return acc;
}

template <typename T>
inline float score(const float* q, const T* k, int64_t d, float sc) {
#ifdef HALVES  // products() and hsum() on the halves in registers
  v8 ql, qh, kl, kh;
  halves(q, ql, qh);
  halves(k, kl, kh);
  v8 lo = ql * kl, hi = qh * kh;
  for (int64_t x = 16; x < d; x += 16) {
    halves(q + x, ql, qh);
    halves(k + x, kl, kh);
    lo = lo + ql * kl;
    hi = hi + qh * kh;
  }
  return hsum8(lo, hi) * sc;
#else
  return hsum(products(q, k, d)) * sc;
#endif
}

#define SH(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
// 16 scores of keys k[0..16) for one query: each the same operations as score(), its halving sum
// done for 16 keys at once by shuffles
template <typename T>
inline v16 score16(const float* q, const T* const* k, int64_t d, float sc) {
#ifdef HALVES  // without AVX-512 (see halves()): each key's score() on register halves
  alignas(64) float S[16];
  for (int j = 0; j < 16; ++j) S[j] = score(q, k[j], d, sc);
  return load(S);
#else
  v16 A[16];
  for (int j = 0; j < 16; ++j) A[j] = products(q, k[j], d);
  v16 P[8], Q[4], R[2];
  for (int i = 0; i < 8; ++i)
    P[i] = SH(A[2 * i], A[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           SH(A[2 * i], A[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    Q[i] = SH(P[2 * i], P[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           SH(P[2 * i], P[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    R[i] = SH(Q[2 * i], Q[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           SH(Q[2 * i], Q[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  v16 S = SH(R[0], R[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
          SH(R[0], R[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  return S * sc;
#endif
}

// scores of one query against its block keys bq[0..nb) (slots; row r of `base` holds slot base_slot + r),
// 16 at a time as the context's, the rest one by one: the same operations as score() for each
template <typename K>
inline void block_scores(const float* q, const K* base, int64_t base_slot, const int32_t* bq, int64_t nb, int64_t d, float sc,
                         float* out) {
  int64_t c = 0;
  for (; c + 16 <= nb; c += 16) {
    const K* kr[16];
    for (int j = 0; j < 16; ++j) kr[j] = base + (static_cast<int64_t>(bq[c + j]) - base_slot) * d;
    store(out + c, score16(q, kr, d, sc));
  }
  for (; c < nb; ++c) out[c] = score(q, base + (static_cast<int64_t>(bq[c]) - base_slot) * d, d, sc);
}

// acc + w * v, one fused multiply-add (one rounding) where the CPU has them, else a multiply then an add:
// the same instruction for every query and key of the value sums on a machine (written out, not left
// to the compiler, which builds with -ffp-contract=off). On 16 lanes with AVX-512 (which has them), on one
// 8-lane half without (see halves()).
#ifdef HALVES
inline v8 madd8(float w, v8 v, v8 acc) {
#if defined(__FMA__)
  return reinterpret_cast<v8>(_mm256_fmadd_ps(_mm256_set1_ps(w), reinterpret_cast<__m256>(v), reinterpret_cast<__m256>(acc)));
#else
  return acc + w * v;
#endif
}
#else
inline v16 madd(float w, v16 v, v16 acc) {
  return reinterpret_cast<v16>(_mm512_fmadd_ps(_mm512_set1_ps(w), reinterpret_cast<__m512>(v), reinterpret_cast<__m512>(acc)));
}
#endif

// For the G queries q0.. of an item: out_q [NV * 16] = (sum_c w_q[c] * v[slot c] over the context slots,
// then over the query's block slots, in that order) / sum_q, with w_q = s + q * width (softmax weights)
// and the block slots blk + q * n (len[q] of them). The G queries share each context V row as it is
// read; every query's sums run in the same order whatever G is.
template <int NV, int G, typename T>
void weighted_values(int64_t q0, const float* s, int64_t width, const T* vb, const int32_t* cs, int64_t nc, const int32_t* blk,
                     int64_t n, const int64_t* len, int64_t d, const float* sums, float* op, const int64_t* qo) {
#ifdef HALVES  // the same sums on register halves (see halves())
  v8 acc[G][NV][2];
  for (int g = 0; g < G; ++g)
    for (int x = 0; x < NV; ++x) acc[g][x][0] = acc[g][x][1] = v8{};
  for (int64_t c = 0; c < nc; ++c) {
    const T* vr = vb + static_cast<int64_t>(cs[c]) * d;
    v8 v[NV][2];
    for (int x = 0; x < NV; ++x) halves(vr + 16 * x, v[x][0], v[x][1]);
    for (int g = 0; g < G; ++g) {
      const float wc = s[(q0 + g) * width + c];
      for (int x = 0; x < NV; ++x) {
        acc[g][x][0] = madd8(wc, v[x][0], acc[g][x][0]);
        acc[g][x][1] = madd8(wc, v[x][1], acc[g][x][1]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const int64_t qi = q0 + g;
    for (int64_t c = 0; c < len[qi]; ++c) {
      const T* vr = vb + static_cast<int64_t>(blk[qi * n + c]) * d;
      const float wc = s[qi * width + nc + c];
      for (int x = 0; x < NV; ++x) {
        v8 lo, hi;
        halves(vr + 16 * x, lo, hi);
        acc[g][x][0] = madd8(wc, lo, acc[g][x][0]);
        acc[g][x][1] = madd8(wc, hi, acc[g][x][1]);
      }
    }
    const v8 inv = v8{} + sums[qi];
    for (int x = 0; x < NV; ++x) {
      const v8 lo = acc[g][x][0] / inv, hi = acc[g][x][1] / inv;
      std::memcpy(op + qo[qi] + 16 * x, &lo, sizeof(lo));
      std::memcpy(op + qo[qi] + 16 * x + 8, &hi, sizeof(hi));
    }
  }
#else
  v16 acc[G][NV];
  for (int g = 0; g < G; ++g)
    for (int x = 0; x < NV; ++x) acc[g][x] = v16{};
  for (int64_t c = 0; c < nc; ++c) {
    const T* vr = vb + static_cast<int64_t>(cs[c]) * d;
    v16 v[NV];
    for (int x = 0; x < NV; ++x) v[x] = load(vr + 16 * x);
    for (int g = 0; g < G; ++g) {
      const float wc = s[(q0 + g) * width + c];
      for (int x = 0; x < NV; ++x) acc[g][x] = madd(wc, v[x], acc[g][x]);
    }
  }
  for (int g = 0; g < G; ++g) {
    const int64_t qi = q0 + g;
    for (int64_t c = 0; c < len[qi]; ++c) {
      const T* vr = vb + static_cast<int64_t>(blk[qi * n + c]) * d;
      const float wc = s[qi * width + nc + c];
      for (int x = 0; x < NV; ++x) acc[g][x] = madd(wc, load(vr + 16 * x), acc[g][x]);
    }
    const v16 inv = v16{} + sums[qi];
    for (int x = 0; x < NV; ++x) store(op + qo[qi] + 16 * x, acc[g][x] / inv);
  }
#endif
}

// All queries of an item in groups of G (G * NV accumulators stay in registers), the rest in groups of 3,
// 2 and 1 (a decoding step's item is the 3 query heads of one KV head: one pass over V, not three)
template <int NV, int G, typename T>
void values_all(int64_t nq, const float* s, int64_t width, const T* vb, const int32_t* cs, int64_t nc, const int32_t* blk,
                int64_t n, const int64_t* len, int64_t d, const float* sums, float* op, const int64_t* qo) {
  int64_t q0 = 0;
  for (; q0 + G <= nq; q0 += G) weighted_values<NV, G, T>(q0, s, width, vb, cs, nc, blk, n, len, d, sums, op, qo);
  if (G > 3 && q0 + 3 <= nq) {
    weighted_values<NV, (G > 3 ? 3 : 1), T>(q0, s, width, vb, cs, nc, blk, n, len, d, sums, op, qo);
    q0 += 3;
  }
  if (G > 2 && q0 + 2 <= nq) {
    weighted_values<NV, (G > 2 ? 2 : 1), T>(q0, s, width, vb, cs, nc, blk, n, len, d, sums, op, qo);
    q0 += 2;
  }
  for (; q0 < nq; ++q0) weighted_values<NV, 1, T>(q0, s, width, vb, cs, nc, blk, n, len, d, sums, op, qo);
}

// s[0..m) <- exp(s - max s), zero up to the next multiple of 16; -> their sum (lanes fixed by the key index)
inline float softmax_weights(float* s, int64_t m) {
#ifdef HALVES  // the same operations on register halves (see halves())
  v8 mlo = v8{} - INFINITY, mhi = mlo;
  int64_t j = 0;
  for (; j + 16 <= m; j += 16) {
    v8 a, b;
    halves(s + j, a, b);
    mlo = a > mlo ? a : mlo;
    mhi = b > mhi ? b : mhi;
  }
  float mx = -INFINITY;
  for (int l = 0; l < 8; ++l) mx = mlo[l] > mx ? mlo[l] : mx;
  for (int l = 0; l < 8; ++l) mx = mhi[l] > mx ? mhi[l] : mx;
  for (; j < m; ++j) mx = s[j] > mx ? s[j] : mx;
  v8 tlo = {}, thi = {};
  for (int64_t c = 0; c < m; c += 16) {
    v8 a, b;
    halves(s + c, a, b);
    a = expv<v8, i8>(a - mx);
    b = expv<v8, i8>(b - mx);
    for (int64_t l = m - c; l < 16; ++l) {
      if (l < 8)
        a[l] = 0.0f;
      else
        b[l - 8] = 0.0f;
    }
    std::memcpy(s + c, &a, sizeof(a));
    std::memcpy(s + c + 8, &b, sizeof(b));
    tlo = tlo + a;
    thi = thi + b;
  }
  return hsum8(tlo, thi);
#else
  v16 mx16 = v16{} - INFINITY;  // the max in 16 lanes, then across them: the same value in any order (a scalar
  int64_t j = 0;                // chain of compares was a third of a verify step's attention)
  for (; j + 16 <= m; j += 16) {
    const v16 x = load(s + j);
    mx16 = x > mx16 ? x : mx16;
  }
  float mx = -INFINITY;
  for (int l = 0; l < 16; ++l) mx = mx16[l] > mx ? mx16[l] : mx;
  for (; j < m; ++j) mx = s[j] > mx ? s[j] : mx;
  v16 total = {};
  for (int64_t c = 0; c < m; c += 16) {
    v16 e = expv<v16, i16>(load(s + c) - mx);
    for (int64_t l = m - c; l < 16; ++l) e[l] = 0.0f;
    store(s + c, e);
    total = total + e;
  }
  return hsum(total);
#endif
}

#if HAVE_AMX
using adaflash_amx::configure_tiles;  // tmm0: scores [16 keys x 16 queries]; tmm1-3: keys [16 x 32 dims]; tmm4-7: queries

// q . k for 16 keys (rows of `keys`, `ld` elements apart) and the item's queries (tmm4.., loaded by the caller)
// -> c [16 keys][16 queries]. Each dot product: tile pair-products summed over dims 0-31, then 32-63, ... in
// that order, whatever the key's place in the tile or the query's: the same bits for a query in any call.
inline void score_tile(const at::BFloat16* keys, int64_t ld, int64_t dt, float* c) {
  _tile_zero(0);
  _tile_loadd(1, keys, ld * 2);
  _tile_dpbf16ps(0, 1, 4);
  if (dt > 1) {
    _tile_loadd(2, keys + 32, ld * 2);
    _tile_dpbf16ps(0, 2, 5);
  }
  if (dt > 2) {
    _tile_loadd(3, keys + 64, ld * 2);
    _tile_dpbf16ps(0, 3, 6);
  }
  if (dt > 3) {
    _tile_loadd(1, keys + 96, ld * 2);
    _tile_dpbf16ps(0, 1, 7);
  }
  _tile_stored(0, c, 64);
}

// Scores of an item's nq <= 16 queries (float32 values of bfloat16 numbers, so their high halves are exact) on AMX tiles: against
// its context slots cs[0..nc) into s (row qi at s + qi * width) and against all n block slots a.. into
// bs [nq * n] (each query then takes the block keys it sees). 16 slots in a row are read in place; a
// group with gaps or fewer than 16 is gathered (zero-padded) first.
void amx_scores(const float* qp, const int64_t* qo, int64_t nq, const at::BFloat16* kb, const int32_t* cs, int64_t nc, int64_t a,
                int64_t n, int64_t d, float sc, int64_t width, float* s, float* bs, at::BFloat16* gather) {
  const int64_t dt = d / 32;
  alignas(64) at::BFloat16 qt[4 * 16 * 32];  // per 32 dims: row r = dims 2r, 2r+1 of each query, side by side
  std::memset(qt, 0, sizeof(qt));
  uint16_t* qb = reinterpret_cast<uint16_t*>(qt);
  for (int64_t qi = 0; qi < nq; ++qi) {
    const uint32_t* bits = reinterpret_cast<const uint32_t*>(qp + qo[qi]);
    for (int64_t e = 0; e < d; ++e) qb[(e / 32) * 512 + ((e % 32) / 2) * 32 + qi * 2 + (e % 2)] = static_cast<uint16_t>(bits[e] >> 16);
  }
  _tile_loadd(4, qt, 64);
  if (dt > 1) _tile_loadd(5, qt + 512, 64);
  if (dt > 2) _tile_loadd(6, qt + 1024, 64);
  if (dt > 3) _tile_loadd(7, qt + 1536, 64);
  alignas(64) float c[256];
  auto group = [&](int64_t count, auto slot) {  // -> c for the slots slot(0..count), count <= 16
    const int64_t first = slot(0);
    bool inplace = count == 16;
    for (int64_t j = 1; inplace && j < 16; ++j) inplace = slot(j) == first + j;
    if (inplace) {
      score_tile(kb + first * d, d, dt, c);
      return;
    }
    for (int64_t j = 0; j < 16; ++j) {
      if (j < count)
        std::memcpy(gather + j * d, kb + static_cast<int64_t>(slot(j)) * d, d * 2);
      else
        std::memset(gather + j * d, 0, d * 2);
    }
    score_tile(gather, d, dt, c);
  };
  for (int64_t c0 = 0; c0 < nc; c0 += 16) {
    const int64_t count = std::min<int64_t>(16, nc - c0);
    group(count, [&](int64_t j) { return static_cast<int64_t>(cs[c0 + j]); });
    for (int64_t qi = 0; qi < nq; ++qi)
      for (int64_t j = 0; j < count; ++j) s[qi * width + c0 + j] = c[j * 16 + qi] * sc;
  }
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t count = std::min<int64_t>(16, n - j0);
    group(count, [&](int64_t j) { return a + j0 + j; });
    for (int64_t qi = 0; qi < nq; ++qi)
      for (int64_t j = 0; j < count; ++j) bs[qi * n + j0 + j] = c[j * 16 + qi] * sc;
  }
}
#endif

}  // namespace

// The valid slots before each request's block, once per forward: req [B, 6] (see ragged_attention)
// -> (slots int32 [sum], offsets int64 [B + 1]).
std::vector<torch::Tensor> context_slots(torch::Tensor valid, torch::Tensor req) {
  TORCH_CHECK(valid.scalar_type() == torch::kBool && valid.is_contiguous() && req.scalar_type() == torch::kLong && req.is_contiguous(),
              "context_slots: valid is a contiguous bool [R, C], req a contiguous int64 [B, 6]");
  const int64_t n_req = req.size(0), cap = valid.size(1);
  const bool* vp = valid.data_ptr<bool>();
  const int64_t* rq = req.data_ptr<int64_t>();
  auto offsets = torch::empty({n_req + 1}, torch::kLong);
  int64_t* op = offsets.data_ptr<int64_t>();
  std::vector<int32_t> slots;
  op[0] = 0;
  for (int64_t b = 0; b < n_req; ++b) {
    const bool* row = vp + rq[b * 6] * cap;
    for (int64_t j = 0; j < rq[b * 6 + 1]; ++j)
      if (row[j]) slots.push_back(static_cast<int32_t>(j));
    op[b + 1] = static_cast<int64_t>(slots.size());
  }
  auto out = torch::empty({static_cast<int64_t>(slots.size())}, torch::kInt);
  std::copy(slots.begin(), slots.end(), out.data_ptr<int32_t>());
  return {out, offsets};
}

// the attention of ragged_attention over K/V stored as T (float or bfloat16) into op [N, Hq, D]
template <typename T>
void attend_all(const torch::Tensor& q, const T* kp, const T* vp, const torch::Tensor& req, const torch::Tensor& trees,
                const torch::Tensor& ctx, const torch::Tensor& ctx_off, double scale, int64_t hkv, int64_t cap, float* op, bool amx) {
  const int64_t hq = q.size(1), d = q.size(2), n_req = req.size(0);
  const int64_t rep = hq / hkv;
  const float* qp = q.data_ptr<float>();
  const int64_t *rq = req.data_ptr<int64_t>(), *coff = ctx_off.data_ptr<int64_t>();
  const int32_t* cslots = ctx.data_ptr<int32_t>();
  const bool* treep = trees.numel() ? trees.data_ptr<bool>() : nullptr;
  const float sc = static_cast<float>(scale);
  // work items: chunks of `per` queries of one (request, kv head), queries ordered (token, query head); the
  // queries of an item share each context K/V row as it is read (their sums stay in key order)
  int64_t total_q = 0;
  for (int64_t b = 0; b < n_req; ++b) total_q += rq[b * 6 + 2] * hq;
  const int64_t per = std::max<int64_t>(1, std::min<int64_t>(16, total_q / (8 * at::get_num_threads())));
  std::vector<int64_t> items;  // (request, kv head, first query, end query)
  for (int64_t b = 0; b < n_req; ++b)
    for (int64_t h = 0; h < hkv; ++h)
      for (int64_t q0 = 0; q0 < rq[b * 6 + 2] * rep; q0 += per)
        items.insert(items.end(), {b, h, q0, std::min(q0 + per, rq[b * 6 + 2] * rep)});
  at::parallel_for(0, static_cast<int64_t>(items.size() / 4), 1, [&](int64_t lo, int64_t hi) {
    std::vector<int32_t> blk;
    std::vector<int64_t> len, qo;
    std::vector<float> s, sums, keys(16 * d), bs;
    std::vector<at::BFloat16> gather(amx ? 16 * d : 0);
#if HAVE_AMX
    if (amx) configure_tiles();
#endif
    for (int64_t it = lo; it < hi; ++it) {
      const int64_t b = items[4 * it], h = items[4 * it + 1], q0 = items[4 * it + 2], nq = items[4 * it + 3] - q0;
      const int64_t row = rq[b * 6], a = rq[b * 6 + 1], n = rq[b * 6 + 2], first = rq[b * 6 + 3], mode = rq[b * 6 + 4],
                    toff = rq[b * 6 + 5];
      const int32_t* cs = cslots + coff[b];
      const int64_t nc = coff[b + 1] - coff[b], width = (nc + n + 15) / 16 * 16;
      const T* kb = kp + (row * hkv + h) * cap * d;
      const T* vb = vp + (row * hkv + h) * cap * d;
      qo.resize(nq);
      for (int64_t qi = 0; qi < nq; ++qi) qo[qi] = ((first + (q0 + qi) / rep) * hq + h * rep + (q0 + qi) % rep) * d;
      s.resize(nq * width);
      blk.resize(nq * n);
      len.resize(nq);
      int64_t c0 = nc;
#if HAVE_AMX
      if constexpr (std::is_same<T, at::BFloat16>::value) {
        if (amx) {  // every score on AMX tiles (block scores into bs, taken per query below)
          bs.resize(nq * n);
          amx_scores(qp, qo.data(), nq, kb, cs, nc, a, n, d, sc, width, s.data(), bs.data(), gather.data());
        }
      }
#endif
      if (!amx) c0 = 0;
      for (; c0 + 16 <= nc; c0 += 16) {  // context scores, 16 keys at a time for every query of the item
        const T* kr[16];
        for (int j = 0; j < 16; ++j) kr[j] = kb + static_cast<int64_t>(cs[c0 + j]) * d;
        if (std::is_same<T, float>::value || nq == 1) {
          for (int64_t qi = 0; qi < nq; ++qi) store(s.data() + qi * width + c0, score16(qp + qo[qi], kr, d, sc));
        } else {  // bfloat16 keys widened once for all the item's queries (exact: the same floats, the same bits)
          const float* kf[16];
          for (int j = 0; j < 16; ++j) {
            for (int64_t x = 0; x < d; x += 16) store(keys.data() + j * d + x, load(kr[j] + x));
            kf[j] = keys.data() + j * d;
          }
          for (int64_t qi = 0; qi < nq; ++qi) store(s.data() + qi * width + c0, score16(qp + qo[qi], kf, d, sc));
        }
      }
      for (; c0 < nc; ++c0)
        for (int64_t qi = 0; qi < nq; ++qi) s[qi * width + c0] = score(qp + qo[qi], kb + static_cast<int64_t>(cs[c0]) * d, d, sc);
      for (int64_t c = 0; c < nc; ++c)  // the context's V rows, on their way while the softmax runs
        for (int64_t o = 0; o < d; o += 64 / static_cast<int64_t>(sizeof(T))) __builtin_prefetch(vb + static_cast<int64_t>(cs[c]) * d + o);
      sums.resize(nq);
      // a long bfloat16 block (a prefill) is widened once for all the item's queries (exact: the same bits)
      const bool wide = !amx && !std::is_same<T, float>::value && n >= 16 && nq > 1;
      if (wide) {
        keys.resize(std::max<int64_t>(16, n) * d);
        for (int64_t j = 0; j < n; ++j)
          for (int64_t x = 0; x < d; x += 16) store(keys.data() + j * d + x, load(kb + (a + j) * d + x));
      }
      for (int64_t qi = 0; qi < nq; ++qi) {  // block keys and scores, then each query's softmax weights
        const int64_t i = (q0 + qi) / rep;
        int32_t* bq = blk.data() + qi * n;
        int64_t nb = 0;
        for (int64_t j = 0; j < n; ++j)
          if (mode == 0 ? j <= i : mode == 1 ? true : treep[toff + i * n + j]) bq[nb++] = static_cast<int32_t>(a + j);
        float* sr = s.data() + qi * width;
        if (amx)
          for (int64_t c = 0; c < nb; ++c) sr[nc + c] = bs[qi * n + bq[c] - a];
        else if (wide)
          block_scores(qp + qo[qi], keys.data(), a, bq, nb, d, sc, sr + nc);
        else
          block_scores(qp + qo[qi], kb, 0, bq, nb, d, sc, sr + nc);
        len[qi] = nb;
        sums[qi] = softmax_weights(sr, nc + nb);
      }
      switch (d / 16) {  // values: each query's sums in key order, in registers
        case 4: values_all<4, 4>(nq, s.data(), width, vb, cs, nc, blk.data(), n, len.data(), d, sums.data(), op, qo.data()); break;
        case 8: values_all<8, 2>(nq, s.data(), width, vb, cs, nc, blk.data(), n, len.data(), d, sums.data(), op, qo.data()); break;
        default: values_all<2, 4>(nq, s.data(), width, vb, cs, nc, blk.data(), n, len.data(), d, sums.data(), op, qo.data());
      }
    }
#if HAVE_AMX
    if (amx) _tile_release();  // unconfigured again: oneDNN and amx_cpu configure their own
#endif
  });
}

// amx: the scores q . k on AMX tiles (bfloat16 K/V; see amx_scores), else in vectors of 16 lanes.
// q [N, Hq, D] f32; pk, pv [R, Hkv, C, D] f32 or bf16; req [B, 6] int64 per request: (pool row, block start a,
// block length n, first packed query, mode, tree offset), mode 0 = causal, 1 = the whole block, 2 = tree
// (trees[off + i * n + j]: query i sees block key j); ctx, ctx_off: context_slots(). A query sees its
// request's context slots, then its block keys. -> [N, Hq, D] f32.
torch::Tensor ragged_attention(torch::Tensor q, torch::Tensor pk, torch::Tensor pv, torch::Tensor req, torch::Tensor trees,
                               torch::Tensor ctx, torch::Tensor ctx_off, double scale, bool amx) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat && pv.scalar_type() == pk.scalar_type() &&
                  (pk.scalar_type() == torch::kFloat || pk.scalar_type() == torch::kBFloat16),
              "ragged_attention: q must be float32, k and v both float32 or both bfloat16");
  TORCH_CHECK(q.is_contiguous() && pk.is_contiguous() && pv.is_contiguous() && req.is_contiguous() && trees.is_contiguous() &&
                  ctx.is_contiguous() && ctx_off.is_contiguous(),
              "ragged_attention: inputs must be contiguous");
  TORCH_CHECK(trees.scalar_type() == torch::kBool && req.scalar_type() == torch::kLong && ctx.scalar_type() == torch::kInt &&
                  ctx_off.scalar_type() == torch::kLong,
              "ragged_attention: trees bool, req int64, ctx int32, ctx_off int64");
  const int64_t hq = q.size(1), d = q.size(2), hkv = pk.size(1), cap = pk.size(2);
  TORCH_CHECK((d == 32 || d == 64 || d == 128) && pk.size(3) == d && hq % hkv == 0, "ragged_attention: head dim must be 32, 64 or 128");
  // AMX scores: bfloat16 K/V, a CPU with AMX whose tiles the caller has enabled, a build that has them
  amx = amx && HAVE_AMX && pk.scalar_type() == torch::kBFloat16 && d % 32 == 0;
  auto out = torch::empty_like(q);
  if (pk.scalar_type() == torch::kBFloat16)
    attend_all(q, pk.data_ptr<at::BFloat16>(), pv.data_ptr<at::BFloat16>(), req, trees, ctx, ctx_off, scale, hkv, cap, out.data_ptr<float>(), amx);
  else
    attend_all(q, pk.data_ptr<float>(), pv.data_ptr<float>(), req, trees, ctx, ctx_off, scale, hkv, cap, out.data_ptr<float>(), false);
  return out;
}

#ifndef ADAFLASH_NO_MODULE  // kernels/stack_cpu.cpp includes this file for its functions
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("context_slots", &context_slots, "the valid slots before each request's block");
  m.def("ragged_attention", &ragged_attention, "row-invariant ragged attention (CPU)");
}
#endif
