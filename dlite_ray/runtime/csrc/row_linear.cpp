// Inference linears on CPU, y = x W^T + b, whose rows are exact by construction (see
// dlite_ray/runtime/frozen_linear.py, `RowLinear`). oneDNN picks its kernel by the call's
// row count, and some of those kernels round a row differently, so a verify step could
// give a row other bits than decoding it alone: frozen_linear.py used to probe each shape
// and pad or split calls around it. Here every output is one accumulator that takes the
// products of its row and column in a fixed order (k = 0, 1, ...: one fused multiply-add per
// k in float32, one bf16 pair dot product per two k in bf16), whatever the row count, the
// tile a row falls in, or the thread that runs it. No operation mixes two rows.
//
// Speed: decode and verify read each weight once from memory, so a call of 1 to ~16 rows
// costs about one read of its weight. The weight is packed at load into panels of 64 output
// columns, each one sequential stream ([K][64] floats, or [K / 2][64] bf16 pairs for the
// pair dot product), so the hardware prefetcher keeps the memory bus busy; threads take
// whole panels; a panel is swept once per tile of up to six rows, from cache after the
// first.
//
// AMX (Xeon from Sapphire Rapids on): bf16 linears whose K is a multiple of 32 run on the
// tile unit instead, for every row count, reading the same packed panels. Each row of a
// tile is one accumulator per output that takes the pair products in k order, alone, so
// rows stay exact; its bits differ from the dot-product instruction's in the last place,
// so the unit is chosen once per process (and per weight shape), never per call. 30 layers
// of SmolLM2's linears, 2 threads: 1 row 13.9 -> 8.7 ms, 8 rows 21.1 -> 9.5 ms (AVX-512 BF16
// -> AMX). DLITE_AMX=0 in the environment keeps the dot-product path.
#include <torch/extension.h>

#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define DLITE_LINEAR_FLOAT 1  // float32: AVX-512 F
#if defined(__AVX512BF16__)
#define DLITE_LINEAR_BF16 1  // bf16: the bf16 pair dot-product instruction
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define DLITE_LINEAR_AMX 1  // bf16 on the tile unit, where the kernel may use it (amx_enabled)
#endif
#endif
#endif

namespace {

constexpr int64_t kPanel = 64;  // output columns of a packed panel: four vectors of 16
constexpr int kTile = 6;        // rows swept together over a panel (24 accumulators)

#ifdef DLITE_LINEAR_FLOAT

// The rows' dot products with one panel, as float32 sums in `out` [R][64].
// float32 panel [K][64]: acc += x[k] * w[k] for k = 0 .. K - 1.
template <int R>
void panel(const float* x, int64_t k, const float* w, float* out) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    const float* wi = w + i * kPanel;
    __m512 wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = _mm512_loadu_ps(wi + 16 * j);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * k + i]);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(out + r * kPanel + 16 * j, acc[r][j]);
}

#endif

#ifdef DLITE_LINEAR_BF16

// bf16 panel [K / 2][64][2]: acc += x[2p] * w[2p] + x[2p + 1] * w[2p + 1] for p = 0 .. K / 2 - 1.
template <int R>
void panel(const at::BFloat16* x, int64_t k, const at::BFloat16* w, float* out) {
  const int64_t pairs = k / 2;
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const at::BFloat16* wp = w + p * 2 * kPanel;
    __m512bh wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(wp + 32 * j);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * k + 2 * p, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(out + r * kPanel + 16 * j, acc[r][j]);
}

#endif

#ifdef DLITE_LINEAR_AMX

constexpr int kAmxRows = 16;   // rows of a tile
constexpr int64_t kAmxK = 32;  // bf16 values of K per tile step: 16 pairs

// Tiles 0-3: the sums of `rows` rows with the panel's four groups of 16 columns (float32);
// tile 4: the rows' next 16 pairs of x; tiles 5 and 6: the panel's next 16 pairs of one group.
void configure_tiles(int rows) {
  dlite::TileConfig cfg;
  for (int t = 0; t < 5; ++t) cfg.rows[t] = static_cast<uint8_t>(rows), cfg.colsb[t] = 64;
  for (int t = 5; t < 7; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

// The configured rows' sums with one bf16 panel [K / 2][64][2], into `out` [rows][64].
void panel_amx(const at::BFloat16* x, int64_t k, const at::BFloat16* w, float* out) {
  constexpr int64_t kPairRow = 2 * kPanel * sizeof(at::BFloat16);  // bytes from one pair of the panel to the next
  dlite::amx_sum_64_columns(x, k * sizeof(at::BFloat16), kAmxK, w, kPairRow, kAmxK * kPanel, k / kAmxK, out,
                            kPanel * sizeof(float));
}

void linear_amx(const at::BFloat16* x, int64_t m, int64_t k, const at::BFloat16* packed, const at::BFloat16* bias,
                int64_t n, at::BFloat16* out) {
  const int64_t panels = (n + kPanel - 1) / kPanel, panel_size = k * kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float sums[kAmxRows * kPanel];
    int configured = 0;  // tile configuration is per thread: set here, released at the end
    for (int64_t panel = begin; panel < end; ++panel) {
      const int64_t col = panel * kPanel, cols = std::min(kPanel, n - col);
      for (int64_t row = 0; row < m; row += kAmxRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kAmxRows, m - row));
        if (rows != configured) {
          configure_tiles(rows);
          configured = rows;
        }
        panel_amx(x + row * k, k, packed + panel * panel_size, sums);
        for (int r = 0; r < rows; ++r) {
          at::BFloat16* y = out + (row + r) * n + col;
          const float* s = sums + r * kPanel;
          for (int64_t c = 0; c < cols; ++c)
            y[c] = static_cast<at::BFloat16>(bias ? s[c] + static_cast<float>(bias[col + c]) : s[c]);
        }
      }
    }
    if (configured) _tile_release();
  });
}

#endif

// The sums of `rows` (1 .. kTile) rows with one panel: one instantiation per row count, each
// row's arithmetic the same in all of them.
template <typename T>
void sweep_panel(const T* x, int64_t k, const T* w, float* sums, int rows) {
  static_assert(kTile == 6, "one case per row count of a tile");
  switch (rows) {
    case 1: return panel<1>(x, k, w, sums);
    case 2: return panel<2>(x, k, w, sums);
    case 3: return panel<3>(x, k, w, sums);
    case 4: return panel<4>(x, k, w, sums);
    case 5: return panel<5>(x, k, w, sums);
    default: return panel<6>(x, k, w, sums);
  }
}

// out [M, N] = x [M, K] times the packed weight [N / 64 panels] (+ bias [N], float32 add),
// each sum rounded once to T.
template <typename T>
void linear(const T* x, int64_t m, int64_t k, const T* packed, const T* bias, int64_t n, T* out) {
  const int64_t panels = (n + kPanel - 1) / kPanel, panel_size = k * kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    float sums[kTile * kPanel];
    for (int64_t panel = begin; panel < end; ++panel) {
      const int64_t col = panel * kPanel, cols = std::min(kPanel, n - col);
      for (int64_t row = 0; row < m; row += kTile) {
        const int rows = static_cast<int>(std::min<int64_t>(kTile, m - row));
        sweep_panel<T>(x + row * k, k, packed + panel * panel_size, sums, rows);
        for (int r = 0; r < rows; ++r) {
          T* y = out + (row + r) * n + col;
          const float* s = sums + r * kPanel;
          for (int64_t c = 0; c < cols; ++c)
            y[c] = static_cast<T>(bias ? s[c] + static_cast<float>(bias[col + c]) : s[c]);
        }
      }
    }
  });
}

}  // namespace

namespace dlite {

// Linux hands out the tile registers' state on request, once per process; DLITE_AMX=0 refuses.
bool amx_enabled() {
#ifdef DLITE_LINEAR_AMX
  static const bool enabled = [] {
    const char* env = std::getenv("DLITE_AMX");
    if (env != nullptr && std::string(env) == "0") return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // arch_prctl(ARCH_REQ_XCOMP_PERM)
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return enabled;
#else
  return false;
#endif
}

// Whether bf16 linears of inner size k run on the tile unit here: fixed per process and shape.
bool uses_amx(int64_t k) {
#ifdef DLITE_LINEAR_AMX
  return k % kAmxK == 0 && amx_enabled();
#else
  (void)k;
  return false;
#endif
}

// x [M, K] contiguous; packed [N_padded / 64, K, 64] (float32) or [N_padded / 64, K / 2, 128]
// (bf16 pairs), as frozen_linear.pack_row_linear lays it out; bias [N] or None -> [M, N].
torch::Tensor row_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                         int64_t n) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(avx512_computes(dtype), "row_linear: this build does not compute ", dtype);
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "row_linear: x must be contiguous CPU [M, K]");
  const int64_t m = x.size(0), k = x.size(1), panels = (n + kPanel - 1) / kPanel;
  TORCH_CHECK(packed.device().is_cpu() && packed.is_contiguous() && packed.scalar_type() == dtype &&
                  packed.numel() == panels * kPanel * k && (dtype != at::kBFloat16 || k % 2 == 0),
              "row_linear: the packed weight does not fit x [", m, ", ", k, "] and ", n, " outputs");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == dtype &&
                            bias->is_contiguous()), "row_linear: bias must be [N] in x's dtype");
  auto out = torch::empty({m, n}, x.options());
  if (m == 0) return out;
#ifdef DLITE_LINEAR_AMX
  if (dtype == at::kBFloat16 && uses_amx(k)) {
    linear_amx(x.data_ptr<at::BFloat16>(), m, k, packed.data_ptr<at::BFloat16>(),
               has_bias ? bias->data_ptr<at::BFloat16>() : nullptr, n, out.data_ptr<at::BFloat16>());
    return out;
  }
#endif
#ifdef DLITE_LINEAR_BF16
  if (dtype == at::kBFloat16) {
    linear<at::BFloat16>(x.data_ptr<at::BFloat16>(), m, k, packed.data_ptr<at::BFloat16>(),
                         has_bias ? bias->data_ptr<at::BFloat16>() : nullptr, n, out.data_ptr<at::BFloat16>());
    return out;
  }
#endif
#ifdef DLITE_LINEAR_FLOAT
  linear<float>(x.data_ptr<float>(), m, k, packed.data_ptr<float>(), has_bias ? bias->data_ptr<float>() : nullptr, n,
                out.data_ptr<float>());
  return out;
#else
  TORCH_INTERNAL_ASSERT(false, "unreachable: `avx512_computes` refused every dtype");
#endif
}

}  // namespace dlite

void register_row_linear(pybind11::module& m) {
  m.def("row_linear", &dlite::row_linear, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("row_linear_uses_amx", &dlite::uses_amx);
}
