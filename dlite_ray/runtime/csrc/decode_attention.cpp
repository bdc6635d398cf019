// Decode and verify attention on CPU with AVX-512: the few new rows of one sequence against
// its paged context, for float32 or bf16 caches and head dims of 64 or 128 (see attention/sdpa.py,
// `SdpaBackend.attend`). The CPU flash kernel packs every key and value block for its
// matrix routine on every call, which for a handful of rows costs more than the arithmetic;
// here the keys are read where they lie, through their slots, and dotted with the query rows
// (bf16 by the bf16 dot-product instruction, where the CPU has AVX-512 BF16).
//
// A row's result depends on its position and its keys alone: keys are taken in fixed
// chunks of positions, and a row's chunks are merged in order. Inside a chunk every row of
// the KV head (its query heads times the new tokens) is scored from the same loads of a
// block of 16 keys, and a tile of rows is weighted from the same loads of each value; no
// operation mixes two rows, so each row goes through exactly the arithmetic it would alone
// (the same blocks, masked lanes, exp and order of accumulation). The row count, the other
// rows, the threads and where the slots lie change no bit, so a verify step computes each
// row exactly as decoding it alone does. Sharing the loads is what makes verify rows
// cheaper; a row's arithmetic is fixed, and with the keys in cache its P.V products (D / 16
// fused multiply-adds a key) run near the CPU's peak, so 8 new tokens still cost ~5x one
// there; read from memory, as in a forward, 2.3-3x (scripts/decode_attention_bench.py).
// In a bf16 cache the values are weighed two keys at a time by the bf16 dot-product
// instruction, each probability rounded to bf16 (the error against float64 grew ~10% on
// average, its maximum unchanged: the output's own rounding); that halved the P.V
// instructions, and made 8 rows at 4,096 positions 1.39x faster (head dim 64; 1.27x at 128).
//
// On a Xeon with AMX (amx_enabled: fixed per process, as for the linears), bf16 scores and
// P.V sums are tile products instead (AmxBf16Cache): with the arithmetic off the vector
// units, 8 rows at 4,096 positions went from 4.6x one row to ~2-2.7x (896 -> 530 us a layer,
// head dim 64), one row unchanged (it waits on memory), and a 3K-token SmolLM2 verify step
// from 31.8 to 23.0 ms, its prefill through this kernel from 3.6 to 1.9 s (step_bench.py).
#include <torch/extension.h>

#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define DLITE_DECODE_FLOAT 1  // float32 caches: AVX-512 F
#if defined(__AVX512BF16__)
#define DLITE_DECODE_BF16 1  // bf16 caches: the bf16 dot-product instruction
#if defined(DLITE_AMX_BUILD)
#define DLITE_DECODE_AMX 1  // bf16 caches on the tile unit, where the process may use it (amx_enabled)
#endif
#endif
#endif

namespace {

#ifdef DLITE_DECODE_FLOAT

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

// Asks for the `bytes` at p ahead of their use, into L1 (kNear) or L2 (kFar): a hint, no bit changes.
constexpr int kNear = 3, kFar = 2;  // __builtin_prefetch's locality
template <int Locality>
inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(static_cast<const char*>(p) + line, 0, Locality);
}

// A mask of the first n of a block's 16 lanes (all of them from n = 16 on).
inline __mmask16 first_lanes(int64_t n) {
  return n >= kBlock ? 0xffff : static_cast<__mmask16>((1u << n) - 1);
}

// What differs between cache dtypes: how a query row or a key is held in registers and
// dotted, and where a chunk's values are read as floats. Elem is the element as the cache
// stores it; Out the output tensor's element.
struct F32Cache {
  using Elem = float;
  using Out = float;
  static constexpr bool kAmx = false;
  template <int64_t D>
  struct Values {  // read where the cache holds them (asked for now, read by P.V later)
    std::vector<const float*> rows = std::vector<const float*>(kChunk);
    void set(int64_t j, const float* value) {
      rows[j] = value;
      prefetch<kFar>(value, D * sizeof(float));
    }
    const float* operator[](int64_t j) const { return rows[j]; }
    void done(int64_t /*count*/) {}
  };
  template <int64_t D>
  struct Vectors {  // a query row or a key: D floats
    __m512 v[D / 16];
    void load(const float* x) {
      for (int64_t i = 0; i < D / 16; ++i) v[i] = _mm512_loadu_ps(x + 16 * i);
    }
  };
  template <int64_t D>
  static __m512 dot(const Vectors<D>& q, const Vectors<D>& k) {  // q . k in 16 lanes of partial sums
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < D / 16; ++i) acc = _mm512_fmadd_ps(q.v[i], k.v[i], acc);
    return acc;
  }
};

#ifdef DLITE_DECODE_BF16
struct Bf16Cache {
  using Elem = uint16_t;
  using Out = at::BFloat16;
  static constexpr bool kAmx = false;
  // A chunk's values as bf16 pairs of consecutive keys, [key pair][D][2], what the bf16
  // dot-product instruction weighs two keys with in one go; a missing last partner is 0.
  template <int64_t D>
  struct Values {
    std::vector<uint16_t> pairs = std::vector<uint16_t>(kChunk * D);
    const uint16_t* even = nullptr;  // the first key of the pair being filled
    void set(int64_t j, const uint16_t* value) {
      if (j % 2 == 0) {
        even = value;
        return;
      }
      interleave(j / 2, even, value);
    }
    void done(int64_t count) {  // an odd count: the last key pairs with zeros
      if (count % 2) interleave(count / 2, even, nullptr);
    }
    void interleave(int64_t pair, const uint16_t* a, const uint16_t* b) {
      static const __m512i lo = pair_index(0), hi = pair_index(16);
      for (int64_t d = 0; d < D; d += 32) {
        const __m512i x = _mm512_loadu_si512(a + d), y = b ? _mm512_loadu_si512(b + d) : _mm512_setzero_si512();
        uint16_t* out = pairs.data() + (pair * D + d) * 2;
        _mm512_storeu_si512(out, _mm512_permutex2var_epi16(x, lo, y));
        _mm512_storeu_si512(out + 32, _mm512_permutex2var_epi16(x, hi, y));
      }
    }
    static __m512i pair_index(int first) {  // lanes (x[first + i], y[first + i]) for i < 16
      alignas(64) uint16_t idx[32];
      for (int i = 0; i < 16; ++i) idx[2 * i] = first + i, idx[2 * i + 1] = 32 + first + i;
      return _mm512_load_si512(idx);
    }
    // The 16 dims from d of key pair p: 32 bf16.
    __m512bh at(int64_t p, int64_t d) const {
      return (__m512bh)_mm512_loadu_si512(pairs.data() + (p * D + d) * 2);
    }
  };
  template <int64_t D>
  struct Vectors {  // a query row or a key: D bf16, 32 a vector
    __m512bh v[D / 32];
    void load(const uint16_t* x) {
      for (int64_t i = 0; i < D / 32; ++i) v[i] = (__m512bh)_mm512_loadu_si512(x + 32 * i);
    }
  };
  template <int64_t D>
  static __m512 dot(const Vectors<D>& q, const Vectors<D>& k) {  // by the bf16 dot-product instruction
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < D / 32; ++i) acc = _mm512_dpbf16_ps(acc, q.v[i], k.v[i]);
    return acc;
  }
};
#endif

template <int64_t D>
struct Partial {  // one row's softmax over one chunk
  static_assert(D % 64 == 0, "whole slices of value accumulators (kSlice)");
  float max = -INFINITY, sum = 0.f;
  alignas(64) float values[D];
};

// One query row inside one chunk: what it attends and where its results go.
template <typename Elem, int64_t D>
struct Row {
  const Elem* q;   // D elements
  float* scores;   // kChunk: scaled scores, then exp(score - max)
  int64_t seen;    // the chunk's first `seen` keys are at or before the row's position
  Partial<D>* out;
};

// f(std::integral_constant<int, R>{}, first) for rows [begin, end) in tiles of Max rows, the
// last tile shorter: R is a constant, so a tile's vectors stay in registers.
template <int R, typename F>
void last_tile(int64_t n, int64_t first, F& f) {
  if constexpr (R > 1)
    if (n < R) return last_tile<R - 1>(n, first, f);
  f(std::integral_constant<int, R>{}, first);
}

template <int Max, typename F>
void in_tiles(int64_t begin, int64_t end, F&& f) {
  for (; end - begin >= Max; begin += Max) f(std::integral_constant<int, Max>{}, begin);
  if constexpr (Max > 1)
    if (begin < end) last_tile<Max - 1>(end - begin, begin, f);
}

// Rows whose query vectors fill 16 registers: scored together, each key loaded once for all.
template <typename Cache, int64_t D>
constexpr int kScoreRows = std::max<int>(1, 16 * 64 / sizeof(typename Cache::template Vectors<D>));

// R rows' scaled scores against 16 keys (lane i: key i), each key loaded once for the R rows.
template <typename Cache, int64_t D, int R>
void score_tile(const typename Cache::Elem* const* q, const typename Cache::Elem* const* key, float scale,
                __m512 (&out)[R]) {
  typename Cache::template Vectors<D> query[R];
  for (int r = 0; r < R; ++r) query[r].load(q[r]);
  __m512 dots[R][kBlock];
  for (int64_t i = 0; i < kBlock; ++i) {
    typename Cache::template Vectors<D> k;
    k.load(key[i]);
    for (int r = 0; r < R; ++r) dots[r][i] = Cache::dot(query[r], k);
  }
  for (int r = 0; r < R; ++r) out[r] = _mm512_mul_ps(sum_lanes_of_each(dots[r]), _mm512_set1_ps(scale));
}

// One row's softmax over its scores: their max and sum into `out`, exp(score - max) in place.
template <typename Elem, int64_t D>
void softmax_row(const Row<Elem, D>& row) {
  const int64_t blocks = (row.seen + kBlock - 1) / kBlock;
  __m512 max = _mm512_set1_ps(-INFINITY);
  for (int64_t b = 0; b < blocks; ++b) max = _mm512_max_ps(max, _mm512_loadu_ps(row.scores + b * kBlock));
  row.out->max = _mm512_reduce_max_ps(max);
  const __m512 m = _mm512_set1_ps(row.out->max);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {  // masked keys: exp(-inf - max) = 0 (clamped: tiny, then zeroed)
    const __mmask16 valid = first_lanes(row.seen - b * kBlock);
    const __m512 shifted = _mm512_sub_ps(_mm512_loadu_ps(row.scores + b * kBlock), m);
    const __m512 p = _mm512_maskz_mov_ps(valid, exp_nonpositive(shifted));
    _mm512_storeu_ps(row.scores + b * kBlock, p);
    sum = _mm512_add_ps(sum, p);
  }
  row.out->sum = _mm512_reduce_add_ps(sum);
}

constexpr int kValueRows = 4;    // rows whose accumulators (a slice each) fill 16 registers
constexpr int64_t kSlice = 64;   // floats of a value accumulated at a time: 4 vectors

// R rows' sums of p_j * value_j over their keys, in order of j, each value loaded once for the
// R rows; rows[0] sees the fewest keys (rows come in order of position).
template <int64_t D, int R, typename Elem, typename Values>
void weigh_values_tile(const Row<Elem, D>* rows, const Values& values) {
  constexpr int64_t S = kSlice / 16;
  const int64_t common = rows[0].seen;
  for (int64_t d0 = 0; d0 < D; d0 += kSlice) {
    __m512 acc[R][S];
    for (int r = 0; r < R; ++r)
      for (int64_t s = 0; s < S; ++s) acc[r][s] = _mm512_setzero_ps();
    for (int64_t j = 0; j < common; ++j) {
      __m512 v[S];
      for (int64_t s = 0; s < S; ++s) v[s] = _mm512_loadu_ps(values[j] + d0 + 16 * s);
      for (int r = 0; r < R; ++r) {
        const __m512 p = _mm512_set1_ps(rows[r].scores[j]);
        for (int64_t s = 0; s < S; ++s) acc[r][s] = _mm512_fmadd_ps(p, v[s], acc[r][s]);
      }
    }
    for (int r = 1; r < R; ++r) {  // the keys the later rows see beyond rows[0]
      for (int64_t j = common; j < rows[r].seen; ++j) {
        const __m512 p = _mm512_set1_ps(rows[r].scores[j]);
        for (int64_t s = 0; s < S; ++s)
          acc[r][s] = _mm512_fmadd_ps(p, _mm512_loadu_ps(values[j] + d0 + 16 * s), acc[r][s]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int64_t s = 0; s < S; ++s) _mm512_store_ps(rows[r].out->values + d0 + 16 * s, acc[r][s]);
  }
}

#ifdef DLITE_DECODE_BF16
// bf16 caches: R rows' sums of p_j * value_j two keys at a time, by the bf16 dot-product
// instruction (each p rounded to bf16), in order of key pairs, each pair of values loaded
// once for the R rows. A row's last pair, where it sees an odd count of keys, weighs the key
// after with p = 0 (its score lane was masked), so the row's arithmetic stays its own.
template <int64_t D, int R>
void weigh_values_tile(const Row<uint16_t, D>* rows, const Bf16Cache::Values<D>& values) {
  constexpr int64_t S = kSlice / 16;
  alignas(64) uint16_t probs[R][kChunk];
  int64_t pairs[R];
  for (int r = 0; r < R; ++r) {
    pairs[r] = (rows[r].seen + 1) / 2;
    for (int64_t b = 0; b < (rows[r].seen + kBlock - 1) / kBlock; ++b)
      _mm256_store_si256(reinterpret_cast<__m256i*>(probs[r] + b * kBlock),
                         (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(rows[r].scores + b * kBlock)));
  }
  auto weight = [&](int r, int64_t p) {  // row r's probabilities of key pair p, in every lane
    int32_t pair;
    std::memcpy(&pair, probs[r] + 2 * p, sizeof(pair));
    return (__m512bh)_mm512_set1_epi32(pair);
  };
  const int64_t common = rows[0].seen / 2;
  for (int64_t d0 = 0; d0 < D; d0 += kSlice) {
    __m512 acc[R][S];
    for (int r = 0; r < R; ++r)
      for (int64_t s = 0; s < S; ++s) acc[r][s] = _mm512_setzero_ps();
    for (int64_t p = 0; p < common; ++p) {
      __m512bh v[S];
      for (int64_t s = 0; s < S; ++s) v[s] = values.at(p, d0 + 16 * s);
      for (int r = 0; r < R; ++r) {
        const __m512bh w = weight(r, p);
        for (int64_t s = 0; s < S; ++s) acc[r][s] = _mm512_dpbf16_ps(acc[r][s], w, v[s]);
      }
    }
    for (int r = 0; r < R; ++r) {  // the pairs a row sees beyond rows[0]'s whole pairs
      for (int64_t p = common; p < pairs[r]; ++p) {
        const __m512bh w = weight(r, p);
        for (int64_t s = 0; s < S; ++s) acc[r][s] = _mm512_dpbf16_ps(acc[r][s], w, values.at(p, d0 + 16 * s));
      }
    }
    for (int r = 0; r < R; ++r)
      for (int64_t s = 0; s < S; ++s) _mm512_store_ps(rows[r].out->values + d0 + 16 * s, acc[r][s]);
  }
}
#endif

// Rows [0, n) of one KV head over one chunk (keys: pointers to each key's D elements;
// values[j]: key j's value as D floats), in order of position, each seeing at least one of
// the chunk's `count` keys (n >= 1: the last token's rows see every chunk). Each key block is
// loaded once for every row that sees it, and each value once for a tile of rows.
template <typename Cache, int64_t D, typename Values>
void attend_chunk(const Row<typename Cache::Elem, D>* rows, int64_t n, const typename Cache::Elem* const* keys,
                  int64_t count, const Values& values, float scale) {
  using Elem = typename Cache::Elem;
  const int64_t blocks = (rows[n - 1].seen + kBlock - 1) / kBlock;
  int64_t from = 0;  // the first row that sees block b
  for (int64_t b = 0; b < blocks; ++b) {
    const Elem* key[kBlock];
    // Past a row's `seen` the lanes are masked, and a lane's score is its own key's alone, so
    // what those lanes read changes no bit.
    for (int64_t i = 0; i < kBlock; ++i) key[i] = keys[std::min(b * kBlock + i, count - 1)];
    for (int64_t i = 0; i < kBlock; ++i)  // the next block's keys, into L1
      prefetch<kNear>(keys[std::min((b + 1) * kBlock + i, count - 1)], D * sizeof(Elem));
    while (rows[from].seen <= b * kBlock) ++from;
    in_tiles<kScoreRows<Cache, D>>(from, n, [&](auto tile, int64_t first) {
      constexpr int R = decltype(tile)::value;
      const Elem* q[R];
      for (int r = 0; r < R; ++r) q[r] = rows[first + r].q;
      __m512 scores[R];
      score_tile<Cache, D, R>(q, key, scale, scores);
      for (int r = 0; r < R; ++r) {
        const Row<Elem, D>& row = rows[first + r];
        const __mmask16 valid = first_lanes(row.seen - b * kBlock);
        _mm512_storeu_ps(row.scores + b * kBlock, _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, scores[r]));
      }
    });
  }
  for (int64_t r = 0; r < n; ++r) softmax_row(rows[r]);
  in_tiles<kValueRows>(0, n, [&](auto tile, int64_t first) {
    weigh_values_tile<D, decltype(tile)::value>(rows + first, values);
  });
}

#ifdef DLITE_DECODE_AMX
// bf16 caches on the AMX tile unit (amx_enabled): the same chunks, partials and merge as the
// dot-product path, with the scores and the P.V sums taken by tile products. A tile's output
// element is one accumulator that takes its pair products in k order, whatever the other rows
// or columns of the tile hold, so each row's arithmetic is still its own; its bits differ from
// the dot-product path's in the last place, which is why the unit is fixed per process, as for
// the linears. Rows come 16 to a tile (padded with zero rows), keys 16 to a score tile; the
// keys are read once a chunk, into the tile unit's pair layout, for all the chunk's rows.
struct AmxBf16Cache : Bf16Cache {
  static constexpr bool kAmx = true;
};

constexpr int kTileRows = 16;    // rows of every tile: query rows, keys, key pairs
constexpr int64_t kTileK = 32;   // bf16 values of k a tile product takes: 16 pairs

// Every tile 16 rows of 64 bytes (16 float32 or 16 bf16 pairs): one configuration per thread.
void configure_attention_tiles() {
  dlite::TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = kTileRows, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

// 16 vectors of 16 int32 -> their transpose, in place (lane j of r[i] to lane i of r[j]).
inline void transpose_16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: (a0 b0 a1 b1), (a2 b2 a3 b3)
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  __m512i u[16];
  for (int g = 0; g < 4; ++g) {  // u[4g + j], 128-bit lane L: element 4L + j of rows 4g .. 4g + 3
    u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int j = 0; j < 4; ++j) {  // the 4 x 4 transpose of 128-bit lanes among u[j], u[4 + j], ..
    const __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88), v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xdd);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
    const __m512i v3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xdd);
    r[j] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[4 + j] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(v0, v2, 0xdd);
    r[12 + j] = _mm512_shuffle_i32x4(v1, v3, 0xdd);
  }
}

// A chunk's keys in the tile unit's pair layout: for key block b and step s (32 dims), 16
// pairs of dims by 16 keys, each a 32-bit (bf16, bf16): a score tile's right operand.
template <int64_t D>
struct KeyPairs {
  std::vector<uint32_t> pairs = std::vector<uint32_t>(kChunk * D / 2);
  const uint32_t* at(int64_t b, int64_t s) const { return pairs.data() + (b * D / kTileK + s) * 256; }
  void fill(const uint16_t* const* keys, int64_t count, int64_t blocks) {
    for (int64_t b = 0; b < blocks; ++b) {
      const uint16_t* key[kBlock];  // past `count`, the last key again: those scores are masked
      for (int64_t i = 0; i < kBlock; ++i) key[i] = keys[std::min(b * kBlock + i, count - 1)];
      for (int64_t s = 0; s < D / kTileK; ++s) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(key[i] + s * kTileK);
        transpose_16x16(r);
        uint32_t* out = pairs.data() + (b * D / kTileK + s) * 256;
        for (int p = 0; p < 16; ++p) _mm512_storeu_si512(out + 16 * p, r[p]);
      }
    }
  }
};

// Per thread: the chunk's key pairs, and one tile of rows' queries, probabilities and sums.
template <int64_t D>
struct AmxScratch {
  KeyPairs<D> keys;
  alignas(64) uint16_t queries[kTileRows * D];
  alignas(64) float scores[kTileRows * kBlock];
  alignas(64) uint16_t probs[kTileRows * kChunk];
  alignas(64) float sums[kTileRows * D];
};

// Rows [0, R) of a tile (R <= 16, in order of position) over one chunk: scaled and masked
// scores into each row's `scores`, then its softmax, then its P.V sums into its partial.
template <int64_t D>
void attend_tile_amx(const Row<uint16_t, D>* rows, int R, const Bf16Cache::Values<D>& values, float scale,
                     AmxScratch<D>& scratch) {
  constexpr int64_t kSteps = D / kTileK;  // tile products a score takes; query tiles 1 .. kSteps
  static_assert(kSteps == 2 || kSteps == 4, "head dims 64 and 128: query tiles 1-4, key tiles 5 and 6");
  std::memset(scratch.queries, 0, sizeof(scratch.queries));  // rows past R: zeros, their sums unused
  for (int r = 0; r < R; ++r) std::memcpy(scratch.queries + r * D, rows[r].q, D * sizeof(uint16_t));
  constexpr int64_t kQueryRow = D * sizeof(uint16_t);
  _tile_loadd(1, scratch.queries, kQueryRow);  // tile numbers are immediates: one line per step
  _tile_loadd(2, scratch.queries + kTileK, kQueryRow);
  if constexpr (kSteps > 2) {
    _tile_loadd(3, scratch.queries + 2 * kTileK, kQueryRow);
    _tile_loadd(4, scratch.queries + 3 * kTileK, kQueryRow);
  }
  const int64_t blocks = (rows[R - 1].seen + kBlock - 1) / kBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    _tile_zero(0);  // the scores in k order: steps 0, 1 (, 2, 3)
    _tile_loadd(5, scratch.keys.at(b, 0), 64);
    _tile_dpbf16ps(0, 1, 5);
    _tile_loadd(6, scratch.keys.at(b, 1), 64);
    _tile_dpbf16ps(0, 2, 6);
    if constexpr (kSteps > 2) {
      _tile_loadd(5, scratch.keys.at(b, 2), 64);
      _tile_dpbf16ps(0, 3, 5);
      _tile_loadd(6, scratch.keys.at(b, 3), 64);
      _tile_dpbf16ps(0, 4, 6);
    }
    _tile_stored(0, scratch.scores, kBlock * sizeof(float));
    for (int r = 0; r < R; ++r) {
      const __mmask16 valid = first_lanes(rows[r].seen - b * kBlock);
      const __m512 score = _mm512_mul_ps(_mm512_load_ps(scratch.scores + r * kBlock), _mm512_set1_ps(scale));
      _mm512_storeu_ps(rows[r].scores + b * kBlock, _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, score));
    }
  }
  for (int r = 0; r < R; ++r) softmax_row(rows[r]);
  // P.V: the probabilities (bf16, zero past a row's keys and for the padding rows) times the
  // values' key pairs, 32 keys a step, 64 dims (tiles 0-3) at a time.
  const int64_t steps = (rows[R - 1].seen + kTileK - 1) / kTileK;
  std::memset(scratch.probs, 0, sizeof(scratch.probs));
  for (int r = 0; r < R; ++r)
    for (int64_t b = 0; b < (rows[r].seen + kBlock - 1) / kBlock; ++b)
      _mm256_store_si256(reinterpret_cast<__m256i*>(scratch.probs + r * kChunk + b * kBlock),
                         (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(rows[r].scores + b * kBlock)));
  constexpr int64_t kPairRow = D * 2 * sizeof(uint16_t);  // bytes from one key pair to the next
  for (int64_t d0 = 0; d0 < D; d0 += 64)  // a step: 32 keys, 16 pairs of values D * 2 elements apart
    dlite::amx_sum_64_columns(scratch.probs, kChunk * sizeof(uint16_t), kTileK, values.pairs.data() + d0 * 2,
                              kPairRow, 16 * D * 2, steps, scratch.sums + d0, D * sizeof(float));
  for (int r = 0; r < R; ++r) std::memcpy(rows[r].out->values, scratch.sums + r * D, D * sizeof(float));
}

// attend_chunk on the tile unit: the chunk's keys into pairs once, then the rows 16 at a time.
template <int64_t D>
void attend_chunk_amx(const Row<uint16_t, D>* rows, int64_t n, const uint16_t* const* keys, int64_t count,
                      const Bf16Cache::Values<D>& values, float scale, AmxScratch<D>& scratch) {
  scratch.keys.fill(keys, count, (rows[n - 1].seen + kBlock - 1) / kBlock);
  for (int64_t first = 0; first < n; first += kTileRows)
    attend_tile_amx<D>(rows + first, static_cast<int>(std::min<int64_t>(kTileRows, n - first)), values, scale,
                       scratch);
}
#endif

// One row's chunks merged in order into its output (D elements).
template <int64_t D, typename Out>
void merge_chunks(const Partial<D>* const* parts, int64_t count, Out* out) {
  float max = -INFINITY, sum = 0.f;
  for (int64_t c = 0; c < count; ++c) max = std::max(max, parts[c]->max);
  __m512 acc[D / 16];
  for (int64_t d = 0; d < D / 16; ++d) acc[d] = _mm512_setzero_ps();
  for (int64_t c = 0; c < count; ++c) {
    alignas(64) float w[16];  // the chunk's weight, exp(max_c - max), in every lane: one is used
    _mm512_store_ps(w, exp_nonpositive(_mm512_set1_ps(parts[c]->max - max)));
    sum += parts[c]->sum * w[0];
    for (int64_t d = 0; d < D / 16; ++d)
      acc[d] = _mm512_fmadd_ps(_mm512_set1_ps(w[0]), _mm512_load_ps(parts[c]->values + 16 * d), acc[d]);
  }
  alignas(64) float merged[D];
  for (int64_t d = 0; d < D / 16; ++d) _mm512_store_ps(merged + 16 * d, _mm512_div_ps(acc[d], _mm512_set1_ps(sum)));
  for (int64_t d = 0; d < D; ++d) out[d] = static_cast<Out>(merged[d]);
}

template <typename Cache, int64_t D>
torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                     const std::vector<dlite::SpanKeys>& spans, int64_t shared) {
  using Elem = typename Cache::Elem;
  using Out = typename Cache::Out;
  const int64_t t = q.size(0), hq = q.size(1), hkv = k_cache.size(0), num_slots = k_cache.size(1);
  const int64_t group = hq / hkv, rows = group * t;
  std::vector<int64_t> position(t);
  int64_t ctx = 0;
  for (const auto& span : spans) {
    for (int64_t i = 0; i < span.len; ++i) position[span.start + i] = span.first + i;
    ctx = std::max(ctx, span.first + span.len);
  }
  const int64_t chunks = (ctx + kChunk - 1) / kChunk, common = shared / kChunk;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const auto* qp = reinterpret_cast<const Elem*>(q.data_ptr());
  const auto* kp = reinterpret_cast<const Elem*>(k_cache.data_ptr());
  const auto* vp = reinterpret_cast<const Elem*>(v_cache.data_ptr());
  // Work items (KV head, chunk, span): the first `common` chunks hold keys every span reads
  // alike, attended once for all rows (span -1); the others per span. Each item fills its
  // own partials, so threads change nothing.
  struct Item {
    int64_t head, chunk, span;
  };
  std::vector<Item> items;
  for (int64_t h = 0; h < hkv; ++h) {
    for (int64_t c = 0; c < common; ++c) items.push_back({h, c, -1});
    for (int64_t s = 0; s < static_cast<int64_t>(spans.size()); ++s)
      for (int64_t c = common; c * kChunk < spans[s].first + spans[s].len; ++c) items.push_back({h, c, s});
  }
  // Each span's partials, [Hkv][its chunks][its rows], one span after another: a batch of
  // sequences of unequal lengths holds no more than each would alone.
  std::vector<int64_t> span_of(t), base(spans.size());
  int64_t total = 0;
  for (size_t s = 0; s < spans.size(); ++s) {
    for (int64_t i = 0; i < spans[s].len; ++i) span_of[spans[s].start + i] = s;
    base[s] = total;
    total += hkv * ((spans[s].first + spans[s].len + kChunk - 1) / kChunk) * spans[s].len * group;
  }
  std::vector<Partial<D>> partials(total);
  auto partial = [&](int64_t h, int64_t c, int64_t r) {  // row r's partial over chunk c of KV head h
    const dlite::SpanKeys& span = spans[span_of[r / group]];
    const int64_t span_rows = span.len * group, span_chunks = (span.first + span.len + kChunk - 1) / kChunk;
    return &partials[base[span_of[r / group]] + (h * span_chunks + c) * span_rows + r - span.start * group];
  };
  const int64_t num_items = items.size(), grain = hkv * ctx * rows < (1 << 14) ? num_items : 1;
  at::parallel_for(0, num_items, grain, [&](int64_t begin, int64_t end) {
    std::vector<const Elem*> keys(kChunk);
    typename Cache::template Values<D> values;
    std::vector<float> scores(rows * kChunk);
    std::vector<Row<Elem, D>> live(rows);
#ifdef DLITE_DECODE_AMX
    std::unique_ptr<AmxScratch<D>> amx;  // tile configuration is per thread: set here, released below
    if constexpr (Cache::kAmx) {
      amx = std::make_unique<AmxScratch<D>>();
      configure_attention_tiles();
    }
#endif
    for (int64_t i = begin; i < end; ++i) {
      const auto [h, c, s] = items[i];
      const dlite::SpanKeys& span = spans[std::max<int64_t>(s, 0)];
      const int64_t start = c * kChunk, count = std::min(kChunk, span.first + span.len - start);
      for (int64_t j = 0; j < count; ++j) {  // the chunk's keys asked for at once: their reads overlap
        const int64_t offset = (h * num_slots + span.slot[start + j]) * D;
        keys[j] = kp + offset;
        prefetch<kFar>(keys[j], D * sizeof(Elem));
        values.set(j, vp + offset);
      }
      values.done(count);
      int64_t n = 0;
      const int64_t first_row = s < 0 ? 0 : span.start * group, last_row = s < 0 ? rows : (span.start + span.len) * group;
      for (int64_t r = first_row; r < last_row; ++r) {  // row r: token r / group, query head h * group + r % group
        const int64_t token = r / group, seen = std::min(count, position[token] + 1 - start);
        if (seen <= 0) continue;  // the chunk lies wholly after the row's position
        live[n++] = {qp + (token * hq + h * group + r % group) * D, scores.data() + r * kChunk, seen,
                     partial(h, c, r)};
      }
#ifdef DLITE_DECODE_AMX
      if constexpr (Cache::kAmx) {
        attend_chunk_amx<D>(live.data(), n, keys.data(), count, values, scale, *amx);
        continue;
      }
#endif
      attend_chunk<Cache, D>(live.data(), n, keys.data(), count, values, scale);
    }
#ifdef DLITE_DECODE_AMX
    if constexpr (Cache::kAmx) _tile_release();
#endif
  });
  auto out = torch::empty_like(q);
  auto* op = reinterpret_cast<Out*>(out.data_ptr());
  std::vector<const Partial<D>*> parts(chunks);
  for (int64_t h = 0; h < hkv; ++h) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t token = r / group, count = position[token] / kChunk + 1;
      for (int64_t c = 0; c < count; ++c) parts[c] = partial(h, c, r);
      merge_chunks<D>(parts.data(), count, op + (token * hq + h * group + r % group) * D);
    }
  }
  return out;
}

template <typename Cache>
torch::Tensor attend_head_dim(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const std::vector<dlite::SpanKeys>& spans, int64_t shared) {
  switch (q.size(2)) {
    case 64: return attend<Cache, 64>(q, k_cache, v_cache, spans, shared);
    case 128: return attend<Cache, 128>(q, k_cache, v_cache, spans, shared);
    default: TORCH_CHECK(false, "decode_attention: head dim ", q.size(2), " is not 64 or 128");
  }
}

#endif  // DLITE_DECODE_FLOAT

}  // namespace

namespace dlite {

namespace {

void check_tensors(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache) {
  TORCH_CHECK(avx512_computes(q.scalar_type()), "decode_attention: this build does not attend ", q.scalar_type());
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && q.is_contiguous() && (q.size(2) == 64 || q.size(2) == 128),
              "decode_attention: q must be contiguous CPU [T, Hq, 64 or 128]");
  TORCH_CHECK(k_cache.device().is_cpu() && v_cache.device().is_cpu(), "decode_attention: the caches must be on the CPU");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.is_contiguous() && k_cache.scalar_type() == q.scalar_type() &&
                  v_cache.scalar_type() == q.scalar_type() && k_cache.size(2) == q.size(2),
              "decode_attention: caches must be contiguous [Hkv, S, D] of q's dtype and head dim");
  const int64_t hkv = k_cache.size(0);
  TORCH_CHECK(hkv > 0 && q.size(1) % hkv == 0, "decode_attention: query heads are not a multiple of KV heads");
}

// A span's rows and keys, checked: its slots cover positions [0, first + len) of the cache.
SpanKeys span_keys(int64_t start, int64_t len, int64_t first, const torch::Tensor& slots, int64_t num_slots) {
  TORCH_CHECK(slots.device().is_cpu() && slots.scalar_type() == at::kLong && slots.dim() == 1 &&
                  slots.is_contiguous(), "decode_attention: slots must be contiguous CPU int64");
  TORCH_CHECK(first >= 0 && len >= 1 && slots.size(0) >= first + len,
              "decode_attention: slots must cover positions [0, first + T)");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < first + len; ++i)
    TORCH_CHECK(0 <= slot[i] && slot[i] < num_slots, "decode_attention: slot ", slot[i], " outside the cache");
  return {start, len, first, slot};
}

// (start, len, first, slots) spans, checked: they tile q's rows in order, each with its slots.
std::vector<SpanKeys> tiled_spans(const char* kernel, const torch::Tensor& q, const torch::Tensor& k_cache,
                                  const std::vector<std::tuple<int64_t, int64_t, int64_t, torch::Tensor>>& spans) {
  TORCH_CHECK(!spans.empty(), kernel, ": no spans");
  std::vector<SpanKeys> keys;
  int64_t next = 0;
  for (const auto& [start, len, first, slots] : spans) {
    TORCH_CHECK(start == next, kernel, ": the spans must tile q's rows in order");
    keys.push_back(span_keys(start, len, first, slots, k_cache.size(1)));
    next = start + len;
  }
  TORCH_CHECK(next == q.size(0), kernel, ": the spans must tile q's rows in order");
  return keys;
}

torch::Tensor attend_spans(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                           const std::vector<SpanKeys>& spans, int64_t shared) {
#ifdef DLITE_DECODE_AMX
  if (q.scalar_type() == at::kBFloat16 && amx_enabled())
    return attend_head_dim<AmxBf16Cache>(q, k_cache, v_cache, spans, shared);
#endif
#ifdef DLITE_DECODE_BF16
  if (q.scalar_type() == at::kBFloat16) return attend_head_dim<Bf16Cache>(q, k_cache, v_cache, spans, shared);
#endif
#ifdef DLITE_DECODE_FLOAT
  return attend_head_dim<F32Cache>(q, k_cache, v_cache, spans, shared);
#else
  TORCH_INTERNAL_ASSERT(false, "unreachable: `avx512_computes` refused every dtype");
#endif
}

}  // namespace

// q [T, Hq, D] at positions first .. first + T - 1, attending causally the keys and
// values of positions [0, first + T), which sit at `slots` of one layer's head-major cache
// [Hkv, S, D]; float32 or bf16 (as the build allows), D = 64 or 128. -> [T, Hq, D].
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                               const torch::Tensor& slots, int64_t first) {
  check_tensors(q, k_cache, v_cache);
  return attend_spans(q, k_cache, v_cache, {span_keys(0, q.size(0), first, slots, k_cache.size(1))}, 0);
}

// The chains of one tree of candidates (attention/metadata.py, `build_attention_metadata`):
// span i, (start, len, first, slots), is rows [start, start + len) of q at positions first ..,
// attending its slots as `decode_attention` does; the spans tile q's rows in order, and their
// slots agree on the tree's context, positions [0, shared). The context's whole chunks are
// read once for every row of every chain, so a tree costs little more than its longest
// chain; each row still has exactly the arithmetic of its chain decoded alone. -> [T, Hq, D].
torch::Tensor tree_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                             const std::vector<std::tuple<int64_t, int64_t, int64_t, torch::Tensor>>& spans,
                             int64_t shared) {
  check_tensors(q, k_cache, v_cache);
  const std::vector<SpanKeys> keys = tiled_spans("tree_attention", q, k_cache, spans);
  for (const SpanKeys& span : keys) {
    TORCH_CHECK(0 <= shared && shared <= span.first, "tree_attention: a span starts inside the shared context");
    TORCH_CHECK(std::equal(span.slot, span.slot + shared, keys.front().slot),
                "tree_attention: the spans' slots differ inside the shared context");
  }
  return attend_spans(q, k_cache, v_cache, keys, shared);
}

// Several sequences' new rows in one call: span i, (start, len, first, slots), is rows
// [start, start + len) of q at positions first .., attending its own slots as
// `decode_attention` does; the spans tile q's rows in order. One call a layer for a batch,
// its (KV head, chunk, sequence) items shared among the threads, where a call per sequence
// ran each short one on one thread; each row's bits are those of its sequence alone. -> [T, Hq, D].
torch::Tensor batch_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const std::vector<std::tuple<int64_t, int64_t, int64_t, torch::Tensor>>& spans) {
  check_tensors(q, k_cache, v_cache);
  return attend_spans(q, k_cache, v_cache, tiled_spans("batch_attention", q, k_cache, spans), 0);
}

}  // namespace dlite

void register_decode_attention(pybind11::module& m) {
  m.def("decode_attention", &dlite::decode_attention, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("tree_attention", &dlite::tree_attention, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("batch_attention", &dlite::batch_attention, pybind11::call_guard<pybind11::gil_scoped_release>());
}
