// The small operations around a decoder layer's linears and attention, each fused into one
// call (see dlite_ray/runtime/fused_ops.py). A CPU decode step of a small model is mostly
// such operations: one eager call each costs ~2-5 us of dispatch, and an RMSNorm alone was
// eight of them.
//
// Every kernel walks its rows one at a time, in a fixed order, so a row's bits never depend
// on how many rows the call has: a verify step then computes each row as decoding it alone
// would, which speculative decoding needs to be exact.
#include <torch/extension.h>

#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <tuple>

namespace dlite {

template <typename T>
inline float f(T x) {
  return static_cast<float>(x);
}

// Partial sums in this many lanes, added up at the end: a fixed order the compiler can
// vectorise (one running sum it may not reorder).
constexpr int64_t kLanes = 16;

// out = (x * rsqrt(mean(x^2) + eps)) rounded to T, times w: the rounding points of
// torch.nn.functional.rms_norm.
template <typename T>
void norm_row(const T* __restrict x, const T* __restrict w, T* __restrict out, int64_t d, float eps) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) lanes[j] += f(x[i + j]) * f(x[i + j]);
  float sum_sq = 0.f;
  for (; i < d; ++i) sum_sq += f(x[i]) * f(x[i]);
  for (int64_t j = 0; j < kLanes; ++j) sum_sq += lanes[j];
  const float inv = 1.f / std::sqrt(sum_sq / static_cast<float>(d) + eps);
  for (i = 0; i < d; ++i) out[i] = static_cast<T>(f(static_cast<T>(f(x[i]) * inv)) * f(w[i]));
}

void check_rows(const torch::Tensor& x, const torch::Tensor& w, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), name, ": x must be contiguous CPU [rows, D]");
  TORCH_CHECK(w.device().is_cpu(), name, ": weight must be on the CPU");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.scalar_type() == x.scalar_type() && w.is_contiguous(),
              name, ": weight must be [D] in x's dtype");
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  check_rows(x, w, "rms_norm");
  auto out = torch::empty_like(x);
  const int64_t rows = x.size(0), d = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    for (int64_t r = 0; r < rows; ++r)
      norm_row(x.data_ptr<scalar_t>() + r * d, w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>() + r * d, d, eps);
  });
  return out;
}

// (rms_norm(x + residual), x + residual): a layer's residual add and the norm after it.
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& residual,
                                                      const torch::Tensor& w, double eps) {
  check_rows(x, w, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() && residual.is_contiguous(),
              "add_rms_norm: residual must be contiguous and shaped like x");
  auto sum = torch::empty_like(x), out = torch::empty_like(x);
  const int64_t rows = x.size(0), d = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t *a = x.data_ptr<scalar_t>(), *b = residual.data_ptr<scalar_t>();
    scalar_t* s = sum.data_ptr<scalar_t>();
    for (int64_t i = 0; i < rows * d; ++i) s[i] = static_cast<scalar_t>(f(a[i]) + f(b[i]));
    for (int64_t r = 0; r < rows; ++r)
      norm_row(s + r * d, w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>() + r * d, d, eps);
  });
  return {out, sum};
}

// qkv [T, (Hq + 2 Hkv) * Dh] (the fused projection's output) -> q [T, Hq, Dh] and k [T, Hkv, Dh]
// rotated, v [T, Hkv, Dh]. cos and signed_sin [T, Dh] as Rotary.cos_sin builds them (the sine
// carries rotate-half's sign): out = x * cos + swap_halves(x) * signed_sin, each product
// rounded to T as the eager multiply does, then the sum.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> rotate_qkv(const torch::Tensor& qkv, const torch::Tensor& cos,
                                                                   const torch::Tensor& signed_sin, int64_t hq,
                                                                   int64_t hkv) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.dim() == 2 && qkv.is_contiguous(), "rotate_qkv: qkv must be contiguous CPU [T, W]");
  TORCH_CHECK(hq > 0 && hkv > 0, "rotate_qkv: head counts must be positive");
  const int64_t t = qkv.size(0), heads = hq + 2 * hkv, dh = qkv.size(1) / heads, half = dh / 2;
  TORCH_CHECK(qkv.size(1) == heads * dh && dh % 2 == 0, "rotate_qkv: width is not (hq + 2 hkv) * even head_dim");
  TORCH_CHECK(cos.sizes() == signed_sin.sizes() && cos.dim() == 2 && cos.size(0) == t && cos.size(1) == dh &&
                  cos.is_contiguous() && signed_sin.is_contiguous() && cos.scalar_type() == qkv.scalar_type() &&
                  signed_sin.scalar_type() == qkv.scalar_type(),
              "rotate_qkv: cos and signed_sin must be contiguous [T, Dh] in qkv's dtype");
  auto q = torch::empty({t, hq, dh}, qkv.options()), k = torch::empty({t, hkv, dh}, qkv.options());
  auto v = torch::empty({t, hkv, dh}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rotate_qkv", [&] {
    using T = scalar_t;
    for (int64_t r = 0; r < t; ++r) {
      const T* in = qkv.data_ptr<T>() + r * heads * dh;
      const T *c = cos.data_ptr<T>() + r * dh, *s = signed_sin.data_ptr<T>() + r * dh;
      for (int64_t h = 0; h < hq + hkv; ++h) {
        const T* x = in + h * dh;
        T* out = h < hq ? q.data_ptr<T>() + (r * hq + h) * dh : k.data_ptr<T>() + (r * hkv + h - hq) * dh;
        for (int64_t i = 0; i < dh; ++i) {
          const T swapped = x[i < half ? i + half : i - half];
          out[i] = static_cast<T>(f(static_cast<T>(f(x[i]) * f(c[i]))) + f(static_cast<T>(f(swapped) * f(s[i]))));
        }
      }
      std::copy(in + (hq + hkv) * dh, in + heads * dh, v.data_ptr<T>() + r * hkv * dh);
    }
  });
  return {q, k, v};
}

// gate_up [T, 2I] -> silu(gate) * up [T, I], with ATen's own vectorised silu and multiply
// (the bits of the eager calls, minus their dispatch from Python). ATen splits a call of
// more than GRAIN_SIZE elements between threads at any element, and the pieces' ends take a
// scalar path; calls of at most GRAIN_SIZE elements, whole rows each, keep every row on the
// same path whatever the row count.
torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be contiguous CPU [T, 2I]");
  const int64_t t = gate_up.size(0), width = gate_up.size(1) / 2;
  auto out = torch::empty({t, width}, gate_up.options());
  const int64_t rows_per_call = std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(width, 1));
  for (int64_t r = 0; r < t; r += rows_per_call) {
    const int64_t n = std::min(rows_per_call, t - r);
    auto rows = gate_up.narrow(0, r, n), o = out.narrow(0, r, n);
    at::silu_out(o, rows.narrow(1, 0, width));
    o.mul_(rows.narrow(1, width, width));
  }
  return out;
}

// Writes k, v [T, Hkv, Dh] into one layer of a head-major cache [Hkv, slots, Dh] at
// slots[T], non-finite values as 0 (see PagedKVCache.write).
void write_kv(torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& slots, const torch::Tensor& k,
              const torch::Tensor& v) {
  TORCH_CHECK(k_cache.device().is_cpu() && v_cache.device().is_cpu() && slots.device().is_cpu() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3 &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(), 
              "write_kv: caches must be contiguous CPU [Hkv, slots, Dh] of one dtype, slots on the CPU");
  const int64_t hkv = k_cache.size(0), num_slots = k_cache.size(1), dh = k_cache.size(2), t = slots.size(0);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(), "write_kv: slots must be int64 [T]");
  for (const auto* x : {&k, &v})
    TORCH_CHECK(x->is_contiguous() && x->dim() == 3 && x->size(0) == t && x->size(1) == hkv && x->size(2) == dh &&
                    x->scalar_type() == k_cache.scalar_type(), "write_kv: k and v must be contiguous [T, Hkv, Dh] in the cache's dtype");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < t; ++r)
    TORCH_CHECK(0 <= slot[r] && slot[r] < num_slots, "write_kv: slot ", slot[r], " outside the cache");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv", [&] {
    using T = scalar_t;
    for (auto [src, dst] : {std::pair{&k, &k_cache}, std::pair{&v, &v_cache}}) {
      for (int64_t r = 0; r < t; ++r) {
        for (int64_t h = 0; h < hkv; ++h) {
          const T* in = src->data_ptr<T>() + (r * hkv + h) * dh;
          T* out = dst->data_ptr<T>() + (h * num_slots + slot[r]) * dh;
          for (int64_t i = 0; i < dh; ++i) out[i] = std::isfinite(f(in[i])) ? in[i] : static_cast<T>(0.f);
        }
      }
    }
  });
}

}  // namespace dlite

void register_decode_attention(pybind11::module& m);  // decode_attention.cpp
void register_row_linear(pybind11::module& m);        // row_linear.cpp
void register_decoder_layers(pybind11::module& m);    // decoder_layers.cpp
void register_draft_head(pybind11::module& m);        // draft_head.cpp
void register_draft_backbone(pybind11::module& m);    // draft_backbone.cpp
void register_argmax(pybind11::module& m);            // argmax.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &dlite::rms_norm);
  m.def("add_rms_norm", &dlite::add_rms_norm);
  m.def("rotate_qkv", &dlite::rotate_qkv);
  m.def("silu_mul", &dlite::silu_mul);
  m.def("write_kv", &dlite::write_kv);
  m.def("kernel_dtypes", &dlite::avx512_dtype_names);  // what decode_attention and row_linear compute
  register_decode_attention(m);
  register_row_linear(m);
  register_decoder_layers(m);
  register_draft_head(m);
  register_draft_backbone(m);
  register_argmax(m);
}
