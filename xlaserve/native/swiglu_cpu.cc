// The gated MLP's activation on the CPU, as an XLA FFI custom call (swiglu_cpu.py):
//
//   XlaserveSwiglu: out[t, i] = silu(gate_up[t, 0, i]) * gate_up[t, 1, i],  silu(g) = g * sigmoid(g)
//
// gate_up is float32 [T, 2, I] (the gate_up GEMM's output); out is float32 or bfloat16 [T, I]
// (bfloat16 for the k-pair down GEMM, rounded to nearest even as XLA's convert). XLA's CPU
// backend ran this as one single-threaded loop, ~110 us per layer of a 128-row decode step; here
// the rows are spread over the pool and exp is a vector polynomial.

#include <cstdint>
#include <cstring>

#include "parallel.h"
#include "vectors.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using xlaserve::Vec16;

constexpr int64_t kRowsPerItem = 4;

template <typename O>
void SwigluRow(const float* gate, const float* up, O* out, int64_t width) {
  int64_t i = 0;
  for (; i + 16 <= width; i += 16) {
    xlaserve::StoreAs(out + i, xlaserve::Silu(xlaserve::Load16(gate + i)) * xlaserve::Load16(up + i));
  }
  if (i < width) {  // the tail through a zero-padded vector
    float g[16] = {}, u[16] = {}, o[16];
    std::memcpy(g, gate + i, (width - i) * sizeof(float));
    std::memcpy(u, up + i, (width - i) * sizeof(float));
    SwigluRow(g, u, o, 16);
    for (int64_t j = 0; j < width - i; ++j) xlaserve::StoreAs(out + i + j, o[j]);
  }
}

ffi::Error SwigluImpl(ffi::ThreadPool pool, ffi::AnyBuffer gate_up, ffi::Result<ffi::AnyBuffer> out) {
  auto gd = gate_up.dimensions(), od = out->dimensions();
  if (gate_up.element_type() != ffi::F32 || gd.size() != 3 || gd[1] != 2)
    return ffi::Error::InvalidArgument("SwiGLU (CPU): gate_up is float32 [T, 2, I]");
  if ((out->element_type() != ffi::F32 && out->element_type() != ffi::BF16) || od.size() != 2 ||
      od[0] != gd[0] || od[1] != gd[2])
    return ffi::Error::InvalidArgument("SwiGLU (CPU): out is float32 or bfloat16 [T, I]");
  const int64_t rows = gd[0], width = gd[2];
  const float* in = static_cast<const float*>(gate_up.untyped_data());
  const bool bf16 = out->element_type() == ffi::BF16;
  void* dst = out->untyped_data();
  xlaserve::ParallelFor(pool, (rows + kRowsPerItem - 1) / kRowsPerItem, [&](int64_t item) {
    const int64_t end = std::min(rows, (item + 1) * kRowsPerItem);
    for (int64_t t = item * kRowsPerItem; t < end; ++t) {
      const float* gate = in + t * 2 * width;
      if (bf16) {
        SwigluRow(gate, gate + width, static_cast<uint16_t*>(dst) + t * width, width);
      } else {
        SwigluRow(gate, gate + width, static_cast<float*>(dst) + t * width, width);
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveSwiglu, SwigluImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()    // gate_up [T, 2, I] f32
                                  .Ret<ffi::AnyBuffer>());  // out [T, I] f32 or bf16
