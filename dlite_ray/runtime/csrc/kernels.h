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

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define DLITE_AMX_BUILD 1  // the tile unit's instructions are in this build (amx_enabled: whether they run)
#endif

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

// Scans of a row of float32 logits (argmax.cpp, draft_head.cpp).
// The largest of v[begin, end), NaNs aside (-inf where empty): four vectors of lanes at a time.
inline float max_of(const float* v, int64_t begin, int64_t end) {
  float best = -INFINITY;
  int64_t j = begin;
#if defined(__AVX512F__)
  __m512 a = _mm512_set1_ps(best), b = a, c = a, d = a;
  for (; j + 64 <= end; j += 64) {
    a = _mm512_max_ps(a, _mm512_loadu_ps(v + j));
    b = _mm512_max_ps(b, _mm512_loadu_ps(v + j + 16));
    c = _mm512_max_ps(c, _mm512_loadu_ps(v + j + 32));
    d = _mm512_max_ps(d, _mm512_loadu_ps(v + j + 48));
  }
  for (; j + 16 <= end; j += 16) a = _mm512_max_ps(a, _mm512_loadu_ps(v + j));
  best = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(a, b), _mm512_max_ps(c, d)));
#endif
  for (; j < end; ++j) best = std::max(best, v[j]);
  return best;
}

// The first index of `value` in v[begin, end), or -1.
inline int64_t first_of(const float* v, int64_t begin, int64_t end, float value) {
  int64_t j = begin;
#if defined(__AVX512F__)
  const __m512 x = _mm512_set1_ps(value);
  for (; j + 16 <= end; j += 16) {
    const __mmask16 equal = _mm512_cmp_ps_mask(_mm512_loadu_ps(v + j), x, _CMP_EQ_OQ);
    if (equal) return j + __builtin_ctz(equal);
  }
#endif
  for (; j < end; ++j)
    if (v[j] == value) return j;
  return -1;
}

// argmax.cpp
torch::Tensor argmax_rows(const torch::Tensor& logits);

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

#ifdef DLITE_AMX_BUILD
// A tile configuration (palette 1): tile t has rows[t] rows of colsb[t] bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The sweep both bf16 kernels run on the tile unit (row_linear's panel, attention's P.V):
// out [configured rows][64 floats, out_stride bytes apart] = the sum over `steps` of tile 4
// (A: the rows' 32 bf16 at a + step * a_step, a_stride bytes apart) times four B tiles
// (16 bf16 pairs by 16 columns at b + step * b_step + 32 g for group g, b_stride bytes
// apart). Tiles 0-3 hold the sums, 4 the A operand, 5 and 6 the B operands, in turn.
template <typename T>
inline void amx_sum_64_columns(const T* a, int64_t a_stride, int64_t a_step, const T* b, int64_t b_stride,
                               int64_t b_step, int64_t steps, float* out, int64_t out_stride) {
  static_assert(sizeof(T) == 2, "bf16 elements");
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t step = 0; step < steps; ++step) {
    const T* bs = b + step * b_step;
    _tile_loadd(4, a + step * a_step, a_stride);
    _tile_loadd(5, bs, b_stride);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, bs + 32, b_stride);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, bs + 64, b_stride);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(6, bs + 96, b_stride);
    _tile_dpbf16ps(3, 4, 6);
  }
  _tile_stored(0, out, out_stride);
  _tile_stored(1, out + 16, out_stride);
  _tile_stored(2, out + 32, out_stride);
  _tile_stored(3, out + 48, out_stride);
}
#endif
torch::Tensor row_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                         int64_t n);

}  // namespace dlite
