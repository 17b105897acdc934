// The many-rows path of the quantized GEMM (quantized_gemm_cpu.cc): W's quantized rows decoded
// into the float32 panels of the packed GEMM (gemm_tiles.h), one panel at a time, and multiplied
// by gemm_tiles.h's register tiles. A panel is decoded once per depth block for every row of x,
// and the tiles (6 rows of x by 2 vectors of outputs, no sums across lanes) run at the float32
// packed GEMM's speed: at M = 256, 1.9x the dot-product tiles over a decoded group (K x N
// 576x1536 and 2048x8192, Q8_0 and Q4_0, 2-core AVX-512 Xeon).
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "gemm_tiles.h"
#include "parallel.h"
#include "quantized_blocks.h"
#include "xla/ffi/api/ffi.h"

namespace xlaserve::quantized {

// K in equal blocks of whole steps, at most `most` (a multiple of the step) each: a short last
// block would waste a pass. Panels take blocks of gemm::kMaxDepth (768, a multiple of every
// step), so that the decoded block (96 KB with AVX-512) stays in L2.
template <typename F>
int64_t DepthBlock(int64_t k, int64_t most) {
  const int64_t blocks = (k + most - 1) / most;
  const int64_t depth = (k + blocks - 1) / blocks;
  return (depth + kStep<F> - 1) / kStep<F> * kStep<F>;
}

// Lane c of the transpose step that swaps bit kBit of the row and column indices of a kLanes x
// kLanes block, for the row with that bit clear (kHigh false) or set, out of the pair (a, b).
template <int kBit, bool kHigh>
constexpr int SwapIndex(int c) {
  if (kHigh) return (c & kBit) ? kLanes + c : c + kBit;
  return (c & kBit) ? kLanes + c - kBit : c;
}

template <int kBit, bool kHigh, int... C>
XLASERVE_INLINE Vec SwapLanes(Vec a, Vec b, std::integer_sequence<int, C...>) {
  return __builtin_shufflevector(a, b, SwapIndex<kBit, kHigh>(C)...);
}

// v (kLanes vectors, a kLanes x kLanes block) transposed in registers: one step per bit of the
// index. (Writing the block across one float at a time made the decode cost as much as the
// multiply at M = 64.)
template <int kBit = kLanes / 2>
XLASERVE_INLINE void Transpose(Vec (&v)[kLanes]) {
  constexpr auto lanes = std::make_integer_sequence<int, kLanes>{};
#pragma GCC unroll 16
  for (int i = 0; i < kLanes; ++i) {
    if (i & kBit) continue;
    const Vec a = v[i], b = v[i + kBit];
    v[i] = SwapLanes<kBit, false>(a, b, lanes);
    v[i + kBit] = SwapLanes<kBit, true>(a, b, lanes);
  }
  if constexpr (kBit > 1) Transpose<kBit / 2>(v);
}

// panel[d, j] = W[j, k0 + d] for d < depth, j < width (W's rows row_bytes apart from `rows`),
// and 0 for j in [width, kPanel): each row's part of a step of K decoded into a small [kPanel, S]
// block that stays in L1, then written across into the panel kLanes x kLanes at a time.
template <typename F>
void DecodePanel(const uint8_t* rows, int64_t row_bytes, int64_t width, int64_t k0, int64_t depth,
                 float* panel) {
  constexpr int64_t kPanel = gemm::kPanel, kSub = std::max<int64_t>(64, kStep<F>);
  alignas(64) float decoded[kPanel * kSub];
  std::fill(decoded + width * kSub, decoded + kPanel * kSub, 0.0f);
  for (int64_t s = 0; s < depth; s += kSub) {
    const int64_t count = std::min(kSub, depth - s), whole = count / kLanes * kLanes;
    for (int64_t j = 0; j < width; ++j)
      DecodeRange<F>(rows + j * row_bytes, k0 + s, count, decoded + j * kSub);
    for (int64_t j0 = 0; j0 < kPanel; j0 += kLanes) {
      for (int64_t d0 = 0; d0 < whole; d0 += kLanes) {
        Vec v[kLanes];
        for (int t = 0; t < kLanes; ++t) v[t] = Load(decoded + (j0 + t) * kSub + d0);
        Transpose(v);
        for (int t = 0; t < kLanes; ++t) Store(panel + (s + d0 + t) * kPanel + j0, v[t]);
      }
    }
    for (int64_t d = whole; d < count; ++d)  // the end of an i8_row K
      for (int64_t j = 0; j < kPanel; ++j) panel[(s + d) * kPanel + j] = decoded[j * kSub + d];
  }
}

// y[:, panels first..last) = x [m, k] @ W^T for W's quantized rows [n, row_bytes]: per panel and
// depth block, the decode and then every row of x over it.
template <typename F>
void PanelRange(const float* x, const uint8_t* w, float* y, int64_t m, int64_t k, int64_t n,
                int64_t row_bytes, int64_t first, int64_t last) {
  const int64_t depth_block = DepthBlock<F>(k, gemm::kMaxDepth);
  std::vector<float> panel(depth_block * gemm::kPanel);
  for (int64_t p = first; p < last; ++p) {
    const int64_t col = p * gemm::kPanel, width = std::min(gemm::kPanel, n - col);
    for (int64_t d0 = 0; d0 < k; d0 += depth_block) {
      const int64_t depth = std::min(depth_block, k - d0);
      DecodePanel<F>(w + col * row_bytes, row_bytes, width, d0, depth, panel.data());
      gemm::Rows<gemm::F32Weights>(x + d0, k, panel.data(), depth, y + col, n, m, width, d0 > 0);
    }
  }
}

// Threads take runs of whole panels, as the float32 packed GEMM's do.
template <typename F>
void PanelGemm(xla::ffi::ThreadPool& pool, const float* x, const uint8_t* w, float* y, int64_t m,
               int64_t k, int64_t n, int64_t row_bytes) {
  const int64_t panels = (n + gemm::kPanel - 1) / gemm::kPanel;
  const int64_t parts = std::min<int64_t>(panels, 4 * std::max<int64_t>(pool.num_threads(), 1));
  const int64_t run = (panels + parts - 1) / parts;
  xlaserve::ParallelFor(pool, (panels + run - 1) / run, [&](int64_t part) {
    const int64_t first = part * run;
    PanelRange<F>(x, w, y, m, k, n, row_bytes, first, std::min(panels, first + run));
  });
}

}  // namespace xlaserve::quantized
