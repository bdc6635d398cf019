// A decode or verify forward's decoder layers in one call (see dlite_ray/runtime/layer_loop.py).
//
// With the kernels of our own, a SmolLM2 decode step spent ~9 ms reading weights and ~3 ms
// in Python between the calls: ~20 small calls a layer, each a few microseconds of
// interpreter and dispatch. Here the same kernels run in the same order with the same
// arguments (kernels.h), so every bit equals the layer-by-layer path's
// (tests/runtime/test_layer_loop.py), without going back to Python between them.
#include <torch/extension.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <vector>

#include "kernels.h"

namespace {

// One decoder layer's frozen weights: norms, and the linears packed for `row_linear`.
struct Layer {
  torch::Tensor input_norm, qkv, o, post_norm, gate_up, down;
  c10::optional<torch::Tensor> qkv_bias;
};

// A sequence's new rows [start, start + len) at positions first .., attending `slots`; the
// last field, where not -1, names the tree of candidates whose chain the span is: the spans
// next to it with the same value are its tree's other chains (dlite::tree_attention), their
// shared context the positions before the earliest chain's first.
using Span = std::tuple<int64_t, int64_t, int64_t, torch::Tensor, int64_t>;

class DecoderLayers {
 public:
  DecoderLayers(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps)
      : hidden_(hidden), heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), intermediate_(intermediate),
        eps_(eps) {}

  void add_layer(torch::Tensor input_norm, torch::Tensor qkv, c10::optional<torch::Tensor> qkv_bias, torch::Tensor o,
                 torch::Tensor post_norm, torch::Tensor gate_up, torch::Tensor down) {
    layers_.push_back({input_norm, qkv, o, post_norm, gate_up, down, qkv_bias});
  }

  // x [T, D] through every layer; the new keys and values written at `slot_mapping` of each
  // layer's head-major cache. -> (x after the last layer, x after each layer in `taps`).
  std::tuple<torch::Tensor, std::vector<torch::Tensor>> forward(
      torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& signed_sin,
      std::vector<torch::Tensor> k_layers, std::vector<torch::Tensor> v_layers, const torch::Tensor& slot_mapping,
      const std::vector<Span>& spans, const std::vector<int64_t>& taps) const {
    TORCH_CHECK(k_layers.size() == layers_.size() && v_layers.size() == layers_.size(),
                "decoder_layers: one K and one V cache per layer");
    TORCH_CHECK(!spans.empty(), "decoder_layers: no spans");
    std::vector<torch::Tensor> tapped;
    std::vector<bool> is_tap(layers_.size(), false);
    for (int64_t layer : taps) {
      TORCH_CHECK(0 <= layer && layer < static_cast<int64_t>(layers_.size()), "decoder_layers: tap layer ", layer);
      is_tap[layer] = true;
    }
    const int64_t qkv_width = (heads_ + 2 * kv_heads_) * head_dim_;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& w = layers_[i];
      auto qkv = dlite::row_linear(dlite::rms_norm(x, w.input_norm, eps_), w.qkv, w.qkv_bias, qkv_width);
      auto [q, k, v] = dlite::rotate_qkv(qkv, cos, signed_sin, heads_, kv_heads_);
      dlite::write_kv(k_layers[i], v_layers[i], slot_mapping, k, v);
      auto attended = attend(q, k_layers[i], v_layers[i], spans);
      auto out = dlite::row_linear(attended.view({attended.size(0), heads_ * head_dim_}), w.o, c10::nullopt, hidden_);
      auto [normed, summed] = dlite::add_rms_norm(out, x, w.post_norm, eps_);
      auto gate_up = dlite::row_linear(normed, w.gate_up, c10::nullopt, 2 * intermediate_);
      x = summed + dlite::row_linear(dlite::silu_mul(gate_up), w.down, c10::nullopt, hidden_);
      if (is_tap[i]) tapped.push_back(x);
    }
    return {x, tapped};
  }

 private:
  static torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const std::vector<Span>& spans) {
    if (spans.size() == 1) {
      const auto& [start, len, first, slots, tree] = spans[0];
      return dlite::decode_attention(q, k_cache, v_cache, slots, first);
    }
    if (std::none_of(spans.begin(), spans.end(), [](const Span& s) { return std::get<4>(s) >= 0; })) {
      std::vector<std::tuple<int64_t, int64_t, int64_t, torch::Tensor>> batch;  // no trees: one call
      for (const auto& [start, len, first, slots, tree] : spans) batch.emplace_back(start, len, first, slots);
      return dlite::batch_attention(q, k_cache, v_cache, batch);
    }
    std::vector<torch::Tensor> outs;
    outs.reserve(spans.size());
    for (size_t i = 0; i < spans.size();) {
      const auto& [start, len, first, slots, tree] = spans[i];
      if (tree < 0) {
        outs.push_back(dlite::decode_attention(q.narrow(0, start, len).contiguous(), k_cache, v_cache, slots, first));
        ++i;
        continue;
      }
      std::vector<std::tuple<int64_t, int64_t, int64_t, torch::Tensor>> chains;  // rows counted from the tree's first
      int64_t rows = 0, shared = first;
      for (; i < spans.size() && std::get<4>(spans[i]) == tree; ++i) {
        chains.emplace_back(rows, std::get<1>(spans[i]), std::get<2>(spans[i]), std::get<3>(spans[i]));
        rows += std::get<1>(spans[i]);
        shared = std::min(shared, std::get<2>(spans[i]));
      }
      outs.push_back(dlite::tree_attention(q.narrow(0, start, rows).contiguous(), k_cache, v_cache, chains, shared));
    }
    return torch::cat(outs, 0);
  }

  int64_t hidden_, heads_, kv_heads_, head_dim_, intermediate_;
  double eps_;
  std::vector<Layer> layers_;
};

}  // namespace

void register_decoder_layers(pybind11::module& m) {
  pybind11::class_<DecoderLayers>(m, "DecoderLayers")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, double>())
      .def("add_layer", &DecoderLayers::add_layer)
      .def("forward", &DecoderLayers::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
}
