// The kernels one C++ file calls in another's: the decoder layer loop (decoder_layers.cpp)
// runs the very functions the Python layers call one by one, so both give the same bits.
// (torch's extension loader rebuilds on a change to a .cpp file, not to this header.)
#pragma once

#include <torch/extension.h>

#include <optional>
#include <tuple>

namespace dlite {

// fused_ops.cpp
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& residual,
                                                      const torch::Tensor& w, double eps);
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> rotate_qkv(const torch::Tensor& qkv, const torch::Tensor& cos,
                                                                   const torch::Tensor& signed_sin, int64_t hq,
                                                                   int64_t hkv);
torch::Tensor silu_mul(const torch::Tensor& gate_up);
void write_kv(torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& slots, const torch::Tensor& k,
              const torch::Tensor& v);

// decode_attention.cpp
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                               const torch::Tensor& slots, int64_t first);

// row_linear.cpp
torch::Tensor row_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                         int64_t n);

}  // namespace dlite
