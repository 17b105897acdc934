// The panel micro-kernels of the CPU's packed GEMM (the layout and the three kernel instances are
// described in gemm_cpu.cc), shared by the dense GEMM (gemm_cpu.cc) and the experts' grouped GEMM
// (grouped_gemm_cpu.cc): register tiles of up to 6 rows over one panel, `PanelRange` (the rows
// of x over a run of panels: a thread's work item in both), and the operands' checks.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

#include "vectors.h"
#include "xla/ffi/api/ffi.h"

namespace xlaserve::gemm {

namespace ffi = xla::ffi;

// A panel is two vectors wide: 2 x 8 floats with AVX2, 2 x 16 with AVX-512 (twice the FMA width,
// and 32 vector registers for the 12 accumulators). `XlaservePackedGemmPanel` tells the packing
// code which.
#ifdef __AVX512F__
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float Vec __attribute__((vector_size(4 * kLanes)));
constexpr int64_t kPanel = 2 * kLanes;
constexpr int kTileRows = 6;        // rows of x per register tile: 6 x 2 accumulators
constexpr int64_t kMaxDepth = 768;  // K per pass: a panel's slice stays in L1 or L2
constexpr int64_t kRowBlock = 96;   // rows of x per pass: their K block stays in L2
// Bytes of the panel stream read ahead of use: the hardware prefetcher alone left steps of 4-16
// rows 20-30% slower (the first row tile over a panel waits on memory, the others hit L1). A
// one-row tile does not prefetch: it is a plain stream, which the hardware prefetcher keeps
// at memory speed, and the prefetch instructions made it 9-14% slower.
constexpr int64_t kPrefetchBytes = 2048;

inline Vec Load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(Vec));
  return v;
}

inline Vec Load(const uint16_t* p) {  // bfloat16 -> float32: the high half of the bits
  typedef uint16_t Bf16s __attribute__((vector_size(2 * kLanes)));
  typedef uint32_t U32s __attribute__((vector_size(4 * kLanes)));
  Bf16s h;
  std::memcpy(&h, p, sizeof(h));
  const U32s bits = __builtin_convertvector(h, U32s) << 16;
  Vec v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

inline void Store(float* p, Vec v) { std::memcpy(p, &v, sizeof(Vec)); }

// What a kernel instance multiplies: x's element type, W's, and how many k one element of x (and
// one row of a panel) covers.
struct F32Weights {
  using X = float;
  using W = float;
  static constexpr int64_t kStep = 1;
  static constexpr bool kPairs = false, kInvariant = false;
};
struct Bf16Weights {  // widened in registers
  using X = float;
  using W = uint16_t;
  static constexpr int64_t kStep = 1;
  static constexpr bool kPairs = false, kInvariant = false;
};
struct Bf16Pairs {  // x as bfloat16 pairs (one uint32 per k-pair), W in k-pairs: VDPBF16PS
  using X = uint32_t;
  using W = uint16_t;
  static constexpr int64_t kStep = 2;
  static constexpr bool kPairs = true, kInvariant = false;
};
// A mode whose every output element sums its products in one order, k after k, whatever the
// tile's rows (--enable-deterministic-inference): a row's result then does not depend on how
// many rows the step has. Without it, tiles of one and two rows split k over 4 and 2
// accumulator sets (their sums differ in the last bits from a 6-row tile's). The cost, a
// 1 x 576 x 1536 product in L2: 32.0 us for 29.1 (float32), 37.9 for 35.6 (bfloat16), Zen 4,
// 2026-11-29; out of cache, none measurable.
template <typename M>
struct Invariant : M {
  static constexpr bool kInvariant = true;
};
#ifdef __AVX512BF16__
constexpr bool kHasBf16Pairs = true;
#else
constexpr bool kHasBf16Pairs = false;
#endif

// Prefetches the panel stream kPrefetchBytes ahead of depth unit d, one 64-byte line at a time.
template <typename Mode>
inline void Prefetch(const typename Mode::W* panel, int64_t d) {
  constexpr int64_t kUnitBytes = Mode::kStep * kPanel * sizeof(typename Mode::W);
  const char* ahead = reinterpret_cast<const char*>(panel + d * Mode::kStep * kPanel) + kPrefetchBytes;
  if constexpr (kUnitBytes >= 64) {
    for (int64_t line = 0; line < kUnitBytes; line += 64) __builtin_prefetch(ahead + line);
  } else if (d % (64 / kUnitBytes) == 0) {
    __builtin_prefetch(ahead);
  }
}

// acc[r, 0:kPanel] += x[r, d] * panel[d, 0:kPanel] for one depth unit d (one k, or one k-pair).
template <int kRows, typename Mode>
inline void MultiplyAdd(Vec (&acc)[kRows][2], const typename Mode::X* x, int64_t ldx,
                        const typename Mode::W* panel, int64_t d) {
  if constexpr (Mode::kPairs) {
#ifdef __AVX512BF16__
    const uint16_t* row = panel + d * 2 * kPanel;
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(row);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(row + 2 * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * ldx + d]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xr, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xr, w1);
    }
#endif
  } else {
    const Vec w0 = Load(panel + d * kPanel), w1 = Load(panel + d * kPanel + kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const float xr = x[r * ldx + d];
      acc[r][0] += xr * w0;
      acc[r][1] += xr * w1;
    }
  }
}

// tile[r, 0:kPanel] = sum over d < depth of x[r, d] * panel[d, 0:kPanel] for r < kRows; x rows
// `ldx` apart. kUnroll independent accumulator sets hide the multiply-add latency when the tile
// has few rows (one row alone would otherwise wait on two dependent chains).
template <int kRows, int kUnroll, typename Mode>
inline void Tile(const typename Mode::X* x, int64_t ldx, const typename Mode::W* panel,
                 int64_t depth, Vec (&out)[kRows][2]) {
  Vec acc[kUnroll][kRows][2] = {};
  int64_t d = 0;
  for (; d + kUnroll <= depth; d += kUnroll) {
#pragma GCC unroll 8
    for (int u = 0; u < kUnroll; ++u) {
      if constexpr (kRows > 1) Prefetch<Mode>(panel, d + u);
      MultiplyAdd<kRows, Mode>(acc[u], x, ldx, panel, d + u);
    }
  }
  for (; d < depth; ++d) MultiplyAdd<kRows, Mode>(acc[0], x, ldx, panel, d);
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) {
    out[r][0] = acc[0][r][0];
    out[r][1] = acc[0][r][1];
#pragma GCC unroll 8
    for (int u = 1; u < kUnroll; ++u) {
      out[r][0] += acc[u][r][0];
      out[r][1] += acc[u][r][1];
    }
  }
}

// y[r, cols] (= or +=) the tile of rows [0, kRows) of x over one panel's K block; `width` <= kPanel
// valid columns (the last panel of an N that is not a multiple of kPanel is zero-padded).
template <int kRows, typename Mode>
inline void TileInto(const typename Mode::X* x, int64_t ldx, const typename Mode::W* panel,
                     int64_t depth, float* y, int64_t ldy, int64_t width, bool accumulate) {
  constexpr int kUnroll = Mode::kInvariant ? 1 : kRows == 1 ? 4 : kRows == 2 ? 2 : 1;
  Vec out[kRows][2];
  Tile<kRows, kUnroll, Mode>(x, ldx, panel, depth, out);
  for (int r = 0; r < kRows; ++r) {
    float* row = y + r * ldy;
    if (width == kPanel) {
      if (accumulate) {
        out[r][0] += Load(row);
        out[r][1] += Load(row + kLanes);
      }
      Store(row, out[r][0]);
      Store(row + kLanes, out[r][1]);
    } else {
      float values[kPanel];
      Store(values, out[r][0]);
      Store(values + kLanes, out[r][1]);
      for (int64_t c = 0; c < width; ++c) row[c] = accumulate ? row[c] + values[c] : values[c];
    }
  }
}

template <typename Mode>
void Rows(const typename Mode::X* x, int64_t ldx, const typename Mode::W* panel, int64_t depth,
          float* y, int64_t ldy, int64_t rows, int64_t width, bool accumulate) {
  int64_t r = 0;
  for (; r + kTileRows <= rows; r += kTileRows)
    TileInto<kTileRows, Mode>(x + r * ldx, ldx, panel, depth, y + r * ldy, ldy, width, accumulate);
  const typename Mode::X* xr = x + r * ldx;
  float* yr = y + r * ldy;
  switch (rows - r) {
    case 1: TileInto<1, Mode>(xr, ldx, panel, depth, yr, ldy, width, accumulate); break;
    case 2: TileInto<2, Mode>(xr, ldx, panel, depth, yr, ldy, width, accumulate); break;
    case 3: TileInto<3, Mode>(xr, ldx, panel, depth, yr, ldy, width, accumulate); break;
    case 4: TileInto<4, Mode>(xr, ldx, panel, depth, yr, ldy, width, accumulate); break;
    case 5: TileInto<5, Mode>(xr, ldx, panel, depth, yr, ldy, width, accumulate); break;
    default: break;
  }
}

// y[:, panels first..last) = x [m, K] @ W over that run of panels (y rows `n` apart). x goes in
// blocks of rows and K so that a panel's K block is reused from L1 by every row group. `units` is
// K in depth units (K / Mode::kStep), which is also x's row stride.
template <typename Mode>
void PanelRange(const typename Mode::X* x, const typename Mode::W* w, float* y, int64_t m,
                int64_t units, int64_t n, int64_t first, int64_t last) {
  // K in equal blocks of at most kMaxDepth: every block after the first adds into y, and a short
  // last block would cost a pass over y for little work.
  const int64_t max_units = kMaxDepth / Mode::kStep;
  const int64_t depth_blocks = (units + max_units - 1) / max_units;
  const int64_t depth_block = (units + depth_blocks - 1) / depth_blocks;
  constexpr int64_t kUnitSize = Mode::kStep * kPanel;  // W elements per depth unit of a panel
  for (int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
    const int64_t rows = std::min(kRowBlock, m - r0);
    for (int64_t d0 = 0; d0 < units; d0 += depth_block) {
      const int64_t depth = std::min(depth_block, units - d0);
      for (int64_t p = first; p < last; ++p) {
        const int64_t col = p * kPanel;
        Rows<Mode>(x + r0 * units + d0, units, w + (p * units + d0) * kUnitSize, depth,
                   y + r0 * n + col, n, rows, std::min(kPanel, n - col), d0 > 0);
      }
    }
  }
}

// x [M, K] and W checked against each other and the output's M and N. W is one matrix's panels
// [ceil(N/kPanel), K, kPanel] (with `grouped`, G such matrices [G, ...], one per group), or a
// stack of such (one per layer) [L, ...] of which `layer` is used: a stack is one argument of the
// step for all layers, and indexing it here costs no copy (an XLA slice would copy the weight).
// x is float32, or bfloat16 with k-pair panels.
struct Operands {
  int64_t m, k, offset;  // offset: the layer's first element in W
  int64_t groups;        // matrices per layer (1 unless grouped)
  int64_t matrix;        // elements per matrix
};

inline ffi::Error CheckOperands(const std::string& what, const ffi::AnyBuffer& x,
                                const ffi::AnyBuffer& w, int64_t out_rows, int64_t n,
                                int64_t layer, bool bf16_pairs, Operands& ops,
                                bool grouped = false) {
  auto xd = x.dimensions(), wd = w.dimensions();
  const size_t wr = wd.size(), axes = grouped ? 4 : 3;  // W's axes without the layer's
  if (xd.size() != 2 || (wr != axes && wr != axes + 1))
    return ffi::Error::InvalidArgument(
        what + (grouped ? ": x [M, K], W [(L,) G, panels, K, kPanel]"
                        : ": x [M, K], W [(L,) panels, K, kPanel]"));
  ops.m = xd[0];
  ops.k = xd[1];
  if (wd[wr - 2] != ops.k || wd[wr - 1] != kPanel || out_rows != ops.m ||
      wd[wr - 3] != (n + kPanel - 1) / kPanel)
    return ffi::Error::InvalidArgument(what + ": shapes do not match");
  const int64_t layers = wr == axes + 1 ? wd[0] : 1;
  if (layer < 0 || layer >= layers) return ffi::Error::InvalidArgument(what + ": layer out of range");
  if (w.element_type() != ffi::F32 && w.element_type() != ffi::BF16)
    return ffi::Error::InvalidArgument(what + ": float32 or bfloat16 weights");
  if (bf16_pairs && (!kHasBf16Pairs || w.element_type() != ffi::BF16 || ops.k % 2 != 0 ||
                     x.element_type() != ffi::BF16))
    return ffi::Error::InvalidArgument(
        what + ": k-pair panels need bfloat16 x and weights, an even K and AVX512_BF16");
  if (!bf16_pairs && x.element_type() != ffi::F32)
    return ffi::Error::InvalidArgument(what + ": x is float32 (bfloat16 with k-pairs)");
  ops.groups = grouped ? wd[wr - 4] : 1;
  ops.matrix = wd[wr - 3] * ops.k * kPanel;
  ops.offset = layer * ops.groups * ops.matrix;
  return ffi::Error::Success();
}

// run(Mode{}, x, W, K in depth units) with the kernel instance the operands take.
template <typename Run>
void WithMode(const ffi::AnyBuffer& x, const ffi::AnyBuffer& w, const Operands& ops,
              bool bf16_pairs, Run run) {
  if (w.element_type() == ffi::F32) {
    run(F32Weights{}, static_cast<const float*>(x.untyped_data()),
        static_cast<const float*>(w.untyped_data()) + ops.offset, ops.k);
    return;
  }
  const uint16_t* ws = static_cast<const uint16_t*>(w.untyped_data()) + ops.offset;
#ifdef __AVX512BF16__
  if (bf16_pairs) {
    // x's bfloat16 row, read two at a time, is the pair layout: k in the low half, k+1 high.
    run(Bf16Pairs{}, static_cast<const uint32_t*>(x.untyped_data()), ws, ops.k / 2);
    return;
  }
#endif
  run(Bf16Weights{}, static_cast<const float*>(x.untyped_data()), ws, ops.k);
}

// WithMode, each mode made Invariant where `invariant` asks.
template <typename Run>
void WithMode(const ffi::AnyBuffer& x, const ffi::AnyBuffer& w, const Operands& ops,
              bool bf16_pairs, bool invariant, Run run) {
  WithMode(x, w, ops, bf16_pairs, [&](auto mode, const auto* xs, const auto* ws, int64_t units) {
    if (invariant) {
      run(Invariant<decltype(mode)>{}, xs, ws, units);
    } else {
      run(mode, xs, ws, units);
    }
  });
}

}  // namespace xlaserve::gemm
