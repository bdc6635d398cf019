// The draft's backbone for one round in one call (see dlite_ray/runtime/draft_layer_loop.py).
//
// A round's backbone, two decoder layers over a block of ~9 rows and 5 context slots, is
// ~40 small calls a layer in Python, each a few microseconds of interpreter and dispatch:
// ~0.9 ms a round at batch 1, twice what its weights take to read. Here the eager layers'
// operations run in the same order with the same arguments: our kernels (kernels.h) for
// the norms, linears and gated activation, ATen's for rotary, concatenation and attention,
// so every bit equals `DLiteDraftModel.backbone`'s eager path, which stays the reference
// (tests/runtime/test_draft_layer_loop.py).
#include <torch/extension.h>

#include <optional>
#include <utility>
#include <vector>

#include "kernels.h"

namespace {

// One draft decoder layer's frozen weights: norms, and the linears packed for `row_linear`.
struct DraftLayer {
  torch::Tensor input_norm, qkv, o, post_norm, gate_up, down;
  c10::optional<torch::Tensor> qkv_bias;
};

// x [..., D] as contiguous rows [M, D] (fused_ops._rows).
torch::Tensor rows_of(const torch::Tensor& x) { return x.reshape({-1, x.size(-1)}).contiguous(); }

// fused_ops.rms_norm on any leading shape.
torch::Tensor norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  return dlite::rms_norm(rows_of(x), w, eps).view(x.sizes());
}

// A RowLinear on any leading shape: [..., K] -> [..., n].
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                     int64_t n) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return dlite::row_linear(rows_of(x), packed, bias, n).view(shape);
}

// fused_ops.apply_rotary: x [..., H, Dh] rotated by the cos and signed sine of Rotary.cos_sin.
torch::Tensor apply_rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& signed_sin) {
  const auto swapped = x.unflatten(-1, {2, x.size(-1) / 2}).flip({-2}).flatten(-2);
  return x * cos + swapped * signed_sin;
}

class DraftLayers {
 public:
  DraftLayers(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps,
              bool context_layernorm, torch::Tensor final_norm)
      : hidden_(hidden), heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), intermediate_(intermediate),
        eps_(eps), context_layernorm_(context_layernorm), final_norm_(std::move(final_norm)) {}

  void add_layer(torch::Tensor input_norm, torch::Tensor qkv, c10::optional<torch::Tensor> qkv_bias, torch::Tensor o,
                 torch::Tensor post_norm, torch::Tensor gate_up, torch::Tensor down) {
    layers_.push_back({input_norm, qkv, o, post_norm, gate_up, down, qkv_bias});
  }

  // x [N, L, D] (the block's G tokens, then its masks, embedded) attending bidirectionally to
  // the context slots ctx [N, S, D] (context_norm's output) and to itself, through every
  // layer; cos and signed sines [L or S, 1, Dh] of the block's and the slots' local
  // positions. -> the final norm of the rows after the first g, [N, L - g, D].
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& ctx, const torch::Tensor& cos,
                        const torch::Tensor& signed_sin, const torch::Tensor& ctx_cos,
                        const torch::Tensor& ctx_signed_sin, int64_t g) const {
    TORCH_CHECK(x.dim() == 3 && ctx.dim() == 3 && x.size(0) == ctx.size(0) && x.size(2) == hidden_ &&
                    ctx.size(2) == hidden_ && 0 <= g && g < x.size(1),
                "draft_layers: x [N, L, D] and ctx [N, S, D] of the draft's width, 0 <= g < L");
    const int64_t q_width = heads_ * head_dim_, kv_width = kv_heads_ * head_dim_;
    const int64_t qkv_width = q_width + 2 * kv_width;
    for (const DraftLayer& w : layers_) {
      // The context slots are keys and values only, projected by this layer's k and v.
      const auto slots = linear(context_layernorm_ ? norm(ctx, w.input_norm, eps_) : ctx, w.qkv, w.qkv_bias,
                                qkv_width);
      const auto slot_k = apply_rotary(slots.narrow(-1, q_width, kv_width).unflatten(-1, {kv_heads_, head_dim_}),
                                       ctx_cos, ctx_signed_sin);
      const auto slot_v = slots.narrow(-1, q_width + kv_width, kv_width).unflatten(-1, {kv_heads_, head_dim_});
      const auto qkv = linear(norm(x, w.input_norm, eps_), w.qkv, w.qkv_bias, qkv_width);
      const auto qk = apply_rotary(qkv.narrow(-1, 0, q_width + kv_width).unflatten(-1, {-1, head_dim_}), cos,
                                   signed_sin);
      const auto v = qkv.narrow(-1, q_width + kv_width, kv_width).unflatten(-1, {kv_heads_, head_dim_});
      const auto keys = torch::cat({slot_k, qk.narrow(-2, heads_, kv_heads_)}, 1);
      const auto values = torch::cat({slot_v, v}, 1);
      const auto attended = at::scaled_dot_product_attention(qk.narrow(-2, 0, heads_).transpose(1, 2),
                                                             keys.transpose(1, 2), values.transpose(1, 2), {}, 0.0,
                                                             false, c10::nullopt, /*enable_gqa=*/true)
                                .transpose(1, 2);
      const auto out = linear(attended.flatten(-2), w.o, c10::nullopt, hidden_);
      auto [normed, summed] = dlite::add_rms_norm(rows_of(out), rows_of(x), w.post_norm, eps_);
      const auto mlp = linear(dlite::silu_mul(linear(normed, w.gate_up, c10::nullopt, 2 * intermediate_)), w.down,
                              c10::nullopt, hidden_);
      x = summed.view(x.sizes()) + mlp.view(x.sizes());
    }
    return norm(x.narrow(1, g, x.size(1) - g), final_norm_, eps_);
  }

 private:
  int64_t hidden_, heads_, kv_heads_, head_dim_, intermediate_;
  double eps_;
  bool context_layernorm_;
  torch::Tensor final_norm_;
  std::vector<DraftLayer> layers_;
};

}  // namespace

void register_draft_backbone(pybind11::module& m) {
  pybind11::class_<DraftLayers>(m, "DraftLayers")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, bool, torch::Tensor>())
      .def("add_layer", &DraftLayers::add_layer)
      .def("forward", &DraftLayers::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
}
