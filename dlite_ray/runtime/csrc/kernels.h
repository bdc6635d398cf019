// The kernels one C++ file calls in another's: the decoder layer loop (decoder_layers.cpp)
// runs the very functions the Python layers call one by one, so both give the same bits.
// (torch's extension loader rebuilds on a change to a .cpp file, not to this header.)
#pragma once

#include <torch/extension.h>

#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace dlite {

// The dtypes the AVX-512 kernels (decode attention, linears) compute in this build: float32
// with AVX-512 F, bf16 with AVX-512 BF16 as well; none without AVX-512.
inline std::vector<std::pair<at::ScalarType, std::string>> avx512_dtypes() {
  std::vector<std::pair<at::ScalarType, std::string>> built;
#if defined(__AVX512F__)
  built.emplace_back(at::kFloat, "float32");
#if defined(__AVX512BF16__)
  built.emplace_back(at::kBFloat16, "bfloat16");
#endif
#endif
  return built;
}

inline std::vector<std::string> avx512_dtype_names() {
  std::vector<std::string> names;
  for (const auto& [dtype, name] : avx512_dtypes()) names.push_back(name);
  return names;
}

inline bool avx512_computes(at::ScalarType dtype) {
  for (const auto& [built, name] : avx512_dtypes())
    if (built == dtype) return true;
  return false;
}

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
// One span's rows of q, [start, start + len) at positions first .., and the cache slots of
// its positions [0, first + len).
struct SpanKeys {
  int64_t start, len, first;
  const int64_t* slot;
};
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                               const torch::Tensor& slots, int64_t first);
torch::Tensor tree_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                             const std::vector<std::tuple<int64_t, int64_t, int64_t, torch::Tensor>>& spans,
                             int64_t shared);
torch::Tensor batch_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const std::vector<std::tuple<int64_t, int64_t, int64_t, torch::Tensor>>& spans);

// row_linear.cpp
// Whether bf16 kernels run on the AMX tile unit in this process: built with AMX, granted the
// tile state by Linux, and not refused by DLITE_AMX=0. Fixed for the process's life, since
// the unit's bits differ from the dot-product instruction's in the last place.
bool amx_enabled();
torch::Tensor row_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                         int64_t n);

}  // namespace dlite
