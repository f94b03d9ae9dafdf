// A model's decoder layers in one call for CPU inference, its projections on AMX tiles (bfloat16), through oneDNN
// (float32) or on the q4 kernel; and a q4 drafter's context extension (kernels/stack_cpu.py builds and calls them).
//
// A SmolLM2 step at concurrency 32 spent about as long in Python and PyTorch's dispatch of ~700 small
// calls (norms, rotary, K/V writes, SwiGLU's elementwise ops, residual adds, views) as in its matmuls.
// Here the loop over layers runs in C++ and calls the very functions the Python path calls through its
// extensions (amx_cpu.cpp, q4_cpu.cpp, attention_cpu.cpp, norm_rope_cpu.cpp, included below in namespaces of their
// own) and the same ATen ops for SiLU, products and sums, in the same order on the same shapes: every
// tensor it makes has the bits the Python loop gives (tests/test_stack_kernel.py compares them exactly).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <immintrin.h>

#include "amx_tiles.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>
#if HAVE_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define ADAFLASH_NO_MODULE  // the included kernels leave their module definitions out
namespace amx_k {
#include "amx_cpu.cpp"
}
namespace q4_k {
#include "q4_cpu.cpp"
}
namespace attn_k {
#include "attention_cpu.cpp"
}
namespace norm_k {
#include "norm_rope_cpu.cpp"
}

namespace {

// the step's K or V ([N, Hkv, D], any row stride, contiguous heads) into one layer's pool [R, Hkv, C, D] of the
// same dtype: token i at pool row slot[i], cache slot pos[i] (what `Ragged.attend`'s indexed assignment does)
template <typename T>
void write_kv(const torch::Tensor& kv, int64_t row_stride, torch::Tensor& pool, const int64_t* slot, const int64_t* pos) {
  const int64_t n = kv.size(0), hkv = pool.size(1), cap = pool.size(2), d = pool.size(3);
  const T* src = kv.data_ptr<T>();
  T* dst = pool.data_ptr<T>();
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < hkv; ++h) std::memcpy(dst + ((slot[i] * hkv + h) * cap + pos[i]) * d, src + i * row_stride + h * d, d * sizeof(T));
}

// what both calls check: slot and pos [N] contiguous int64; one contiguous [R, Hkv, C, D] K and V pool per layer in dtype dt
void check_pool(const char* who, const torch::Tensor& slot, const torch::Tensor& pos, int64_t n, const std::vector<torch::Tensor>& pool_k,
                const std::vector<torch::Tensor>& pool_v, at::ScalarType dt, int64_t hkv, int64_t d) {
  TORCH_CHECK(slot.scalar_type() == torch::kLong && pos.scalar_type() == torch::kLong && slot.is_contiguous() && pos.is_contiguous() &&
                  slot.numel() == n && pos.numel() == n,
              who, ": slot and pos must be contiguous int64 [N]");
  TORCH_CHECK(pool_k.size() == pool_v.size(), who, ": one K and V pool per layer");
  for (size_t l = 0; l < pool_k.size(); ++l)
    TORCH_CHECK(pool_k[l].scalar_type() == dt && pool_v[l].scalar_type() == dt && pool_k[l].is_contiguous() && pool_v[l].is_contiguous() &&
                    pool_k[l].size(1) == hkv && pool_k[l].size(3) == d,
                who, ": the pool must be contiguous [R, Hkv, C, D] in the activations' dtype");
}

// a float32 projection through oneDNN as layers.packed_mm runs it (one call; at most pad_rows rows padded to min_rows
// with zero rows, as `_one_call` does: layers.PAD_ROWS, MIN_ROWS): x [M, K] float32, pack its oneDNN-blocked weight
// (layers.pack_weight)
torch::Tensor onednn_linear(const torch::Tensor& x, const torch::Tensor& pack, int64_t pad_rows, int64_t min_rows) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, std::string_view,
                                         c10::List<std::optional<at::Scalar>>, std::optional<std::string_view>)>();
  const int64_t m = x.size(0);
  if (m > pad_rows) return op.call(x, pack, std::nullopt, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
  auto padded = torch::zeros({min_rows, x.size(1)}, x.options());
  padded.narrow(0, 0, m).copy_(x);
  return op.call(padded, pack, std::nullopt, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt).narrow(0, 0, m);
}

}  // namespace

// x [N, H], the packed tokens' embeddings; weights, per layer either 6 (input norm [H], fused q/k/v, o, post-attention
// norm [H], fused gate/up, down: bf16 x with AMX tiles, amx_cpu.Packed layout, or float32 x with oneDNN-blocked
// weights, layers.pack_weight) or 14 for the q4 kernel (input norm, (packed, d, m) of the fused q/k/v and of o,
// post-attention norm, (packed, d, m) of the fused gate/up and of down; q4_cpu's layout; bf16 or float32 x), each
// with the q and k norms [D] after them where the layer has them; cos, sin [1, 1, N, D] and pool_k, pool_v (per
// layer [R, Hkv, C, D]) in x's dtype; slot, pos [N] int64 (kvcache.packed_slots); req, trees, ctx, ctx_off: as
// ragged_attention takes them; pad_rows, min_rows: float32 projections of at most pad_rows rows run padded to min_rows
// (`onednn_linear`). -> (x after the last layer [N, H], the outputs of the layers in `features` side by side
// [N, len(features) * H]).
std::vector<torch::Tensor> forward_layers(torch::Tensor x, std::vector<torch::Tensor> weights, torch::Tensor cos, torch::Tensor sin,
                                          std::vector<torch::Tensor> pool_k, std::vector<torch::Tensor> pool_v, torch::Tensor slot,
                                          torch::Tensor pos, torch::Tensor req, torch::Tensor trees, torch::Tensor ctx,
                                          torch::Tensor ctx_off, int64_t hq, int64_t hkv, double eps, double scale, bool amx_scores,
                                          std::vector<int64_t> features, int64_t pad_rows, int64_t min_rows) {
  const int64_t layers = static_cast<int64_t>(pool_k.size());
  const int64_t per = layers ? static_cast<int64_t>(weights.size()) / layers : 0;
  TORCH_CHECK(layers && (per == 6 || per == 8 || per == 14 || per == 16) && per * layers == static_cast<int64_t>(weights.size()),
              "forward_layers: 6 (AMX) or 14 (q4) weights per layer, 2 more with q/k norms");
  const bool q4 = per >= 14, qk_norm = per == 8 || per == 16;  // q/k norms: the layer's last two weights
  const int64_t post = q4 ? 7 : 3;  // the post-attention norm's place in a layer's weights (the input norm's: 0)
  static constexpr int64_t amx_at[4] = {1, 2, 4, 5}, q4_at[4] = {1, 4, 8, 11};  // each projection's (first) place there
  auto linear = [&](int64_t l, int p, const torch::Tensor& in) {
    const torch::Tensor* w = weights.data() + per * l + (q4 ? q4_at[p] : amx_at[p]);
    return q4 ? q4_k::q4_linear(in, w[0], w[1], w[2]) : w[0].is_mkldnn() ? onednn_linear(in, w[0], pad_rows, min_rows) : amx_k::amx_linear(in, w[0]);
  };
  const int64_t n = x.size(0), d = cos.size(3);
  const auto dt = x.scalar_type();
  const bool onednn = !q4 && weights[1].is_mkldnn();
  TORCH_CHECK(x.dim() == 2 && (onednn ? dt == torch::kFloat : q4 ? (dt == torch::kBFloat16 || dt == torch::kFloat) : dt == torch::kBFloat16),
              "forward_layers: x [N, H] must be bf16 on AMX tiles, float32 with oneDNN weights, either with q4");
  check_pool("forward_layers", slot, pos, n, pool_k, pool_v, dt, hkv, d);
  pybind11::gil_scoped_release free_python;  // ATen alone from here: the server's other threads run meanwhile
  const int64_t* sp = slot.data_ptr<int64_t>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t qw = hq * d, kw = hkv * d;
  const auto write = dt == torch::kFloat ? write_kv<float> : write_kv<at::BFloat16>;
  std::vector<torch::Tensor> feats;
  x = x.contiguous();
  for (int64_t l = 0; l < layers; ++l) {
    auto qkv = linear(l, 0, norm_k::rms_norm(x, weights[per * l], eps));  // [N, (Hq + 2 Hkv) D]
    auto q = qkv.narrow(1, 0, qw).view({1, n, hq, d}), k = qkv.narrow(1, qw, kw).view({1, n, hkv, d});
    if (qk_norm) {  // each head's q and k normed over D before RoPE (Qwen3's layers, the drafter's)
      q = norm_k::rms_norm(q, weights[per * l + per - 2], eps);
      k = norm_k::rms_norm(k, weights[per * l + per - 1], eps);
    }
    q = norm_k::rope(q, cos, sin);  // [1, N, Hq, D]
    k = norm_k::rope(k, cos, sin);  // [1, N, Hkv, D]
    write(k[0], kw, pool_k[l], sp, pp);
    write(qkv.narrow(1, qw + kw, kw), qkv.stride(0), pool_v[l], sp, pp);
    auto att = attn_k::ragged_attention(q.view({n, hq, d}).to(torch::kFloat).contiguous(), pool_k[l], pool_v[l], req, trees, ctx, ctx_off,
                                        scale, amx_scores);  // [N, Hq, D] f32
    x = x + linear(l, 1, att.view({n, qw}).to(dt));
    auto gu = linear(l, 2, norm_k::rms_norm(x, weights[per * l + post], eps));  // [N, 2I]
    const int64_t inter = gu.size(1) / 2;
    auto act = at::silu(gu.narrow(1, 0, inter)) * gu.narrow(1, inter, inter);  // [N, I]
    x = x + linear(l, 3, act);
    if (std::find(features.begin(), features.end(), l) != features.end()) feats.push_back(x);
  }
  return {x, feats.empty() ? x.new_empty({n, 0}) : at::cat(feats, 1)};
}

// A drafter's context extension (`Drafter.extend_many`) in one call: ctx [N, H] (the fused target features, bf16 or
// float32) through every layer's k and v projections on the q4 kernel, k normed per head where the layer has a k
// norm, RoPE on k, both written into the layer's pool [R, Hkv, C, D] (ctx's dtype) at pool row slot[i], cache slot
// pos[i]. weights per layer: (packed, d, m) of k_proj, of v_proj, then the k norm [D] where there is one (6 or 7).
void extend_layers(torch::Tensor ctx, std::vector<torch::Tensor> weights, torch::Tensor cos, torch::Tensor sin,
                   std::vector<torch::Tensor> pool_k, std::vector<torch::Tensor> pool_v, torch::Tensor slot, torch::Tensor pos, int64_t hkv,
                   double eps) {
  const int64_t layers = static_cast<int64_t>(pool_k.size()), n = ctx.size(0), d = cos.size(3);
  const int64_t per = layers ? static_cast<int64_t>(weights.size()) / layers : 0;
  TORCH_CHECK(layers && (per == 6 || per == 7) && per * layers == static_cast<int64_t>(weights.size()),
              "extend_layers: 6 weights per layer (7 with a k norm)");
  const auto dt = ctx.scalar_type();
  TORCH_CHECK((dt == torch::kBFloat16 || dt == torch::kFloat) && ctx.dim() == 2, "extend_layers: ctx must be bf16 or float32 [N, H]");
  check_pool("extend_layers", slot, pos, n, pool_k, pool_v, dt, hkv, d);
  pybind11::gil_scoped_release free_python;
  const int64_t* sp = slot.data_ptr<int64_t>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t kw = hkv * d;
  const auto write = dt == torch::kFloat ? write_kv<float> : write_kv<at::BFloat16>;
  const torch::Tensor x = ctx.contiguous();
  for (int64_t l = 0; l < layers; ++l) {
    const torch::Tensor* w = weights.data() + per * l;
    auto k = q4_k::q4_linear(x, w[0], w[1], w[2]).view({1, n, hkv, d});  // [1, N, Hkv, D]
    if (per == 7) k = norm_k::rms_norm(k, w[6], eps);
    k = norm_k::rope(k, cos, sin);
    write(k[0], kw, pool_k[l], sp, pp);
    write(q4_k::q4_linear(x, w[3], w[4], w[5]), kw, pool_v[l], sp, pp);  // [N, Hkv * D]
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("extend_layers", &extend_layers, "a drafter's context K/V through its layers' q4 k/v projections into its pool, in one call (CPU)");
  m.def("forward_layers", &forward_layers, "a model's decoder layers over a packed ragged batch in one call (CPU; bf16 on AMX, float32 through oneDNN, or q4)");
}
