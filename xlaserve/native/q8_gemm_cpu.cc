// y[M, N] = x[M, K] @ W^T on the CPU with W kept in a GGUF format (or --quantization int8's rows)
// and x quantized per block to 8 bits, multiplied with integer dot products as llama.cpp does
// (q8_blocks.h: the formats, the activations' quantization and the numerics); an XLA FFI custom
// call (quantized_gemm_cpu.py, activations="q8"). W is rows [N, row_bytes] or a stack
// [L, N, row_bytes] of which `layer` is read, in one of two layouts:
// - the file's (quantized_gemm_cpu.cc's): threads take groups of kGroupRows rows of W and run
//   every row of x in register tiles of kTileRows x kTileCols, a row's dot product at a time
//   (the K-quants, and matrices whose rows do not come in eights);
// - interleaved 8 rows at a time (q8_interleaved.h; the blocks of 32 and int8's rows, laid out at
//   load): one vpdpbusd makes 8 outputs; threads take runs of groups (a stream the prefetcher
//   follows: the default model's one-row GEMMs 5.3 -> 2.6 ms, against one group at a time) and
//   run every row of x over each, kGroupTileRows at a time, x quantized in tiles of 8 rows.
//
// Why: decoding each weight to float32 and multiplying float32 x (quantized_gemm_cpu.cc) costs
// several instructions a weight; an integer dot product takes 32 weights' products in one or two
// (VNNI's vpdpbusd; AVX2's vpmaddubsw + vpmaddwd) and nibbles unpack 32 at a time.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "parallel.h"
#include "q8_blocks.h"
#include "q8_interleaved.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace xlaserve::q8;

// Accumulators of a tile: kTileRows x kTileCols vectors; with AVX-512's 32 vector registers 4 x 4
// (16, and 4 of W), with 16 (AVX2) 2 x 4. The interleaved layouts' tiles are kGroupTileRows rows
// of x by a group's 8 outputs (8 registers of W, one accumulator a row): 8 rows with AVX-512
// (the default model's 64-row step 7% faster than 4), 4 with AVX2.
#ifdef __AVX512F__
constexpr int kTileRows = 4, kGroupTileRows = 8;
#else
constexpr int kTileRows = 2, kGroupTileRows = 4;
#endif
constexpr int kTileCols = 4;
constexpr int64_t kGroupRows = 8;  // rows of W a thread takes at a time
constexpr int64_t kRunsPerThread = 4;  // interleaved layouts: runs of groups a thread takes
// Below this many values, x is quantized on the calling thread alone.
constexpr int64_t kParallelQuantize = 64 * 1024;

template <typename F>
constexpr bool kIsKQuant = F::kBlock == 256;

// y[r, c] for r < R, c < C: rows `x0`... of x against W's rows w (row_bytes apart).
template <typename F, int R, int C>
XLASERVE_INLINE void Tile(const XRows& x, int64_t x0, const uint8_t* w, int64_t row_bytes,
                          float* y, int64_t ldy) {
  const int64_t blocks = x.k / F::kBlock;
  Sums acc[R][C];
  float extra[R][C] = {};
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = ZeroSums();
  for (int64_t b = 0; b < blocks; ++b) {
    if constexpr (!kIsKQuant<F>) {
      Block32 wb[C];
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) wb[c] = F::Prepare(w + c * row_bytes + b * F::kBytes);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const Bytes xq = LoadBytes(x.Q(x0 + r) + 32 * b);
        const float dx = x.D(x0 + r)[b];
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) {
          const Lanes p = F::kSigned ? DotSS(wb[c].q, xq) : DotUS(wb[c].q, xq);
          acc[r][c] = MultiplyAdd(p, wb[c].d * dx, acc[r][c]);
          if constexpr (F::kHasMin) extra[r][c] += wb[c].m * x.S(x0 + r)[b];
        }
      }
    } else {
      BlockK wb[C];
      const uint8_t* block[C];
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        block[c] = w + c * row_bytes + b * F::kBytes;
        F::Prepare(block[c], wb[c]);
      }
      Lanes isum[R][C];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) isum[r][c] = ZeroLanes();
      for (int j = 0; j < 8; ++j) {
        Bytes wq[C];
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) wq[c] = F::Sub(block[c], j);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const Bytes xq = LoadBytes(x.Q(x0 + r) + 256 * b + 32 * j);
#pragma GCC unroll 4
          for (int c = 0; c < C; ++c)
            isum[r][c] = Add(isum[r][c], DotScaled(wq[c], xq, wb[c].scale[2 * j],
                                                   wb[c].scale[2 * j + 1]));
        }
      }
      for (int r = 0; r < R; ++r) {
        const float dx = x.D(x0 + r)[b];
        const int32_t* sums = x.Sum16(x0 + r) + 16 * b;
        for (int c = 0; c < C; ++c) {
          acc[r][c] = MultiplyAdd(isum[r][c], wb[c].d * dx, acc[r][c]);
          extra[r][c] -= F::Correction(wb[c], sums) * dx;
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * ldy + c] = Total(acc[r][c]) + extra[r][c];
}

// Quantized x: buffers per calling thread, grown as needed and kept.
struct XBuffer {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> sums;
};

// Runs one_row(r) for the m rows of x: on this thread for a small x, else over the pool.
template <typename OneRow>
void ForRows(ffi::ThreadPool& pool, int64_t m, int64_t k, OneRow one_row) {
  if (m * k < kParallelQuantize) {
    for (int64_t r = 0; r < m; ++r) one_row(r);
  } else {
    xlaserve::ParallelFor(pool, m, one_row);
  }
}

// x in rows (q8_blocks.h's XRows) for the file's layouts: blocks of 32, or Q8_K's of 256.
XRows QuantizeRows(ffi::ThreadPool& pool, const float* x, int64_t m, int64_t k, bool k_blocks) {
  thread_local XBuffer buffer;
  buffer.q.resize(m * k);
  buffer.d.resize(m * (k / 32));
  buffer.s.resize(m * (k / 32));
  buffer.sums.resize(m * (k / 16));
  XRows rows{buffer.q.data(), buffer.d.data(), buffer.s.data(), buffer.sums.data(), k, k_blocks};
  ForRows(pool, m, k, [&](int64_t r) {
    int8_t* q = rows.q + r * k;
    int32_t* sum16 = rows.sum16 + r * (k / 16);
    if (k_blocks)
      QuantizeBlocksK(x + r * k, k, q, rows.d + r * (k / 256), sum16);
    else
      QuantizeBlocks32(x + r * k, k, q, rows.d + r * (k / 32), rows.s + r * (k / 32), sum16);
  });
  return rows;
}

// x in tiles of 8 rows (XTiles) for the interleaved layouts.
XTiles QuantizeTiles(ffi::ThreadPool& pool, const float* x, int64_t m, int64_t k) {
  thread_local XBuffer buffer;
  const int64_t padded = (m + 7) / 8 * 8, blocks = k / 32;
  buffer.q.resize(padded * k);
  buffer.d.resize(padded * blocks);
  buffer.s.resize(padded * blocks);
  buffer.sums.resize(padded * blocks);
  XTiles tiles{buffer.q.data(), buffer.d.data(), buffer.s.data(), buffer.sums.data(), blocks};
  ForRows(pool, m, k, [&](int64_t r) { QuantizeTiled32(x + r * k, r, tiles); });
  return tiles;
}

template <typename F>
void Gemm(ffi::ThreadPool& pool, const XRows& x, const uint8_t* w, int64_t row_bytes, float* y,
          int64_t m, int64_t n) {
  const int64_t groups = (n + kGroupRows - 1) / kGroupRows;
  xlaserve::ParallelFor(pool, groups, [&](int64_t g) {
    const int64_t n0 = g * kGroupRows, cols = std::min(kGroupRows, n - n0);
    xlaserve::quantized::ForTiles<kTileRows, kTileCols>(m, cols, [&](auto rows, auto tile_cols,
                                                                     int64_t r, int64_t c) {
      Tile<F, rows, tile_cols>(x, r, w + (n0 + c) * row_bytes, row_bytes, y + r * n + n0 + c, n);
    });
  });
}

// Runs the largest group tile of at most `rows` (and kGroupTileRows) rows from row x0 of x;
// returns its rows.
template <typename F, int R = kGroupTileRows>
int64_t GroupRows(const XTiles& x, int64_t x0, int64_t rows, const uint8_t* group, int64_t blocks,
                  float* y, int64_t ldy) {
  if constexpr (R > 1) {
    if (rows < R) return GroupRows<F, R / 2>(x, x0, rows, group, blocks, y, ldy);
  }
  GroupTile<F, R>(x, x0, group, blocks, y, ldy);
  return R;
}

// The interleaved layouts (q8_interleaved.h): a thread takes a run of groups of 8 rows of W
// and runs every row of x over each, kTileRows at a time.
template <typename F>
void GemmX8(ffi::ThreadPool& pool, const XTiles& x, const uint8_t* w, int64_t row_bytes, float* y,
            int64_t m, int64_t n) {
  const int64_t groups = n / 8, blocks = x.blocks;
  const int64_t parts = std::min<int64_t>(groups, kRunsPerThread * std::max<int64_t>(pool.num_threads(), 1));
  const int64_t run = (groups + parts - 1) / parts;
  xlaserve::ParallelFor(pool, (groups + run - 1) / run, [&](int64_t part) {
    for (int64_t g = part * run; g < std::min(groups, part * run + run); ++g) {
      const uint8_t* group = w + g * 8 * row_bytes;
      for (int64_t r = 0; r < m;) r += GroupRows<F>(x, r, m - r, group, blocks, y + r * n + 8 * g, n);
    }
  });
}

// Codes of the interleaved layouts: the GGUF format's code + this (quantized_gemm_cpu.py).
constexpr int64_t kInterleaved = 1024;

// code -> run(F{}) for the interleaved layouts this kernel multiplies.
template <typename Run>
bool WithX8Format(int64_t code, Run run) {
  using xlaserve::quantized::Format;
  switch (code - kInterleaved) {
    case Format::kQ8_0: run(Q8_0x8{}); return true;
    case Format::kQ4_0: run(Q4_0x8{}); return true;
    case Format::kQ4_1: run(Q4_1x8{}); return true;
    case Format::kQ5_0: run(Q5_0x8{}); return true;
    case Format::kQ5_1: run(Q5_1x8{}); return true;
    case Format::kI8Row: run(I8Rowx8{}); return true;
    default: return false;
  }
}

// format code -> run(F{}) for the formats this kernel multiplies; false for others.
template <typename Run>
bool WithQ8Format(int64_t code, Run run) {
  using xlaserve::quantized::Format;
  switch (code) {
    case Format::kQ8_0: run(Q8_0{}); return true;
    case Format::kQ4_0: run(Q4_0{}); return true;
    case Format::kQ4_1: run(Q4_1{}); return true;
    case Format::kQ5_0: run(Q5_0{}); return true;
    case Format::kQ5_1: run(Q5_1{}); return true;
    case Format::kQ4_K: run(Q4_K{}); return true;
    case Format::kQ6_K: run(Q6_K{}); return true;
    default: return false;
  }
}

ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> rows,
                      ffi::Result<ffi::Buffer<ffi::F32>> y, int64_t format, int64_t layer) {
  const std::string name = "Q8 GEMM (CPU)";
  auto xd = x.dimensions(), yd = y->dimensions(), wd = rows.dimensions();
  if (xd.size() != 2 || yd.size() != 2 || yd[0] != xd[0])
    return ffi::Error::InvalidArgument(name + ": x [M, K], y [M, N]");
  const int64_t m = xd[0], k = xd[1], n = yd[1];
  int64_t block = 32, row_bytes = 0;  // the interleaved layouts: x in blocks of 32
  const bool interleaved = WithX8Format(format, [&](auto f) {
    row_bytes = decltype(f)::RowBytes(k);
  });
  if (!interleaved && !WithQ8Format(format, [&](auto f) {
        block = decltype(f)::kBlock;
        row_bytes = k / block * decltype(f)::kBytes;
      }))
    return ffi::Error::InvalidArgument(name + ": not a weight format it multiplies");
  if (interleaved && n % 8 != 0)
    return ffi::Error::InvalidArgument(name + ": interleaved rows come in groups of 8");
  if (k % block != 0) return ffi::Error::InvalidArgument(name + ": K is not whole blocks");
  if ((wd.size() != 2 && wd.size() != 3) || wd[wd.size() - 1] != row_bytes ||
      wd[wd.size() - 2] != n)
    return ffi::Error::InvalidArgument(name + ": rows [(L,) N, row_bytes] do not match K and N");
  const int64_t layers = wd.size() == 3 ? wd[0] : 1;
  if (layer < 0 || layer >= layers) return ffi::Error::InvalidArgument(name + ": layer");
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) {
    std::memset(y->typed_data(), 0, m * n * sizeof(float));
    return ffi::Error::Success();
  }
  const uint8_t* w = rows.typed_data() + layer * n * row_bytes;
  if (interleaved) {
    const XTiles xq = QuantizeTiles(pool, x.typed_data(), m, k);
    WithX8Format(format, [&](auto f) {
      GemmX8<decltype(f)>(pool, xq, w, row_bytes, y->typed_data(), m, n);
    });
  } else {
    const XRows xq = QuantizeRows(pool, x.typed_data(), m, k, block == 256);
    WithQ8Format(format, [&](auto f) {
      Gemm<decltype(f)>(pool, xq, w, row_bytes, y->typed_data(), m, n);
    });
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveQ8Gemm, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // rows [(L,) N, row_bytes]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Attr<int64_t>("format")
                                  .Attr<int64_t>("layer"));
