// y[M, N] = x[M, K] @ W for a few rows M (decode steps), as an XLA FFI custom call (matmul_cpu.py).
//
// W is [K, N] (or [N, K] with `transposed`: the tied embedding as the LM head), float32 or
// bfloat16; x and y are float32 and the sums are float32. A step of a few rows is a stream over
// the weights: XLA's CPU dot ran it on one thread (21 GB/s of float32 weights for the default
// model) and with bfloat16 weights fell off its fast path altogether (a 1-row step 7x slower than
// float32). Here the weights are read once, front to back, by every thread of XLA's pool, each
// over its own columns (or rows, transposed), and bfloat16 weights are widened in registers.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using xlaserve::Load16;
using xlaserve::Store16;
using xlaserve::Sum16;
using xlaserve::Vec16;

namespace {

constexpr int64_t kMaxRows = 16;
constexpr int64_t kMaxCachedOutputs = 32768;  // M x N floats: 128 KiB of accumulators per block

inline float LoadScalar(const float* w) { return *w; }
inline float LoadScalar(const uint16_t* w) { return xlaserve::Bf16ToF32(*w); }

// acc[M, width] += x[:, rows] @ W[rows, begin:end] for W [K, N] row-major: stream W's rows over
// the column range and add each into the M accumulator rows, 64 columns at a time.
template <typename T>
void AddRows(const float* x, const T* w, float* acc, int64_t m, int64_t k, int64_t n,
             int64_t first_row, int64_t last_row, int64_t begin, int64_t end) {
  const int64_t width = end - begin, vec_end = begin + (width / 16) * 16;
  for (int64_t i = first_row; i < last_row; ++i) {
    const T* row = w + i * n;
    int64_t c = begin;
    for (; c + 64 <= vec_end; c += 64) {
      const Vec16 w0 = Load16(row + c), w1 = Load16(row + c + 16), w2 = Load16(row + c + 32),
                  w3 = Load16(row + c + 48);
      for (int64_t r = 0; r < m; ++r) {
        const float xr = x[r * k + i];
        float* a = acc + r * width + (c - begin);
        Store16(a, Load16(a) + xr * w0);
        Store16(a + 16, Load16(a + 16) + xr * w1);
        Store16(a + 32, Load16(a + 32) + xr * w2);
        Store16(a + 48, Load16(a + 48) + xr * w3);
      }
    }
    for (; c + 16 <= vec_end; c += 16) {
      const Vec16 w0 = Load16(row + c);
      for (int64_t r = 0; r < m; ++r) {
        float* a = acc + r * width + (c - begin);
        Store16(a, Load16(a) + x[r * k + i] * w0);
      }
    }
    for (; c < end; ++c)
      for (int64_t r = 0; r < m; ++r) acc[r * width + (c - begin)] += x[r * k + i] * LoadScalar(row + c);
  }
}

// Rows [begin, end) of W [N, K] (columns of y = x @ W^T): one dot per (row of x, row of W), every
// row of x sharing each loaded chunk of W.
template <typename T>
void RowRange(const float* x, const T* w, float* y, int64_t m, int64_t k, int64_t n,
              int64_t begin, int64_t end) {
  const int64_t vec_k = (k / 16) * 16;
  for (int64_t j = begin; j < end; ++j) {
    const T* row = w + j * k;
    Vec16 acc[kMaxRows] = {};
    for (int64_t i = 0; i < vec_k; i += 16) {
      const Vec16 wi = Load16(row + i);
      for (int64_t r = 0; r < m; ++r) acc[r] += Load16(x + r * k + i) * wi;
    }
    for (int64_t r = 0; r < m; ++r) {
      float sum = Sum16(acc[r]);
      for (int64_t i = vec_k; i < k; ++i) sum += x[r * k + i] * LoadScalar(row + i);
      y[r * n + j] = sum;
    }
  }
}

// Work is cut so that every thread streams long contiguous runs of W: blocks of whole rows of W
// (partial sums per block, added up at the end) while the accumulators of a whole row stay in
// cache; for wide W (a big untied LM head), column ranges of every row instead. Column ranges of a
// narrow W read it in short strided pieces, at half the bandwidth.
template <typename T>
void Run(ffi::ThreadPool& pool, const float* x, const T* w, float* y, int64_t m, int64_t k,
         int64_t n, bool transposed) {
  const int64_t parts = 4 * std::max<int64_t>(pool.num_threads(), 1);
  if (transposed) {
    const int64_t chunk = (n + parts - 1) / parts;
    xlaserve::ParallelFor(pool, (n + chunk - 1) / chunk, [&](int64_t i) {
      RowRange<T>(x, w, y, m, k, n, i * chunk, std::min(n, (i + 1) * chunk));
    });
  } else if (m * n <= kMaxCachedOutputs) {
    const int64_t chunk = (k + parts - 1) / parts, blocks = (k + chunk - 1) / chunk;
    std::vector<float> partial(blocks * m * n, 0.0f);
    xlaserve::ParallelFor(pool, blocks, [&](int64_t i) {
      AddRows<T>(x, w, partial.data() + i * m * n, m, k, n, i * chunk, std::min(k, (i + 1) * chunk),
                 0, n);
    });
    for (int64_t j = 0; j < m * n; ++j) {
      float sum = 0.0f;
      for (int64_t b = 0; b < blocks; ++b) sum += partial[b * m * n + j];
      y[j] = sum;
    }
  } else {
    int64_t chunk = (n + parts - 1) / parts;
    chunk = (chunk + 63) / 64 * 64;
    xlaserve::ParallelFor(pool, (n + chunk - 1) / chunk, [&](int64_t i) {
      const int64_t begin = i * chunk, end = std::min(n, begin + chunk);
      std::vector<float> acc(m * (end - begin), 0.0f);
      AddRows<T>(x, w, acc.data(), m, k, n, 0, k, begin, end);
      for (int64_t r = 0; r < m; ++r)
        std::memcpy(y + r * n + begin, acc.data() + r * (end - begin), (end - begin) * sizeof(float));
    });
  }
}

ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                      ffi::Result<ffi::Buffer<ffi::F32>> y, bool transposed) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2)
    return ffi::Error::InvalidArgument("few-row matmul (CPU): x and W must be 2-d");
  const int64_t m = xd[0], k = xd[1], n = transposed ? wd[0] : wd[1];
  if ((transposed ? wd[1] : wd[0]) != k || m > kMaxRows)
    return ffi::Error::InvalidArgument("few-row matmul (CPU): bad shapes");
  if (w.element_type() == ffi::F32)
    Run<float>(pool, x.typed_data(), static_cast<const float*>(w.untyped_data()),
               y->typed_data(), m, k, n, transposed);
  else if (w.element_type() == ffi::BF16)
    Run<uint16_t>(pool, x.typed_data(), static_cast<const uint16_t*>(w.untyped_data()),
                  y->typed_data(), m, k, n, transposed);
  else
    return ffi::Error::InvalidArgument("few-row matmul (CPU): float32 or bfloat16 weights");
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveFewRowMatmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::AnyBuffer>()         // W [K, N] or [N, K]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Attr<bool>("transposed"));
