// y[M, N] = x[M, K] @ W on the CPU, with W pre-packed into panels of P columns (P = kPanel: 16, or
// 32 with AVX-512), as an XLA FFI custom call (gemm_cpu.py).
//
// The packed layout is [ceil(N / P), K, P]: panel p holds columns Pp..Pp+P-1 of W, row after
// row, so a panel is one contiguous stream (a [N, K] matrix used as W^T, such as a tied embedding
// as the LM head, packs the same way). Every step of any row count reads W through it:
// - few rows (decode): a stream over the weights; XLA's CPU dot ran 2-16 rows at a third of the
//   memory bandwidth (its GEMV fast path covers one row only), reading [K, N] in short strided
//   runs;
// - many rows: register-blocked 6 x P tiles (12 vector accumulators), the panel's slice
//   staying in L1 while every 6-row group of x passes over it.
// y is float32; W is float32 or bfloat16; sums are float32; x is float32, or bfloat16 with pairs. bfloat16 W comes in one of two
// layouts, which the caller picks at packing time and passes as `bf16_pairs`:
// - widened: the [ceil(N / P), K, P] layout, each weight widened to float32 in registers and
//   multiplied by float32 x (x keeps its precision; float32 FMA speed);
// - pairs (CPUs with AVX512_BF16 only): [ceil(N / P), K / 2, P, 2], the two weights of a k-pair
//   side by side, which VDPBF16PS multiplies by x in bfloat16 (the caller rounds it, to nearest
//   even, in the XLA fusion that produces x, so no pass here converts it), summing in float32: twice the products per instruction of float32 FMAs. x rounded to
//   bfloat16 is what XLA's bfloat16 dot does too (transformer.linear casts x to the weight's
//   dtype).

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "gemm_tiles.h"
#include "parallel.h"
#include "vectors.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace xlaserve::gemm;

// Threads take runs of whole panels (each a contiguous stream of W), every row of x over them.
template <typename Mode>
void Gemm(ffi::ThreadPool& pool, const typename Mode::X* x, const typename Mode::W* w, float* y,
          int64_t m, int64_t units, int64_t n) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t parts = std::min<int64_t>(panels, 4 * std::max<int64_t>(pool.num_threads(), 1));
  const int64_t run = (panels + parts - 1) / parts;
  xlaserve::ParallelFor(pool, (panels + run - 1) / run, [&](int64_t part) {
    const int64_t first = part * run;
    PanelRange<Mode>(x, w, y, m, units, n, first, std::min(panels, first + run));
  });
}

// --- the gated MLP's first matmul with its activation --------------------------------------
//
// out[r, c] = silu(g[r, c]) * u[r, c] for [g | u] = x @ W, W's N = 2I columns the gate's then the
// up projection's (gate_up in transformer.py). A row block's tiles over gate panel p go to a
// scratch block in L1, then its tiles over up panel p + I / kPanel read them back as they write
// `out` [M, I] (float32, or bfloat16 for the k-pair down GEMM): the [M, 2I] float32 product, 4x
// the bytes, is never written to memory. (Computing a row tile's gate and up tiles back to back
// was no faster: the two panels no longer fit L1 together.) I is a multiple of kPanel; K is one
// block.
template <int kRows, typename Mode, typename O>
inline void SwigluTile(const typename Mode::X* x, int64_t ldx, const typename Mode::W* up,
                       int64_t depth, const float* gates, O* out, int64_t ldo) {
  constexpr int kUnroll = Mode::kInvariant ? 1 : kRows == 1 ? 4 : kRows == 2 ? 2 : 1;
  Vec u[kRows][2];
  Tile<kRows, kUnroll, Mode>(x, ldx, up, depth, u);
  for (int r = 0; r < kRows; ++r) {
    O* row = out + r * ldo;
    const float* g = gates + r * kPanel;
    const Vec v0 = xlaserve::Silu(Load(g)) * u[r][0];
    const Vec v1 = xlaserve::Silu(Load(g + kLanes)) * u[r][1];
    if constexpr (std::is_same_v<O, float>) {
      Store(row, v0);
      Store(row + kLanes, v1);
    } else {
      float values[kPanel];  // kPanel is 16 or 32: whole 16-float vectors
      Store(values, v0);
      Store(values + kLanes, v1);
      for (int c = 0; c < kPanel; c += 16) xlaserve::StoreBf16(row + c, xlaserve::Load16(values + c));
    }
  }
}

template <typename Mode, typename O>
void SwigluRows(const typename Mode::X* x, int64_t ldx, const typename Mode::W* gate,
                const typename Mode::W* up, int64_t depth, O* out, int64_t ldo, int64_t rows) {
  float gates[kRowBlock * kPanel];
  Rows<Mode>(x, ldx, gate, depth, gates, kPanel, rows, kPanel, false);
  int64_t r = 0;
  for (; r + kTileRows <= rows; r += kTileRows)
    SwigluTile<kTileRows, Mode>(x + r * ldx, ldx, up, depth, gates + r * kPanel, out + r * ldo, ldo);
  const typename Mode::X* xr = x + r * ldx;
  const float* gr = gates + r * kPanel;
  O* outr = out + r * ldo;
  switch (rows - r) {
    case 1: SwigluTile<1, Mode>(xr, ldx, up, depth, gr, outr, ldo); break;
    case 2: SwigluTile<2, Mode>(xr, ldx, up, depth, gr, outr, ldo); break;
    case 3: SwigluTile<3, Mode>(xr, ldx, up, depth, gr, outr, ldo); break;
    case 4: SwigluTile<4, Mode>(xr, ldx, up, depth, gr, outr, ldo); break;
    case 5: SwigluTile<5, Mode>(xr, ldx, up, depth, gr, outr, ldo); break;
    default: break;
  }
}

// As Gemm, over the gate panels (each with its up panel), K in one block.
template <typename Mode, typename O>
void GemmSwiglu(ffi::ThreadPool& pool, const typename Mode::X* x, const typename Mode::W* w,
                O* out, int64_t m, int64_t units, int64_t width) {
  const int64_t panels = width / kPanel;  // gate panels; the up panels follow them
  const int64_t parts = std::min<int64_t>(panels, 4 * std::max<int64_t>(pool.num_threads(), 1));
  const int64_t run = (panels + parts - 1) / parts;
  constexpr int64_t kUnitSize = Mode::kStep * kPanel;
  xlaserve::ParallelFor(pool, (panels + run - 1) / run, [&](int64_t part) {
    const int64_t first = part * run, last = std::min(panels, first + run);
    for (int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
      const int64_t rows = std::min(kRowBlock, m - r0);
      for (int64_t p = first; p < last; ++p)
        SwigluRows<Mode>(x + r0 * units, units, w + p * units * kUnitSize,
                         w + (p + panels) * units * kUnitSize, units, out + r0 * width + p * kPanel,
                         width, rows);
    }
  });
}


ffi::Error GemmImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                    ffi::Result<ffi::Buffer<ffi::F32>> y, int64_t layer, bool bf16_pairs,
                    bool invariant) {
  auto yd = y->dimensions();
  if (yd.size() != 2) return ffi::Error::InvalidArgument("packed GEMM (CPU): y [M, N]");
  const int64_t n = yd[1];
  Operands ops;
  if (auto error = CheckOperands("packed GEMM (CPU)", x, w, yd[0], n, layer, bf16_pairs, ops);
      error.failure())
    return error;
  if (ops.m == 0 || n == 0) return ffi::Error::Success();
  if (ops.k == 0) {
    std::memset(y->typed_data(), 0, ops.m * n * sizeof(float));
    return ffi::Error::Success();
  }
  WithMode(x, w, ops, bf16_pairs, invariant, [&](auto mode, const auto* xs, const auto* ws, int64_t units) {
    Gemm<decltype(mode)>(pool, xs, ws, y->typed_data(), ops.m, units, n);
  });
  return ffi::Error::Success();
}

ffi::Error GemmSwigluImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                          ffi::Result<ffi::AnyBuffer> out, int64_t layer, bool bf16_pairs,
                          bool invariant) {
  auto od = out->dimensions();
  const bool out_bf16 = out->element_type() == ffi::BF16;
  if (od.size() != 2 || (!out_bf16 && out->element_type() != ffi::F32) || od[1] % kPanel != 0)
    return ffi::Error::InvalidArgument(
        "packed GEMM + SwiGLU (CPU): out [M, I] is float32 or bfloat16, I whole panels");
  const int64_t width = od[1];
  Operands ops;
  if (auto error = CheckOperands("packed GEMM + SwiGLU (CPU)", x, w, od[0], 2 * width, layer,
                                 bf16_pairs, ops);
      error.failure())
    return error;
  if (ops.m == 0 || width == 0) return ffi::Error::Success();
  WithMode(x, w, ops, bf16_pairs, invariant, [&](auto mode, const auto* xs, const auto* ws, int64_t units) {
    using Mode = decltype(mode);
    if (out_bf16) {
      GemmSwiglu<Mode>(pool, xs, ws, static_cast<uint16_t*>(out->untyped_data()), ops.m, units, width);
    } else {
      GemmSwiglu<Mode>(pool, xs, ws, static_cast<float*>(out->untyped_data()), ops.m, units, width);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

extern "C" int64_t XlaservePackedGemmPanel() { return kPanel; }
extern "C" int64_t XlaservePackedGemmBf16Pairs() { return kHasBf16Pairs; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaservePackedGemm, GemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // x [M, K]: f32 (bf16: pairs)
                                  .Arg<ffi::AnyBuffer>()         // W packed, or a stack of them
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Attr<int64_t>("layer")
                                  .Attr<bool>("bf16_pairs")
                                  .Attr<bool>("invariant"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaservePackedGemmSwiglu, GemmSwigluImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [M, K]: f32 (bf16: pairs)
                                  .Arg<ffi::AnyBuffer>()  // W [(L,) 2I/kPanel, K, kPanel]
                                  .Ret<ffi::AnyBuffer>()  // out [M, I]: f32 or bf16
                                  .Attr<int64_t>("layer")
                                  .Attr<bool>("bf16_pairs")
                                  .Attr<bool>("invariant"));
