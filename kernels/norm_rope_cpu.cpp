// RMSNorm and rotary embeddings for CPU inference, one call each (kernels/norm_rope_cpu.py builds and calls them).
//
// PyTorch spends 8 small ops on an RMSNorm and 7 on a rotary embedding; a SmolLM2 step makes 61 of the one
// and 60 of the other, so at one or a few rows per step their dispatch costs more than their arithmetic.
// Both are per row, so a row's result never depends on what else is in the call (row-invariant).
//  - rms_norm: y = w * dtype(x * 1 / sqrt(mean(x^2) + eps)), the sum of squares in one fixed order
//    (16 lanes, then a halving sum); float32 math, rounded to the input dtype where PyTorch's version rounds.
//  - rope: y = dtype(dtype(x * cos) + dtype(rotate_half(x) * sin)), rounded after each op exactly as
//    PyTorch's bfloat16 ops do, so it gives PyTorch's bits.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

typedef float v16 __attribute__((vector_size(64)));

template <typename T>
inline float rnd(float v) {  // round to T and back (a no-op for float)
  return static_cast<float>(static_cast<T>(v));
}

template <typename T>
void norm_rows(const T* x, const T* w, T* y, int64_t rows, int64_t d, float eps) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / d), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const T* xr = x + r * d;
      v16 acc = {};
      int64_t e = 0;
      for (; e + 16 <= d; e += 16) {
        v16 v;
        for (int j = 0; j < 16; ++j) v[j] = static_cast<float>(xr[e + j]);
        acc = acc + v * v;
      }
      float tail = 0.0f;
      for (; e < d; ++e) tail = tail + static_cast<float>(xr[e]) * static_cast<float>(xr[e]);
      for (int width = 8; width >= 1; width /= 2)
        for (int j = 0; j < width; ++j) acc[j] = acc[j] + acc[j + width];
      const float s = acc[0] + tail;
      const float inv = 1.0f / std::sqrt(s / static_cast<float>(d) + eps);
      for (int64_t i = 0; i < d; ++i) {
        const float xn = rnd<T>(static_cast<float>(xr[i]) * inv);
        y[r * d + i] = static_cast<T>(static_cast<float>(w[i]) * xn);
      }
    }
  });
}

// x [B, T, H, D], cos/sin [B, T, D] (contiguous) -> y [B, T, H, D]
template <typename T>
void rope_rows(const T* x, const T* cs, const T* sn, T* y, int64_t b, int64_t t, int64_t h, int64_t d) {
  const int64_t half = d / 2;
  at::parallel_for(0, b * t, std::max<int64_t>(1, 4096 / (h * d)), [&](int64_t lo, int64_t hi) {
    for (int64_t bt = lo; bt < hi; ++bt) {
      const T *c = cs + bt * d, *s = sn + bt * d;
      for (int64_t hh = 0; hh < h; ++hh) {
        const T* xr = x + (bt * h + hh) * d;
        T* yr = y + (bt * h + hh) * d;
        for (int64_t i = 0; i < d; ++i) {
          const float rot = i < half ? -static_cast<float>(xr[i + half]) : static_cast<float>(xr[i - half]);
          const float a = rnd<T>(static_cast<float>(xr[i]) * static_cast<float>(c[i]));
          const float bb = rnd<T>(rot * static_cast<float>(s[i]));
          yr[i] = static_cast<T>(a + bb);
        }
      }
    }
  });
}

void check(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kBFloat16), what,
              " must be a float32 or bfloat16 CPU tensor");
}

}  // namespace

// x [..., D], weight [D] (x's dtype) -> [..., D]
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check(x, "rms_norm: x");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.dim() == 1 && weight.size(0) == x.size(-1),
              "rms_norm: weight must be [D] in x's dtype");
  const auto xc = x.contiguous();
  const auto w = weight.contiguous();
  auto y = torch::empty_like(xc);
  const int64_t d = x.size(-1), rows = d ? xc.numel() / d : 0;
  if (rows == 0) return y;
  if (x.scalar_type() == torch::kBFloat16)
    norm_rows(xc.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), rows, d, static_cast<float>(eps));
  else
    norm_rows(xc.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), rows, d, static_cast<float>(eps));
  return y;
}

// x [B, T, H, D], cos and sin [B, 1, T, D] (x's dtype) -> [B, T, H, D]
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  check(x, "rope: x");
  TORCH_CHECK(x.dim() == 4 && x.size(3) % 2 == 0, "rope: x must be [B, T, H, D] with D even");
  const int64_t b = x.size(0), t = x.size(1), h = x.size(2), d = x.size(3);
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type() && cos.dim() == 4 && cos.size(1) == 1 &&
                  cos.size(2) == t && cos.size(3) == d && sin.sizes() == cos.sizes() && (cos.size(0) == b || cos.size(0) == 1),
              "rope: cos and sin must be [B or 1, 1, T, D] in x's dtype");
  const auto xc = x.contiguous();
  const auto c = cos.expand({b, 1, t, d}).contiguous(), s = sin.expand({b, 1, t, d}).contiguous();
  auto y = torch::empty_like(xc);
  if (xc.numel() == 0) return y;
  if (x.scalar_type() == torch::kBFloat16)
    rope_rows(xc.data_ptr<at::BFloat16>(), c.data_ptr<at::BFloat16>(), s.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), b, t, h, d);
  else
    rope_rows(xc.data_ptr<float>(), c.data_ptr<float>(), s.data_ptr<float>(), y.data_ptr<float>(), b, t, h, d);
  return y;
}

#ifndef ADAFLASH_NO_MODULE  // kernels/stack_cpu.cpp includes this file for its functions
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm, one call, row-invariant (CPU)");
  m.def("rope", &rope, "rotary embedding of [B, T, H, D], one call (CPU)");
}
#endif
