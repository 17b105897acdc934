// RMSNorm over the rows of the residual stream on the CPU, with the residual add before it, as XLA
// FFI custom calls (norm_cpu.py):
//
//   XlaserveRmsNorm:     normed = scale * x / sqrt(mean(x^2) + eps)
//   XlaserveAddRmsNorm:  sum = x + delta;  normed = scale * sum / sqrt(mean(sum^2) + eps)
//
// x, delta and sum are float32 [T, H]; scale is float32 or bfloat16 [H]; normed is float32 or
// bfloat16 [T, H] (bfloat16 is what the next GEMM multiplies with VDPBF16PS, rounded to nearest
// even as XLA's convert). XLA's CPU backend ran each of these as three to four kernels on one
// thread (the add, a YNNPACK sum of squares, the rsqrt, the scaling and rounding), about 90 us
// per norm of a 128-row decode step; here it is one pass over the rows, spread over the pool.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "parallel.h"
#include "vectors.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kRowsPerItem = 8;  // rows of one work item: a hand-off costs several rows' work

using xlaserve::Vec16;
struct Norm {
  const float* x;
  const float* delta;  // nullptr: no add
  const void* scale;
  bool scale_bf16;
  float* sum;  // nullptr: no add
  void* normed;
  bool normed_bf16;
  int64_t hidden;
  float eps;
};

// normed[row] = scale * x[row] * inv_rms, for a scale and an output of types S and O.
template <typename S, typename O>
void ScaleRow(const float* x, const S* scale, float inv_rms, O* out, int64_t h) {
  int64_t i = 0;
  for (; i + 16 <= h; i += 16) {
    xlaserve::StoreAs(out + i, xlaserve::Load16(scale + i) * (xlaserve::Load16(x + i) * inv_rms));
  }
  for (; i < h; ++i) {
    float s;
    if constexpr (std::is_same_v<S, float>) {
      s = scale[i];
    } else {
      s = xlaserve::Bf16ToF32(scale[i]);
    }
    xlaserve::StoreAs(out + i, s * (x[i] * inv_rms));
  }
}

void NormRow(const Norm& n, int64_t row) {
  const int64_t h = n.hidden;
  const float* x = n.x + row * h;
  if (n.delta != nullptr) {  // the row of the sum is written first, then read back from L1
    const float* delta = n.delta + row * h;
    float* sum = n.sum + row * h;
#pragma omp simd
    for (int64_t i = 0; i < h; ++i) sum[i] = x[i] + delta[i];
    x = sum;
  }
  Vec16 squares = {};
  int64_t i = 0;
  for (; i + 16 <= h; i += 16) {
    const Vec16 v = xlaserve::Load16(x + i);
    squares += v * v;
  }
  float total = xlaserve::Sum16(squares);
  for (; i < h; ++i) total += x[i] * x[i];
  const float inv_rms = 1.0f / std::sqrt(total / static_cast<float>(h) + n.eps);
  const uint16_t* scale16 = static_cast<const uint16_t*>(n.scale);
  const float* scale32 = static_cast<const float*>(n.scale);
  if (n.normed_bf16) {
    uint16_t* out = static_cast<uint16_t*>(n.normed) + row * h;
    n.scale_bf16 ? ScaleRow(x, scale16, inv_rms, out, h) : ScaleRow(x, scale32, inv_rms, out, h);
  } else {
    float* out = static_cast<float*>(n.normed) + row * h;
    n.scale_bf16 ? ScaleRow(x, scale16, inv_rms, out, h) : ScaleRow(x, scale32, inv_rms, out, h);
  }
}

ffi::Error Run(ffi::ThreadPool& pool, Norm& n, ffi::AnyBuffer x, ffi::AnyBuffer scale,
               ffi::Result<ffi::AnyBuffer>& normed) {
  auto xd = x.dimensions();
  if (x.element_type() != ffi::F32 || xd.size() != 2)
    return ffi::Error::InvalidArgument("RMSNorm (CPU): x is float32 [T, H]");
  if ((scale.element_type() != ffi::F32 && scale.element_type() != ffi::BF16) ||
      scale.dimensions().size() != 1 || scale.dimensions()[0] != xd[1])
    return ffi::Error::InvalidArgument("RMSNorm (CPU): scale is float32 or bfloat16 [H]");
  if (normed->element_type() != ffi::F32 && normed->element_type() != ffi::BF16)
    return ffi::Error::InvalidArgument("RMSNorm (CPU): the output is float32 or bfloat16");
  n.x = static_cast<const float*>(x.untyped_data());
  n.scale = scale.untyped_data();
  n.scale_bf16 = scale.element_type() == ffi::BF16;
  n.normed = normed->untyped_data();
  n.normed_bf16 = normed->element_type() == ffi::BF16;
  n.hidden = xd[1];
  const int64_t rows = xd[0];
  if (rows == 0 || n.hidden == 0) return ffi::Error::Success();
  xlaserve::ParallelFor(pool, (rows + kRowsPerItem - 1) / kRowsPerItem, [&](int64_t item) {
    const int64_t end = std::min(rows, (item + 1) * kRowsPerItem);
    for (int64_t row = item * kRowsPerItem; row < end; ++row) NormRow(n, row);
  });
  return ffi::Error::Success();
}

ffi::Error RmsNormImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer scale,
                       ffi::Result<ffi::AnyBuffer> normed, float eps) {
  Norm n{};
  n.eps = eps;
  return Run(pool, n, x, scale, normed);
}

ffi::Error AddRmsNormImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer delta,
                          ffi::AnyBuffer scale, ffi::Result<ffi::AnyBuffer> sum,
                          ffi::Result<ffi::AnyBuffer> normed, float eps) {
  if (delta.element_type() != ffi::F32 || sum->element_type() != ffi::F32 ||
      delta.element_count() != x.element_count() || sum->element_count() != x.element_count())
    return ffi::Error::InvalidArgument("RMSNorm (CPU): delta and the sum are float32 like x");
  Norm n{};
  n.eps = eps;
  n.delta = static_cast<const float*>(delta.untyped_data());
  n.sum = static_cast<float*>(sum->untyped_data());
  return Run(pool, n, x, scale, normed);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveRmsNorm, RmsNormImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [T, H] f32
                                  .Arg<ffi::AnyBuffer>()  // scale [H]
                                  .Ret<ffi::AnyBuffer>()  // normed [T, H]
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveAddRmsNorm, AddRmsNormImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [T, H] f32
                                  .Arg<ffi::AnyBuffer>()  // delta [T, H] f32
                                  .Arg<ffi::AnyBuffer>()  // scale [H]
                                  .Ret<ffi::AnyBuffer>()  // x + delta [T, H] f32
                                  .Ret<ffi::AnyBuffer>()  // normed [T, H]
                                  .Attr<float>("eps"));
