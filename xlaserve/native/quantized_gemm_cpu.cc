// y[M, N] = x[M, K] @ W^T on the CPU with W kept in a quantized format (GGUF's Q8_0, Q4_0, Q4_1,
// Q5_0, Q5_1, Q4_K, Q6_K blocks, or our i8_row; quantized_blocks.h), as XLA FFI custom calls
// (quantized_gemm_cpu.py); and W[ids], the rows an embedding lookup reads.
//
// W is `rows` [N, row_bytes], row n the K weights of output n as the file stores them, or a stack
// [L, N, row_bytes] of which `layer` is read (no copy).
//
// Weight-only: x stays float32 and every product is x * w for w the dequantized weight, bit for
// bit gguf.quants.dequantize's, summed in float32; only the summation order differs from
// x @ dequantize(W).T. (llama.cpp instead rounds x to 8 bits and multiplies integers, faster but
// other numerics: q8_gemm_cpu.cc, the default for GGUF files; this one is --quantized-activations
// float32, and --quantization int8's.)
//
// Three ways through W, by the rows of x (M):
// - a few rows (decode steps, M <= kStreamRows): each block of W is decoded into vector registers
//   and multiplied into accumulators right away (StreamTile): a stream over the blocks, at the
//   speed of reading and decoding them (one row: 1.3-1.6x faster than decoding into the buffer
//   below and reading it back);
// - more rows: a thread decodes a group of kGroupRows rows of W, a chunk of K (at most kMaxDepth
//   weights) at a time, into float32 in an L1 buffer, then every row of x's row block (up to
//   kRowBlock) runs over it in register tiles (DotTile): the decode is paid once per row block,
//   and the tiles run at the speed of float32 multiply-adds;
// - many rows (M >= kPanelRows): W decoded into the packed GEMM's float32 panels, one at a time,
//   and multiplied by its register tiles (quantized_panels.h).
// In the first two an accumulator is a vector of lanes along k (a dot product, summed across
// lanes at the end of the chunk or row).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "parallel.h"
#include "quantized_blocks.h"
#include "quantized_panels.h"
#include "vectors.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace xlaserve::quantized;

// AVX-512: 4 x 4 accumulators, 16 of the 32 vector registers, 8 more for the tile's x and W
// vectors. 16 registers (AVX2; ARM's NEON pairs): 4 x 2, and streams of 2 rows by 4.
// K per chunk (kMaxDepth): the group's 8 rows decoded stay in L1 (32 KB of the 48 KB of the
// Xeon measured; with 512, 4x4 tiles summed their lanes twice as often and ran 10-30% slower).
// Elsewhere (not measured) 512, half of a 32 KB L1.
#ifdef __AVX512F__
constexpr int kTileCols = 4, kStreamRows = 4;
constexpr int64_t kMaxDepth = 1024;
#else
constexpr int kTileCols = 2, kStreamRows = 2;
constexpr int64_t kMaxDepth = 512;
#endif
constexpr int kTileRows = 4, kStreamCols = 4;
constexpr int64_t kGroupRows = 8;  // rows of W decoded together, a multiple of kTileCols
constexpr int64_t kRowBlock = 96;   // rows of x per pass: their K chunk stays in L2
// x up to this size (in floats: 1 MB) is read from L2 by every group, so threads take groups
// one by one, each group's rows one stream; above it, threads take runs of groups, over which
// x's row block and K chunk stay in cache.
constexpr int64_t kSmallX = 256 * 1024;
// From this many rows of x, the panels of quantized_panels.h. Their decode costs more per weight
// (a transpose): on a 2-core AVX-512 Xeon they ran at 0.55-0.9x the groups' speed at M = 8-16,
// 0.9-1.14x at 32, 1.14-1.27x at 64 and 1.9x at 256 (K x N 576x1536 and 2048x8192). Built for
// AVX2 (on the same Xeon; elsewhere not measured) the groups' 4 x 2 tiles are slower: panels ran
// 1.1-1.5x faster from M = 5, 1.9-2.2x at 64.
#ifdef __AVX512F__
constexpr int64_t kPanelRows = 32;
#else
constexpr int64_t kPanelRows = 5;
#endif

inline float SumLanes(Vec v) {
#ifdef __AVX512F__
  return xlaserve::Sum16(v);
#else
  typedef float Vec4 __attribute__((vector_size(16)));
  const Vec4 quarter = __builtin_shufflevector(v, v, 0, 1, 2, 3) +
                       __builtin_shufflevector(v, v, 4, 5, 6, 7);
  return (quarter[0] + quarter[2]) + (quarter[1] + quarter[3]);
#endif
}

// kLanes vectors -> one whose lane i is the sum of v[i]'s lanes: halving steps that each add two
// vectors' halves side by side, kLanes - 1 of them, 3 instructions each. Summing each vector
// apart took ~10 instructions a vector: 4x4 tiles spent 1/3 of their time there.
inline Vec SumEach(const Vec (&v)[kLanes]) {
#ifdef __AVX512F__
  Vec halves[8], quarters[4], eighths[2];
  for (int i = 0; i < 8; ++i)
    halves[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                        19, 20, 21, 22, 23) +
                __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24,
                                        25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    quarters[i] = __builtin_shufflevector(halves[2 * i], halves[2 * i + 1], 0, 1, 2, 3, 8, 9, 10,
                                          11, 16, 17, 18, 19, 24, 25, 26, 27) +
                  __builtin_shufflevector(halves[2 * i], halves[2 * i + 1], 4, 5, 6, 7, 12, 13, 14,
                                          15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    eighths[i] = __builtin_shufflevector(quarters[2 * i], quarters[2 * i + 1], 0, 1, 4, 5, 8, 9,
                                         12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
                 __builtin_shufflevector(quarters[2 * i], quarters[2 * i + 1], 2, 3, 6, 7, 10, 11,
                                         14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(eighths[0], eighths[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20,
                                 22, 24, 26, 28, 30) +
         __builtin_shufflevector(eighths[0], eighths[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21,
                                 23, 25, 27, 29, 31);
#else
  Vec halves[4], quarters[2];
  for (int i = 0; i < 4; ++i)
    halves[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
                __builtin_shufflevector(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)
    quarters[i] =
        __builtin_shufflevector(halves[2 * i], halves[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
        __builtin_shufflevector(halves[2 * i], halves[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(quarters[0], quarters[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(quarters[0], quarters[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

// sums[r][c] = the sum of acc[r][c]'s lanes.
template <int R, int C>
inline void SumTile(const Vec (&acc)[R][C], float (&sums)[R][C]) {
  if constexpr (R * C == kLanes) {
    Vec each[kLanes];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) each[r * C + c] = acc[r][c];
    const Vec total = SumEach(each);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) sums[r][c] = total[r * C + c];
  } else {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) sums[r][c] = SumLanes(acc[r][c]);
  }
}

// y[r, c] (= or +=) x[r, :depth] . w[c, :depth] for r < R, c < C: x rows ldx apart, the decoded
// W rows ldw apart, y rows ldy apart. The small tiles at the ends of x's rows and of a group keep
// kSplit accumulators per product, summing alternate vectors, so that at least 8 multiply-adds
// are in flight: a 1 x 4 tile waited on the 4-cycle latency of its 4 chains (1 a cycle of 2).
template <int R, int C>
inline void DotTile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t depth,
                    float* y, int64_t ldy, bool accumulate) {
  constexpr int kSplit = R * C >= 8 ? 1 : R * C >= 4 ? 2 : 4;
  Vec acc[kSplit][R][C] = {};
  const int64_t vectors = depth / kLanes * kLanes;  // an i8_row K may end in a part vector
  int64_t d = 0;
  auto step = [&](Vec(&sums)[R][C], int64_t at) XLASERVE_INLINE_LAMBDA {
    Vec wv[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) wv[c] = Load(w + c * ldw + at);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const Vec xv = Load(x + r * ldx + at);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) sums[r][c] += xv * wv[c];
    }
  };
  for (; d + kSplit * kLanes <= vectors; d += kSplit * kLanes) {
#pragma GCC unroll 4
    for (int s = 0; s < kSplit; ++s) step(acc[s], d + s * kLanes);
  }
  for (; d < vectors; d += kLanes) step(acc[0], d);
  for (int s = 1; s < kSplit; ++s)
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[0][r][c] += acc[s][r][c];
  float sums[R][C];
  SumTile(acc[0], sums);
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      for (int64_t e = vectors; e < depth; ++e) sums[r][c] += x[r * ldx + e] * w[c * ldw + e];
      float& out = y[r * ldy + c];
      out = accumulate ? out + sums[r][c] : sums[r][c];
    }
  }
}

// y[rows, cols] (= or +=) x[rows, :depth] . w[cols, :depth]^T.
void Tiles(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t depth, float* y,
           int64_t ldy, int64_t rows, int64_t cols, bool accumulate) {
  ForTiles<kTileRows, kTileCols>(rows, cols, [&](auto tile_rows, auto tile_cols, int64_t r,
                                                 int64_t c) {
    DotTile<tile_rows, tile_cols>(x + r * ldx, ldx, w + c * ldw, ldw, depth, y + r * ldy + c, ldy,
                                  accumulate);
  });
}

// y[r, c] = x[r, :k] . W[c, :k] for r < R, c < C, W's rows (row_bytes apart) decoded step by step
// straight into the multiply-adds.
template <typename F, int R, int C>
inline void StreamTile(const float* x, int64_t ldx, const uint8_t* w, int64_t row_bytes,
                       int64_t k, float* y, int64_t ldy) {
  Vec acc[R][C] = {};
  const int64_t steps = k / kStep<F> * kStep<F>;  // all of K but the end of an i8_row K
  for (int64_t e = 0; e < steps; e += kStep<F>) {
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      DecodeStep<F>(w + c * row_bytes, e, [&](int i, Vec wv) XLASERVE_INLINE_LAMBDA {
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) acc[r][c] += Load(x + r * ldx + e + i) * wv;
      });
    }
  }
  float sums[R][C];
  SumTile(acc, sums);
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      if constexpr (kIsI8Row<F>) {
        for (int64_t e = steps; e < k; ++e)
          sums[r][c] += x[r * ldx + e] * I8Row::Weight(w + c * row_bytes, e);
      }
      y[r * ldy + c] = sums[r][c];
    }
  }
}

struct Problem {
  const float* x;
  const uint8_t* w;  // the layer's first row
  float* y;
  int64_t m, k, n, row_bytes;
  int64_t chunk;  // K per decoded chunk: whole blocks, at most kMaxDepth
};

// y[:, the rows of W in groups [first, last)) for every row of x.
template <typename F>
void GroupRange(const Problem& p, int64_t first, int64_t last) {
  alignas(64) float decoded[kGroupRows * kMaxDepth];
  for (int64_t r0 = 0; r0 < p.m; r0 += kRowBlock) {
    const int64_t rows = std::min(kRowBlock, p.m - r0);
    for (int64_t k0 = 0; k0 < p.k; k0 += p.chunk) {
      const int64_t depth = std::min(p.chunk, p.k - k0);
      for (int64_t g = first; g < last; ++g) {
        const int64_t n0 = g * kGroupRows, cols = std::min(kGroupRows, p.n - n0);
        for (int64_t c = 0; c < cols; ++c)
          DecodeRange<F>(p.w + (n0 + c) * p.row_bytes, k0, depth, decoded + c * p.chunk);
        Tiles(p.x + r0 * p.k + k0, p.k, decoded, p.chunk, depth, p.y + r0 * p.n + n0, p.n, rows,
              cols, k0 > 0);
      }
    }
  }
}

// y[:, the rows of W in groups [first, last)) for the few rows of x, streaming the groups' rows.
template <typename F>
void StreamGroups(const Problem& p, int64_t first, int64_t last) {
  for (int64_t g = first; g < last; ++g) {
    const int64_t n0 = g * kGroupRows, cols = std::min(kGroupRows, p.n - n0);
    ForTiles<kStreamRows, kStreamCols>(p.m, cols, [&](auto rows, auto tile_cols, int64_t r,
                                                      int64_t c) {
      StreamTile<F, rows, tile_cols>(p.x + r * p.k, p.k, p.w + (n0 + c) * p.row_bytes, p.row_bytes,
                                     p.k, p.y + r * p.n + n0 + c, p.n);
    });
  }
}

template <typename F>
void Gemm(ffi::ThreadPool& pool, const Problem& p) {
  const int64_t groups = (p.n + kGroupRows - 1) / kGroupRows;
  if (p.m <= kStreamRows) {
    xlaserve::ParallelFor(pool, groups, [&](int64_t g) { StreamGroups<F>(p, g, g + 1); });
    return;
  }
  if (p.m >= kPanelRows) {
    PanelGemm<F>(pool, p.x, p.w, p.y, p.m, p.k, p.n, p.row_bytes);
    return;
  }
  int64_t run = 1;
  if (p.m * p.k > kSmallX) {
    const int64_t parts = std::min<int64_t>(groups, 4 * std::max<int64_t>(pool.num_threads(), 1));
    run = (groups + parts - 1) / parts;
  }
  xlaserve::ParallelFor(pool, (groups + run - 1) / run, [&](int64_t part) {
    GroupRange<F>(p, part * run, std::min(groups, part * run + run));
  });
}

// The weights' operand checked against the format, K and the layer. Messages name the custom
// call; the Python wrapper checks the same with clearer words first.
struct Weights {
  const uint8_t* data;  // the layer's first row
  int64_t n, row_bytes;
};

ffi::Error CheckWeights(const char* what, const ffi::Buffer<ffi::U8>& rows, int64_t format,
                        int64_t k, int64_t layer, Weights& out) {
  int64_t expected = -1, block = 1;
  WithFormat(format, [&](auto f) {
    using F = decltype(f);
    expected = RowBytes<F>(k);
    block = F::kBlock;
  });
  const std::string name(what);
  if (expected < 0) return ffi::Error::InvalidArgument(name + ": unknown weight format");
  if (k % block != 0)
    return ffi::Error::InvalidArgument(name + ": K is not a whole number of blocks");
  auto dims = rows.dimensions();
  if (dims.size() != 2 && dims.size() != 3)
    return ffi::Error::InvalidArgument(name + ": rows [(L,) N, row_bytes]");
  if (dims[dims.size() - 1] != expected)
    return ffi::Error::InvalidArgument(name + ": row_bytes does not match the format and K");
  const int64_t layers = dims.size() == 3 ? dims[0] : 1;
  if (layer < 0 || layer >= layers)
    return ffi::Error::InvalidArgument(name + ": layer out of range");
  out.n = dims[dims.size() - 2];
  out.row_bytes = expected;
  out.data = rows.typed_data() + layer * out.n * expected;
  return ffi::Error::Success();
}

ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> rows,
                      ffi::Result<ffi::Buffer<ffi::F32>> y, int64_t format, int64_t layer) {
  auto xd = x.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || yd[0] != xd[0])
    return ffi::Error::InvalidArgument("quantized GEMM (CPU): x [M, K], y [M, N]");
  Weights w;
  if (auto error = CheckWeights("quantized GEMM (CPU)", rows, format, xd[1], layer, w);
      error.failure())
    return error;
  if (w.n != yd[1]) return ffi::Error::InvalidArgument("quantized GEMM (CPU): N does not match");
  Problem p{x.typed_data(), w.data, y->typed_data(), xd[0], xd[1], w.n, w.row_bytes, 0};
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  if (p.k == 0) {
    std::memset(p.y, 0, p.m * p.n * sizeof(float));
    return ffi::Error::Success();
  }
  WithFormat(format, [&](auto f) {
    using F = decltype(f);
    p.chunk = DepthBlock<F>(p.k, kMaxDepth);
    Gemm<F>(pool, p);
  });
  return ffi::Error::Success();
}

// out[t] = W[ids[t]], dequantized: ids below 0 count from the end and the rest are clamped to
// [0, N), as jnp's indexing does.
ffi::Error RowsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> rows, ffi::Buffer<ffi::S32> ids,
                    ffi::Result<ffi::Buffer<ffi::F32>> out, int64_t format, int64_t layer) {
  auto od = out->dimensions();
  if (od.size() != 2 || ids.dimensions().size() != 1 || ids.dimensions()[0] != od[0])
    return ffi::Error::InvalidArgument("quantized rows (CPU): ids [T], out [T, K]");
  const int64_t count = od[0], k = od[1];
  Weights w;
  if (auto error = CheckWeights("quantized rows (CPU)", rows, format, k, layer, w); error.failure())
    return error;
  if (count == 0 || k == 0) return ffi::Error::Success();
  if (w.n == 0) return ffi::Error::InvalidArgument("quantized rows (CPU): no rows to index");
  constexpr int64_t kIdsPerItem = 8;
  const int32_t* id = ids.typed_data();
  float* values = out->typed_data();
  WithFormat(format, [&](auto f) {
    using F = decltype(f);
    xlaserve::ParallelFor(pool, (count + kIdsPerItem - 1) / kIdsPerItem, [&](int64_t item) {
      for (int64_t t = item * kIdsPerItem; t < std::min(count, item * kIdsPerItem + kIdsPerItem);
           ++t) {
        const int64_t row = std::clamp<int64_t>(id[t] < 0 ? id[t] + w.n : id[t], 0, w.n - 1);
        DecodeRange<F>(w.data + row * w.row_bytes, 0, k, values + t * k);
      }
    });
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveQuantizedGemm, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // rows [(L,) N, row_bytes]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Attr<int64_t>("format")
                                  .Attr<int64_t>("layer"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveQuantizedRows, RowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()   // rows [(L,) N, row_bytes]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ids [T]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [T, K]
                                  .Attr<int64_t>("format")
                                  .Attr<int64_t>("layer"));
