// Decode and verify attention on CPU with AVX-512 BF16: the few new rows of one sequence
// against its paged context, for bf16 and a head dim of 64 (see attention.py,
// `SdpaBackend.attend`). The CPU flash kernel packs every key and value block for its
// matrix routine on every call, which for a handful of rows costs more than the arithmetic;
// here the keys are read where they lie, through their slots, and dotted with the query rows
// by the bf16 dot-product instruction.
//
// A row's result depends on its position and its keys alone: keys are taken in fixed
// chunks of positions, each row is worked on its own inside a chunk, and the chunks are
// merged in order. The row count, the other rows, the threads and where the slots lie change
// no bit, so a verify step computes each row exactly as decoding it alone does.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define DLITE_DECODE_ATTENTION 1
#endif

namespace {

#ifdef DLITE_DECODE_ATTENTION

constexpr int64_t kDim = 64;     // head dim handled here
constexpr int64_t kChunk = 256;  // chunk c holds positions [c * kChunk, (c + 1) * kChunk)
constexpr int64_t kBlock = 16;   // keys scored together (one vector of scores)

// exp(x) for x <= 0, 16 at a time (Cephes' expf: Cody-Waite reduction, degree-6 polynomial).
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// 16 vectors of 16 partial sums -> one vector whose lane i is the sum of v[i]'s lanes.
inline __m512 sum_lanes_of_each(__m512 v[16]) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: (v2i[0]+v2i[2], v2i+1[0]+.., v2i[1]+v2i[3], ..)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the sums of keys 4i .. 4i + 3 over that lane
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // b[i] holds keys 4i..4i+3 in each of its four 128-bit lanes; add the four lanes up.
  const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xdd));
  const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xdd));
}

// A mask of the first n of a block's 16 lanes (all of them from n = 16 on).
inline __mmask16 first_lanes(int64_t n) {
  return n >= kBlock ? 0xffff : static_cast<__mmask16>((1u << n) - 1);
}

struct Partial {  // one row's softmax over one chunk
  float max = -INFINITY, sum = 0.f;
  alignas(64) float values[kDim];
};

// One row over the first `seen` keys of a chunk. keys: pointers to each key's 64 bf16;
// values: the chunk's values as float [kChunk][64].
void attend_chunk(const __m512bh q[2], const uint16_t* const* keys, const float* values, int64_t seen, float scale,
                  float* scores, Partial& out) {
  const int64_t blocks = (seen + kBlock - 1) / kBlock;
  __m512 max = _mm512_set1_ps(-INFINITY);
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 dots[kBlock];
    for (int64_t i = 0; i < kBlock; ++i) {
      const uint16_t* k = keys[std::min(b * kBlock + i, seen - 1)];  // past `seen`: masked below
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(k), k1 = (__m512bh)_mm512_loadu_si512(k + 32);
      dots[i] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), q[0], k0), q[1], k1);
    }
    const __mmask16 valid = first_lanes(seen - b * kBlock);
    const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid,
                                        _mm512_mul_ps(sum_lanes_of_each(dots), _mm512_set1_ps(scale)));
    _mm512_storeu_ps(scores + b * kBlock, s);
    max = _mm512_max_ps(max, s);
  }
  out.max = _mm512_reduce_max_ps(max);
  const __m512 m = _mm512_set1_ps(out.max);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {  // masked keys: exp(-inf - max) = 0 (clamped: tiny, then zeroed)
    const __mmask16 valid = first_lanes(seen - b * kBlock);
    const __m512 p = _mm512_maskz_mov_ps(valid, exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(scores + b * kBlock), m)));
    _mm512_storeu_ps(scores + b * kBlock, p);
    sum = _mm512_add_ps(sum, p);
  }
  out.sum = _mm512_reduce_add_ps(sum);
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t j = 0; j < seen; ++j) {
    const __m512 p = _mm512_set1_ps(scores[j]);
    for (int d = 0; d < 4; ++d) acc[d] = _mm512_fmadd_ps(p, _mm512_loadu_ps(values + j * kDim + 16 * d), acc[d]);
  }
  for (int d = 0; d < 4; ++d) _mm512_store_ps(out.values + 16 * d, acc[d]);
}

inline __m512 bf16_to_float(__m256i x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

#endif  // DLITE_DECODE_ATTENTION

bool available() {
#ifdef DLITE_DECODE_ATTENTION
  return true;
#else
  return false;
#endif
}

// q [T, Hq, 64] bf16 at positions first .. first + T - 1, attending causally the keys and
// values of positions [0, first + T), which sit at `slots` of one layer's head-major cache
// [Hkv, S, 64]. -> [T, Hq, 64].
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                               const torch::Tensor& slots, int64_t first) {
  TORCH_CHECK(available(), "decode_attention: built without AVX-512 BF16");
#ifdef DLITE_DECODE_ATTENTION
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && q.is_contiguous() && q.scalar_type() == at::kBFloat16 &&
                  q.size(2) == kDim, "decode_attention: q must be contiguous CPU bf16 [T, Hq, 64]");
  TORCH_CHECK(k_cache.device().is_cpu() && v_cache.device().is_cpu() && slots.device().is_cpu(),
              "decode_attention: the caches and slots must be on the CPU");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.is_contiguous() && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16 && k_cache.size(2) == kDim,
              "decode_attention: caches must be contiguous bf16 [Hkv, S, 64]");
  const int64_t t = q.size(0), hq = q.size(1), hkv = k_cache.size(0), num_slots = k_cache.size(1), ctx = first + t;
  TORCH_CHECK(hkv > 0 && hq % hkv == 0, "decode_attention: query heads are not a multiple of KV heads");
  TORCH_CHECK(first >= 0 && slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous() &&
                  slots.size(0) >= ctx, "decode_attention: slots must be int64 and cover positions [0, first + T)");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < ctx; ++i)
    TORCH_CHECK(0 <= slot[i] && slot[i] < num_slots, "decode_attention: slot ", slot[i], " outside the cache");

  const int64_t group = hq / hkv, rows = group * t, chunks = (ctx + kChunk - 1) / kChunk;
  const float scale = 1.0f / std::sqrt(static_cast<float>(kDim));
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const auto* kp = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  std::vector<Partial> partials(hkv * chunks * rows);
  // Work items (KV head, chunk); each fills its own partials, so threads change nothing.
  const int64_t grain = hkv * ctx * rows < (1 << 14) ? hkv * chunks : 1;
  at::parallel_for(0, hkv * chunks, grain, [&](int64_t begin, int64_t end) {
    std::vector<const uint16_t*> keys(kChunk);
    std::vector<float> values(kChunk * kDim);
    alignas(64) float scores[kChunk];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / chunks, c = item % chunks, start = c * kChunk, count = std::min(kChunk, ctx - start);
      for (int64_t j = 0; j < count; ++j) {
        const int64_t offset = (h * num_slots + slot[start + j]) * kDim;
        keys[j] = kp + offset;
        for (int d = 0; d < 4; ++d)
          _mm512_storeu_ps(values.data() + j * kDim + 16 * d,
                           bf16_to_float(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vp + offset + 16 * d))));
      }
      for (int64_t r = 0; r < rows; ++r) {  // row r: token r / group, query head h * group + r % group
        const int64_t token = r / group, seen = std::min(count, first + token + 1 - start);
        if (seen <= 0) continue;  // the chunk lies wholly after the row's position
        const uint16_t* qr = qp + (token * hq + h * group + r % group) * kDim;
        const __m512bh qv[2] = {(__m512bh)_mm512_loadu_si512(qr), (__m512bh)_mm512_loadu_si512(qr + 32)};
        attend_chunk(qv, keys.data(), values.data(), seen, scale, scores, partials[(h * chunks + c) * rows + r]);
      }
    }
  });
  auto out = torch::empty_like(q);
  auto* op = out.data_ptr<at::BFloat16>();
  for (int64_t h = 0; h < hkv; ++h) {
    for (int64_t r = 0; r < rows; ++r) {  // merge the row's chunks in order
      const int64_t token = r / group, last = (first + token) / kChunk;
      float max = -INFINITY, sum = 0.f;
      for (int64_t c = 0; c <= last; ++c) max = std::max(max, partials[(h * chunks + c) * rows + r].max);
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int64_t c = 0; c <= last; ++c) {
        const Partial& p = partials[(h * chunks + c) * rows + r];
        alignas(64) float w[16];  // the chunk's weight, exp(max_c - max), in every lane: one is used
        _mm512_store_ps(w, exp_nonpositive(_mm512_set1_ps(p.max - max)));
        sum += p.sum * w[0];
        for (int d = 0; d < 4; ++d) acc[d] = _mm512_fmadd_ps(_mm512_set1_ps(w[0]), _mm512_load_ps(p.values + 16 * d), acc[d]);
      }
      at::BFloat16* o = op + (token * hq + h * group + r % group) * kDim;
      alignas(64) float merged[kDim];
      for (int d = 0; d < 4; ++d) _mm512_store_ps(merged + 16 * d, _mm512_div_ps(acc[d], _mm512_set1_ps(sum)));
      for (int64_t d = 0; d < kDim; ++d) o[d] = static_cast<at::BFloat16>(merged[d]);
    }
  }
  return out;
#else
  return q;
#endif
}

}  // namespace

void register_decode_attention(pybind11::module& m) {
  m.def("decode_attention_available", &available);
  m.def("decode_attention", &decode_attention, pybind11::call_guard<pybind11::gil_scoped_release>());
}
