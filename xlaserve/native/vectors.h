// Float vectors for the native CPU kernels: 16 floats (GCC vector extensions: 512-bit registers
// where the CPU has them, pairs or quads of narrower ones elsewhere), bfloat16 <-> float32 as
// XLA converts, and a vector exp.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace xlaserve {

typedef float Vec16 __attribute__((vector_size(64)));
typedef float Vec8 __attribute__((vector_size(32)));
typedef float Vec4 __attribute__((vector_size(16)));
typedef uint16_t Bf16x16 __attribute__((vector_size(32)));
typedef uint32_t U32x16 __attribute__((vector_size(64)));

inline Vec16 Load16(const float* x) {
  Vec16 v;
  std::memcpy(&v, x, 64);
  return v;
}

inline Vec16 Load16(const uint16_t* x) {  // bfloat16 -> float32: the high half of the bits
  Bf16x16 h;
  std::memcpy(&h, x, 32);
  U32x16 bits = __builtin_convertvector(h, U32x16) << 16;
  Vec16 v;
  std::memcpy(&v, &bits, 64);
  return v;
}

inline void Store16(float* x, Vec16 v) { std::memcpy(x, &v, 64); }

inline float Sum16(Vec16 v) {
  Vec8 half = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
              __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  Vec4 quarter = __builtin_shufflevector(half, half, 0, 1, 2, 3) +
                 __builtin_shufflevector(half, half, 4, 5, 6, 7);
  return (quarter[0] + quarter[2]) + (quarter[1] + quarter[3]);
}

inline float Bf16ToF32(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t F32ToBf16(float f) {  // round to nearest even, as XLA's convert
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// 16 floats to bfloat16 as F32ToBf16 does, in vector registers.
inline void StoreBf16(uint16_t* dst, Vec16 v) {
  U32x16 bits;
  std::memcpy(&bits, &v, 64);
  const U32x16 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const U32x16 nan = (bits >> 16) | 0x40u;
  const U32x16 out = (bits & 0x7fffffffu) > 0x7f800000u ? nan : rounded;
  const Bf16x16 halves = __builtin_convertvector(out, Bf16x16);
  std::memcpy(dst, &halves, 32);
}

// A float32 or bfloat16 output (O = float or uint16_t) written from 16 floats, or from one.
template <typename O>
inline void StoreAs(O* dst, Vec16 v) {
  if constexpr (std::is_same_v<O, float>) {
    Store16(dst, v);
  } else {
    StoreBf16(dst, v);
  }
}

template <typename O>
inline void StoreAs(O* dst, float v) {
  if constexpr (std::is_same_v<O, float>) {
    *dst = v;
  } else {
    *dst = F32ToBf16(v);
  }
}

// exp(x) for x <= 0, ~1 ulp (Cephes' polynomial), for a float or a float vector (`Vec8`,
// `Vec16`); vectorizes, unlike std::exp without fast-math.
template <typename V>
inline V ExpNonPositive(V x) {
  const V lowest = V{} - 87.0f;
  x = x < lowest ? lowest : x;
  const V shifter = V{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const V n = (x * 1.44269504088896341f + shifter) - shifter;
  const V r = x - n * 0.693359375f - n * -2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  V scale;
  if constexpr (std::is_same_v<V, float>) {
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    std::memcpy(&scale, &bits, 4);
  } else {
    typedef int32_t Lanes __attribute__((vector_size(sizeof(V))));
    const Lanes bits = (__builtin_convertvector(n, Lanes) + 127) << 23;
    std::memcpy(&scale, &bits, sizeof(scale));
  }
  return p * scale;
}

// silu(g) = g * sigmoid(g), with exp of a non-positive argument only: sigmoid is 1 / (1 + e^-g)
// for g >= 0 and e^g / (1 + e^g) below (no overflow on either side). Past |g| = 87, e^-|g| is
// below the smallest normal float and counts as 0 (ExpNonPositive clamps there instead).
template <typename V>
inline V Silu(V g) {
  const V magnitude = g < 0.0f ? -g : g;
  const V e = magnitude > 87.0f ? V{} : ExpNonPositive(V{} - magnitude);
  const V sigmoid = (g < 0.0f ? e : V{} + 1.0f) / (1.0f + e);
  return g * sigmoid;
}

}  // namespace xlaserve
