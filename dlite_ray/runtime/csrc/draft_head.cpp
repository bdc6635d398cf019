// The draft's sequential head for rows that draft greedily, all K steps in one call
// (runtime/sequential_head.py, `greedy_block`). In Python a step is ~20 calls of several
// microseconds each (~0.7 ms a round of 7 tokens at batch 1); here the same operations run
// from C++, in the same order, through the same kernels (`row_linear` for the three linears,
// ATen's for the element-wise ones), so every bit equals the eager loop's, which stays the
// reference (tests/runtime/test_draft_model.py). Only the argmax differs: one scan of each
// row's logits for its best two tokens, each the first of equal values, as argmax and argmax
// with the best masked out give them.
#include <torch/extension.h>

#include <algorithm>
#include <tuple>
#include <utility>

#include "kernels.h"

namespace dlite {
namespace {

// The best index and the best among the others (finite logits: what argmax, and argmax with
// the best masked out, give). A scalar scan took ~8 us a row of 8,192 logits, 0.9 ms of a
// round of 7 at 16 rows.
std::pair<int64_t, int64_t> best_two(const float* v, int64_t n) {
  const int64_t best = std::max<int64_t>(0, first_of(v, 0, n, max_of(v, 0, n)));
  const float other = std::max(max_of(v, 0, best), max_of(v, best + 1, n));
  int64_t second = first_of(v, 0, best, other);
  if (second < 0) second = first_of(v, best + 1, n, other);
  return {best, second < 0 ? best : second};
}

}  // namespace

// u [N, K, D] float32: the backbone's outputs at the masks; state [N, R]: s_0; token [N]: the
// anchor; embedding [V, R]: E_R; the three linears packed for `row_linear` with their biases
// (W_s: 2R -> 2R, W_h: R + D -> R, W_o: R -> M, no bias); out_ids [M]: the token of each of
// W_o's rows (empty: M = V, in order).
// -> (tokens [N, K], runners-up [N, K]): each step's argmax, fed to the next, and the likeliest other.
std::tuple<at::Tensor, at::Tensor> greedy_head(const at::Tensor& u, at::Tensor state, at::Tensor token,
                                               const at::Tensor& embedding, const at::Tensor& state_packed,
                                               const c10::optional<at::Tensor>& state_bias,
                                               const at::Tensor& hidden_packed,
                                               const c10::optional<at::Tensor>& hidden_bias,
                                               const at::Tensor& out_packed, int64_t out_features,
                                               const at::Tensor& out_ids) {
  TORCH_CHECK(u.dim() == 3 && u.scalar_type() == at::kFloat && state.dim() == 2 && state.size(0) == u.size(0) &&
                  token.scalar_type() == at::kLong && token.numel() == u.size(0) && embedding.size(1) == state.size(1),
              "greedy_head: u [N, K, D] float32, state [N, R], token [N] int64, embedding [V, R]");
  TORCH_CHECK(out_ids.numel() == 0 || out_ids.numel() == out_features, "greedy_head: one id per row of W_o");
  const int64_t n = u.size(0), steps = u.size(1), rank = state.size(1);
  const auto ids = out_ids.contiguous();
  const int64_t* id = ids.numel() ? ids.data_ptr<int64_t>() : nullptr;
  auto tokens = at::empty({n, steps}, at::kLong), runners_up = at::empty({n, steps}, at::kLong);
  auto tok = tokens.accessor<int64_t, 2>();
  auto other = runners_up.accessor<int64_t, 2>();
  for (int64_t k = 0; k < steps; ++k) {
    // advance: [g, c] = W_s [s; E_R[token]] + b_s; s = sigmoid(g) s + (1 - sigmoid(g)) tanh(c)
    const auto gates = row_linear(at::cat({state, at::embedding(embedding, token)}, -1), state_packed, state_bias,
                                  2 * rank).chunk(2, -1);
    const auto z = at::sigmoid(gates[0]);
    state = z * state + at::rsub(z, 1) * at::tanh(gates[1]);
    // r_k = W_h [s; u_k] + b_h; logits = W_o r_k
    const auto hidden = row_linear(at::cat({state, u.select(1, k)}, -1), hidden_packed, hidden_bias, rank);
    const auto logits = row_linear(hidden, out_packed, c10::nullopt, out_features).contiguous();
    const float* l = logits.data_ptr<float>();
    token = at::empty({n}, at::kLong);
    int64_t* next = token.data_ptr<int64_t>();
    for (int64_t row = 0; row < n; ++row) {
      const auto [best, second] = best_two(l + row * out_features, out_features);
      next[row] = tok[row][k] = id ? id[best] : best;
      other[row][k] = id ? id[second] : second;
    }
  }
  return {tokens, runners_up};
}

}  // namespace dlite

void register_draft_head(pybind11::module& m) { m.def("greedy_head", &dlite::greedy_head); }
