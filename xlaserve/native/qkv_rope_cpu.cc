// The attention's inputs from the fused qkv projection on the CPU, as an XLA FFI custom call
// (qkv_rope_cpu.py):
//
//   XlaserveQkvRope: qkv [T, kv_heads, group + 2, D] float32, cos / sin [T, D/2] float32
//     -> q [T, kv_heads * group, D], k [T, kv_heads, D] with rotate-half RoPE, v [T, kv_heads, D]
//
// in the cache's dtype (float32, or bfloat16 rounded to nearest even as XLA's convert). XLA's
// CPU backend ran this as four or five single-threaded fusions per layer (the slices, RoPE of q
// and of k as concatenations, the converts); here it is one pass over the tokens on the pool.

#include <cstdint>
#include <cstring>

#include "parallel.h"
#include "vectors.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using xlaserve::Vec16;

constexpr int64_t kTokensPerItem = 4;

// dst = x rotated by the token's angles: [x1 cos - x2 sin, x2 cos + x1 sin] (halves of x).
template <typename O>
void Rope(const float* x, const float* cos, const float* sin, O* dst, int64_t half) {
  int64_t i = 0;
  for (; i + 16 <= half; i += 16) {
    const Vec16 x1 = xlaserve::Load16(x + i), x2 = xlaserve::Load16(x + half + i);
    const Vec16 c = xlaserve::Load16(cos + i), s = xlaserve::Load16(sin + i);
    xlaserve::StoreAs(dst + i, x1 * c - x2 * s);
    xlaserve::StoreAs(dst + half + i, x2 * c + x1 * s);
  }
  for (; i < half; ++i) {
    xlaserve::StoreAs(dst + i, x[i] * cos[i] - x[half + i] * sin[i]);
    xlaserve::StoreAs(dst + half + i, x[half + i] * cos[i] + x[i] * sin[i]);
  }
}

template <typename O>
void Copy(const float* x, O* dst, int64_t d) {
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) xlaserve::StoreAs(dst + i, xlaserve::Load16(x + i));
  for (; i < d; ++i) xlaserve::StoreAs(dst + i, x[i]);
}

template <typename O>
void Token(const float* qkv, const float* cos, const float* sin, O* q, O* k, O* v, int64_t t,
           int64_t kv_heads, int64_t group, int64_t d) {
  const int64_t half = d / 2;
  const float* angles_cos = cos + t * half;
  const float* angles_sin = sin + t * half;
  for (int64_t h = 0; h < kv_heads; ++h) {
    const float* head = qkv + ((t * kv_heads + h) * (group + 2)) * d;
    for (int64_t j = 0; j < group; ++j)
      Rope(head + j * d, angles_cos, angles_sin, q + ((t * kv_heads + h) * group + j) * d, half);
    Rope(head + group * d, angles_cos, angles_sin, k + (t * kv_heads + h) * d, half);
    Copy(head + (group + 1) * d, v + (t * kv_heads + h) * d, d);
  }
}

ffi::Error QkvRopeImpl(ffi::ThreadPool pool, ffi::AnyBuffer qkv, ffi::AnyBuffer cos,
                       ffi::AnyBuffer sin, ffi::Result<ffi::AnyBuffer> q,
                       ffi::Result<ffi::AnyBuffer> k, ffi::Result<ffi::AnyBuffer> v) {
  auto xd = qkv.dimensions();
  if (qkv.element_type() != ffi::F32 || xd.size() != 4 || xd[2] < 3 || xd[3] % 2 != 0)
    return ffi::Error::InvalidArgument("QKV RoPE (CPU): qkv is float32 [T, kv_heads, group + 2, D], D even");
  const int64_t tokens = xd[0], kv_heads = xd[1], group = xd[2] - 2, d = xd[3];
  const size_t angles = static_cast<size_t>(tokens * (d / 2));
  if (cos.element_type() != ffi::F32 || sin.element_type() != ffi::F32 ||
      cos.element_count() != angles || sin.element_count() != angles)
    return ffi::Error::InvalidArgument("QKV RoPE (CPU): cos and sin are float32 [T, D/2]");
  const auto dtype = q->element_type();
  if ((dtype != ffi::F32 && dtype != ffi::BF16) || k->element_type() != dtype ||
      v->element_type() != dtype ||
      q->element_count() != static_cast<size_t>(tokens * kv_heads * group * d) ||
      k->element_count() != static_cast<size_t>(tokens * kv_heads * d) ||
      v->element_count() != static_cast<size_t>(tokens * kv_heads * d))
    return ffi::Error::InvalidArgument("QKV RoPE (CPU): q, k, v are [T, heads, D] of one dtype");
  const float* x = static_cast<const float*>(qkv.untyped_data());
  const float* c = static_cast<const float*>(cos.untyped_data());
  const float* s = static_cast<const float*>(sin.untyped_data());
  xlaserve::ParallelFor(pool, (tokens + kTokensPerItem - 1) / kTokensPerItem, [&](int64_t item) {
    const int64_t end = std::min(tokens, (item + 1) * kTokensPerItem);
    for (int64_t t = item * kTokensPerItem; t < end; ++t) {
      if (dtype == ffi::BF16) {
        Token(x, c, s, static_cast<uint16_t*>(q->untyped_data()),
              static_cast<uint16_t*>(k->untyped_data()), static_cast<uint16_t*>(v->untyped_data()),
              t, kv_heads, group, d);
      } else {
        Token(x, c, s, static_cast<float*>(q->untyped_data()),
              static_cast<float*>(k->untyped_data()), static_cast<float*>(v->untyped_data()), t,
              kv_heads, group, d);
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveQkvRope, QkvRopeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()   // qkv [T, kv_heads, group + 2, D] f32
                                  .Arg<ffi::AnyBuffer>()   // cos [T, D/2] f32
                                  .Arg<ffi::AnyBuffer>()   // sin [T, D/2] f32
                                  .Ret<ffi::AnyBuffer>()   // q [T, kv_heads * group, D]
                                  .Ret<ffi::AnyBuffer>()   // k [T, kv_heads, D]
                                  .Ret<ffi::AnyBuffer>());  // v [T, kv_heads, D]
