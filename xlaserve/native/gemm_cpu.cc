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
// x and y are float32; W is float32 or bfloat16 (widened in registers); sums are float32.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

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

// Prefetches the panel stream kPrefetchBytes ahead of row k, one 64-byte line at a time.
template <typename T>
inline void Prefetch(const T* panel, int64_t k) {
  constexpr int64_t kRowBytes = kPanel * sizeof(T);
  const char* ahead = reinterpret_cast<const char*>(panel + k * kPanel) + kPrefetchBytes;
  if constexpr (kRowBytes >= 64) {
    for (int64_t line = 0; line < kRowBytes; line += 64) __builtin_prefetch(ahead + line);
  } else if (k % (64 / kRowBytes) == 0) {
    __builtin_prefetch(ahead);
  }
}

// tile[r, 0:kPanel] = sum over k < depth of x[r, k] * panel[k, 0:kPanel] for r < kRows; x rows `ldx`
// apart. kUnroll independent accumulator sets hide the FMA latency when the tile has few rows
// (one row alone would otherwise wait on two dependent FMA chains).
template <int kRows, int kUnroll, typename T>
inline void Tile(const float* x, int64_t ldx, const T* panel, int64_t depth, Vec (&out)[kRows][2]) {
  Vec acc[kUnroll][kRows][2] = {};
  int64_t k = 0;
  for (; k + kUnroll <= depth; k += kUnroll) {
#pragma GCC unroll 8
    for (int u = 0; u < kUnroll; ++u) {
      if constexpr (kRows > 1) Prefetch<T>(panel, k + u);
      const Vec w0 = Load(panel + (k + u) * kPanel), w1 = Load(panel + (k + u) * kPanel + kLanes);
#pragma GCC unroll 8
      for (int r = 0; r < kRows; ++r) {
        const float xr = x[r * ldx + k + u];
        acc[u][r][0] += xr * w0;
        acc[u][r][1] += xr * w1;
      }
    }
  }
  for (; k < depth; ++k) {
    const Vec w0 = Load(panel + k * kPanel), w1 = Load(panel + k * kPanel + kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      acc[0][r][0] += x[r * ldx + k] * w0;
      acc[0][r][1] += x[r * ldx + k] * w1;
    }
  }
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
template <int kRows, typename T>
inline void TileInto(const float* x, int64_t ldx, const T* panel, int64_t depth, float* y,
                     int64_t ldy, int64_t width, bool accumulate) {
  constexpr int kUnroll = kRows == 1 ? 4 : kRows == 2 ? 2 : 1;
  Vec out[kRows][2];
  Tile<kRows, kUnroll, T>(x, ldx, panel, depth, out);
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

template <typename T>
void Rows(const float* x, int64_t ldx, const T* panel, int64_t depth, float* y, int64_t ldy,
          int64_t rows, int64_t width, bool accumulate) {
  int64_t r = 0;
  for (; r + kTileRows <= rows; r += kTileRows)
    TileInto<kTileRows, T>(x + r * ldx, ldx, panel, depth, y + r * ldy, ldy, width, accumulate);
  const float* xr = x + r * ldx;
  float* yr = y + r * ldy;
  switch (rows - r) {
    case 1: TileInto<1, T>(xr, ldx, panel, depth, yr, ldy, width, accumulate); break;
    case 2: TileInto<2, T>(xr, ldx, panel, depth, yr, ldy, width, accumulate); break;
    case 3: TileInto<3, T>(xr, ldx, panel, depth, yr, ldy, width, accumulate); break;
    case 4: TileInto<4, T>(xr, ldx, panel, depth, yr, ldy, width, accumulate); break;
    case 5: TileInto<5, T>(xr, ldx, panel, depth, yr, ldy, width, accumulate); break;
    default: break;
  }
}

// Threads take runs of whole panels (each a contiguous stream of W); within a run, x goes in
// blocks of rows and K so that a panel's K block is reused from L1 by every row group.
template <typename T>
void Gemm(ffi::ThreadPool& pool, const float* x, const T* w, float* y, int64_t m, int64_t k,
          int64_t n) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t parts = std::min<int64_t>(panels, 4 * std::max<int64_t>(pool.num_threads(), 1));
  const int64_t run = (panels + parts - 1) / parts;
  // K in equal blocks of at most kMaxDepth: every block after the first adds into y, and a short
  // last block would cost a pass over y for little work.
  const int64_t depth_blocks = (k + kMaxDepth - 1) / kMaxDepth;
  const int64_t depth_block = (k + depth_blocks - 1) / depth_blocks;
  xlaserve::ParallelFor(pool, (panels + run - 1) / run, [&](int64_t part) {
    const int64_t first = part * run, last = std::min(panels, first + run);
    for (int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
      const int64_t rows = std::min(kRowBlock, m - r0);
      for (int64_t k0 = 0; k0 < k; k0 += depth_block) {
        const int64_t depth = std::min(depth_block, k - k0);
        for (int64_t p = first; p < last; ++p) {
          const int64_t col = p * kPanel;
          Rows<T>(x + r0 * k + k0, k, w + (p * k + k0) * kPanel, depth, y + r0 * n + col, n,
                  rows, std::min(kPanel, n - col), k0 > 0);
        }
      }
    }
  });
}

// W is one matrix's panels [ceil(N/kPanel), K, kPanel], or a stack of such matrices (one per layer)
// [L, ceil(N/kPanel), K, kPanel] of which `layer` is used: a stack is one argument of the step
// for all layers, and indexing it here costs no copy (an XLA slice would copy the weight).
ffi::Error GemmImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                    ffi::Result<ffi::Buffer<ffi::F32>> y, int64_t layer) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  const size_t wr = wd.size();
  if (xd.size() != 2 || (wr != 3 && wr != 4) || yd.size() != 2)
    return ffi::Error::InvalidArgument(
        "packed GEMM (CPU): x [M, K], W [(L,) panels, K, kPanel], y [M, N]");
  const int64_t m = xd[0], k = xd[1], n = yd[1];
  if (wd[wr - 2] != k || wd[wr - 1] != kPanel || yd[0] != m ||
      wd[wr - 3] != (n + kPanel - 1) / kPanel)
    return ffi::Error::InvalidArgument("packed GEMM (CPU): shapes do not match");
  const int64_t layers = wr == 4 ? wd[0] : 1;
  if (layer < 0 || layer >= layers)
    return ffi::Error::InvalidArgument("packed GEMM (CPU): layer out of range");
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) {
    std::memset(y->typed_data(), 0, m * n * sizeof(float));
    return ffi::Error::Success();
  }
  const int64_t offset = layer * wd[wr - 3] * k * kPanel;
  if (w.element_type() == ffi::F32)
    Gemm<float>(pool, x.typed_data(), static_cast<const float*>(w.untyped_data()) + offset,
                y->typed_data(), m, k, n);
  else if (w.element_type() == ffi::BF16)
    Gemm<uint16_t>(pool, x.typed_data(), static_cast<const uint16_t*>(w.untyped_data()) + offset,
                   y->typed_data(), m, k, n);
  else
    return ffi::Error::InvalidArgument("packed GEMM (CPU): float32 or bfloat16 weights");
  return ffi::Error::Success();
}

}  // namespace

extern "C" int64_t XlaservePackedGemmPanel() { return kPanel; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaservePackedGemm, GemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::AnyBuffer>()         // W packed, or a stack of them
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Attr<int64_t>("layer"));
