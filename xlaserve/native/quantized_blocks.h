// Decoders of the weight formats the quantized CPU GEMM reads (quantized_gemm_cpu.cc): GGUF's
// Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K and Q6_K blocks as ggml (ggml-common.h, dequantize_row_* in
// ggml-quants.c) and gguf-py (gguf/quants.py) define them, and xlaserve's own i8_row (a float32
// scale, then the row's K int8 values).
//
// A decoder writes float32 weights equal, bit for bit, to gguf.quants.dequantize's. For the GGUF
// formats that needs no care about rounding: every product is exact in float32 (a float16 scale
// has 11 significant bits, a K-quant's sub-block scale 6 or 8 more, q 4 to 8 more: at most 24),
// so whether the compiler fuses d * q + m into one multiply-add or not, the result is gguf's one
// rounding of the sum. i8_row's float32 scale * q is one rounding, as numpy's.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "gemm_tiles.h"  // Vec, kLanes, Load, Store

namespace xlaserve::quantized {

// The decoders and the sinks they call must inline into the kernels' loops: a call keeps the
// accumulators in memory (GCC left some out of line, and a 4x4 tile ran at a third of its speed).
#define XLASERVE_INLINE inline __attribute__((always_inline))
#define XLASERVE_INLINE_LAMBDA __attribute__((always_inline))

using gemm::kLanes;
using gemm::Load;
using gemm::Store;
using gemm::Vec;

// The formats' codes, shared with quantized_gemm_cpu.py: ggml's type ids, and one of our own.
enum Format : int64_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14, kI8Row = 256
};

typedef int32_t Ints __attribute__((vector_size(4 * kLanes)));

// kLanes bytes (unsigned, or signed with `Signed`) widened to 32-bit lanes. x86 does it in one
// instruction; GCC 12's __builtin_convertvector from bytes converts one byte at a time (Q8_0 rows
// decoded 7x slower).
template <bool Signed = false>
XLASERVE_INLINE Ints Widen(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<Ints>(Signed ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v));
#elif defined(__AVX2__)
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<Ints>(Signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v));
#else
  Ints out;
  for (int i = 0; i < kLanes; ++i)
    out[i] = Signed ? static_cast<int8_t>(p[i]) : static_cast<int32_t>(p[i]);
  return out;
#endif
}

XLASERVE_INLINE Vec ToFloat(Ints v) { return __builtin_convertvector(v, Vec); }

// An IEEE half (little-endian bytes) as float32: exact.
XLASERVE_INLINE float HalfToFloat(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);  // infinity, NaN
  } else if (exponent == 0) {                      // zero, subnormal: mantissa * 2^-24
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  } else {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

XLASERVE_INLINE float FloatAt(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, 4);
  return f;
}

// 4 little-endian bytes (a Q5 block's qh) as a uint32.
XLASERVE_INLINE uint32_t U32At(const uint8_t* p) {
  uint32_t u;
  std::memcpy(&u, p, 4);
  return u;
}

// Each format: kBlock weights in kBytes, and Decode(block, sink) calling sink(i, w) for the
// block's weights i ... i + kLanes - 1 as one vector w, i in increasing order. The sink stores
// them (a buffer of decoded rows) or multiplies them into accumulators right away.

struct Q8_0 {  // f16 d, 32 int8 q: w = d * q
  static constexpr int64_t kBlock = 32, kBytes = 34;
  template <typename Sink>
  XLASERVE_INLINE static void Decode(const uint8_t* block, Sink sink) {
    const float d = HalfToFloat(block);
    for (int i = 0; i < 32; i += kLanes) sink(i, ToFloat(Widen<true>(block + 2 + i)) * d);
  }
};

// `kCount` bytes of packed 4-bit q: sink(i, low(q)) for the low nibbles of bytes i ..., then
// sink(kCount + i, high(q)) for the high ones, low and high mapping float q (0..15) to weights
// elementwise. With AVX-512 each is evaluated once, on q = 0..15, and looked up per weight
// (VPERMPS reads only the index's low 4 bits) instead of converted, scaled and offset: Q4_0 rows
// decoded 1.3x faster, Q4_K 1.6x.
template <int kCount, typename Low, typename High, typename Sink>
XLASERVE_INLINE void DecodeNibbles(const uint8_t* qs, Low low, High high, Sink sink) {
#ifdef __AVX512F__
  const Vec iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const __m512 low_table = reinterpret_cast<__m512>(low(iota));
  const __m512 high_table = reinterpret_cast<__m512>(high(iota));
  __m512i q[kCount / kLanes];
  for (int i = 0; i < kCount; i += kLanes) {
    q[i / kLanes] = reinterpret_cast<__m512i>(Widen(qs + i));
    sink(i, reinterpret_cast<Vec>(_mm512_permutexvar_ps(q[i / kLanes], low_table)));
  }
  for (int i = 0; i < kCount; i += kLanes) {
    const __m512i high_q = _mm512_srli_epi32(q[i / kLanes], 4);
    sink(kCount + i, reinterpret_cast<Vec>(_mm512_permutexvar_ps(high_q, high_table)));
  }
#else
  Ints q[kCount / kLanes];
  for (int i = 0; i < kCount; i += kLanes) {
    q[i / kLanes] = Widen(qs + i);
    sink(i, low(ToFloat(q[i / kLanes] & 15)));
  }
  for (int i = 0; i < kCount; i += kLanes) sink(kCount + i, high(ToFloat(q[i / kLanes] >> 4)));
#endif
}

// 16 bytes of 4-bit q: weight j < 16 the low nibble of byte j, j >= 16 the high one of byte j - 16.
struct Q4_0 {  // f16 d, 16 bytes of nibbles: w = d * (q - 8)
  static constexpr int64_t kBlock = 32, kBytes = 18;
  template <typename Sink>
  XLASERVE_INLINE static void Decode(const uint8_t* block, Sink sink) {
    const float d = HalfToFloat(block);
    const auto weight = [d](Vec q) XLASERVE_INLINE_LAMBDA { return (q - 8.0f) * d; };
    DecodeNibbles<16>(block + 2, weight, weight, sink);
  }
};

struct Q4_1 {  // f16 d, f16 m, 16 bytes of nibbles as Q4_0's: w = d * q + m
  static constexpr int64_t kBlock = 32, kBytes = 20;
  template <typename Sink>
  XLASERVE_INLINE static void Decode(const uint8_t* block, Sink sink) {
    const float d = HalfToFloat(block), m = HalfToFloat(block + 2);
    const auto weight = [d, m](Vec q) XLASERVE_INLINE_LAMBDA { return q * d + m; };
    DecodeNibbles<16>(block + 4, weight, weight, sink);
  }
};

// 16 bytes of nibbles as Q4_0's and 32 high bits qh, bit j weight j's fifth: sink(i, weight(q))
// for q = nibble | bit << 4 (0..31), weights 0 ... 31 in order. With AVX-512, as DecodeNibbles,
// weight() is evaluated once on q = 0..31, as two tables that VPERMT2PS looks up by the 5-bit q,
// the fifth bit set from a mask register of qh's 16 bits.
template <typename Weight, typename Sink>
XLASERVE_INLINE void DecodeFiveBits(const uint8_t* qs, uint32_t qh, Weight weight, Sink sink) {
#ifdef __AVX512F__
  const Vec iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const __m512 low_table = reinterpret_cast<__m512>(weight(iota));
  const __m512 high_table = reinterpret_cast<__m512>(weight(iota + 16.0f));
  const __m512i q = reinterpret_cast<__m512i>(Widen(qs)), fifth = _mm512_set1_epi32(16);
  const __m512i nibbles[2] = {_mm512_and_si512(q, _mm512_set1_epi32(15)), _mm512_srli_epi32(q, 4)};
  for (int half = 0; half < 2; ++half) {
    const __mmask16 fifth_bits = static_cast<__mmask16>(qh >> 16 * half);
    const __m512i index = _mm512_mask_or_epi32(nibbles[half], fifth_bits, nibbles[half], fifth);
    sink(16 * half, reinterpret_cast<Vec>(_mm512_permutex2var_ps(low_table, index, high_table)));
  }
#else
  Ints lane, q[16 / kLanes];
  for (int i = 0; i < kLanes; ++i) lane[i] = i;
  for (int i = 0; i < 16; i += kLanes) q[i / kLanes] = Widen(qs + i);
  for (int half = 0; half < 2; ++half) {
    for (int i = 0; i < 16; i += kLanes) {
      const Ints nibble = half ? q[i / kLanes] >> 4 : q[i / kLanes] & 15;
      const Ints bit = ((Ints{} + static_cast<int32_t>(qh >> (16 * half + i))) >> lane) & 1;
      sink(16 * half + i, weight(ToFloat(nibble | bit << 4)));
    }
  }
#endif
}

struct Q5_0 {  // f16 d, 4 bytes qh, 16 bytes of nibbles (DecodeFiveBits): w = d * (q - 16)
  static constexpr int64_t kBlock = 32, kBytes = 22;
  template <typename Sink>
  XLASERVE_INLINE static void Decode(const uint8_t* block, Sink sink) {
    const float d = HalfToFloat(block);
    DecodeFiveBits(
        block + 6, U32At(block + 2),
        [d](Vec q) XLASERVE_INLINE_LAMBDA { return (q - 16.0f) * d; }, sink);
  }
};

struct Q5_1 {  // f16 d, f16 m, 4 bytes qh, 16 bytes of nibbles (DecodeFiveBits): w = d * q + m
  static constexpr int64_t kBlock = 32, kBytes = 24;
  template <typename Sink>
  XLASERVE_INLINE static void Decode(const uint8_t* block, Sink sink) {
    const float d = HalfToFloat(block), m = HalfToFloat(block + 2);
    DecodeFiveBits(
        block + 8, U32At(block + 4),
        [d, m](Vec q) XLASERVE_INLINE_LAMBDA { return q * d + m; }, sink);
  }
};

// Q4_K: f16 d, f16 dmin, 12 bytes holding 8 six-bit scales and 8 six-bit mins, 128 bytes of
// nibbles. Sub-block j (32 weights) is w = (d * scale_j) * q - dmin * min_j, its q the low (j
// even) or high (j odd) nibbles of bytes 32 * (j / 2) ... + 31.
struct Q4_K {
  static constexpr int64_t kBlock = 256, kBytes = 144;
  // out[j] = d * scale_j, out[8 + j] = dmin * min_j: ggml's get_scale_min_k4 for every j at once,
  // on the 12 bytes gathered into vector lanes.
  XLASERVE_INLINE static void ScalesMins(const uint8_t* block, float (&out)[16]) {
    typedef uint8_t Bytes16 __attribute__((vector_size(16)));
    Bytes16 s;
    std::memcpy(&s, block + 4, 16);  // the 12 bytes, and 4 of q
    // Lane j < 4: scale_j = s[j] & 63; 4 <= j < 8: (s[j + 4] & 15) | (s[j - 4] >> 6) << 4. Lane
    // 8 + j: min_j = s[j + 4] & 63 for j < 4, (s[j + 4] >> 4) | (s[j] >> 6) << 4 above.
    alignas(16) uint8_t gathered[2][16];
    const Bytes16 low =
        __builtin_shufflevector(s, s, 0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11);
    const Bytes16 high =
        __builtin_shufflevector(s, s, 0, 0, 0, 0, 0, 1, 2, 3, 0, 0, 0, 0, 4, 5, 6, 7);
    std::memcpy(gathered[0], &low, 16);
    std::memcpy(gathered[1], &high, 16);
    alignas(64) static constexpr int32_t kShift[16] = {0, 0, 0, 0, 0, 0, 0, 0,
                                                       0, 0, 0, 0, 4, 4, 4, 4};
    alignas(64) static constexpr int32_t kMask[16] = {63, 63, 63, 63, 15, 15, 15, 15,
                                                      63, 63, 63, 63, 15, 15, 15, 15};
    alignas(64) static constexpr int32_t kHighMask[16] = {0, 0, 0, 0, 48, 48, 48, 48,
                                                          0, 0, 0, 0, 48, 48, 48, 48};
    alignas(64) static constexpr int32_t kLane[16] = {0, 1, 2, 3, 4, 5, 6, 7,
                                                      8, 9, 10, 11, 12, 13, 14, 15};
    const float d = HalfToFloat(block), dmin = HalfToFloat(block + 2);
    for (int i = 0; i < 16; i += kLanes) {
      Ints shift, mask, high_mask, lane;
      std::memcpy(&shift, kShift + i, sizeof(Ints));
      std::memcpy(&mask, kMask + i, sizeof(Ints));
      std::memcpy(&high_mask, kHighMask + i, sizeof(Ints));
      std::memcpy(&lane, kLane + i, sizeof(Ints));
      const Ints q = ((Widen(gathered[0] + i) >> shift) & mask) |
                     ((Widen(gathered[1] + i) >> 2) & high_mask);
      Store(out + i, ToFloat(q) * (lane < 8 ? Vec{} + d : Vec{} + dmin));
    }
  }
  template <typename Sink>
  XLASERVE_INLINE static void Decode(const uint8_t* block, Sink sink) {
    alignas(64) float sm[16];
    ScalesMins(block, sm);
    // Read back from memory below (a broadcast from memory costs no vector port; GCC otherwise
    // takes each lane out of the register with a VPERMD, which made Q4_K decoding 1.4x slower).
    asm volatile("" : : "r"(sm) : "memory");
    for (int c = 0; c < 4; ++c) {  // sub-blocks 2c and 2c + 1 share bytes 32c ... 32c + 31
      const float d0 = sm[2 * c], m0 = sm[8 + 2 * c], d1 = sm[2 * c + 1], m1 = sm[9 + 2 * c];
      DecodeNibbles<32>(block + 16 + 32 * c,
                        [d0, m0](Vec q) XLASERVE_INLINE_LAMBDA { return q * d0 - m0; },
                        [d1, m1](Vec q) XLASERVE_INLINE_LAMBDA { return q * d1 - m1; },
                        [&](int i, Vec w) XLASERVE_INLINE_LAMBDA { sink(64 * c + i, w); });
    }
  }
};

// Q6_K: 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), 16 int8 scales, f16 d. Weight e
// (half h = e / 128, quarter t = e % 128 / 32, i = e % 32) takes its low bits from ql[64h + 32(t%2)
// + i] (nibble t / 2) and its high bits from qh[32h + i] (bits 2t, 2t+1); w = (d * scale[e / 16])
// * (q - 32), computed as q * s - 32 s (exact either way).
struct Q6_K {
  static constexpr int64_t kBlock = 256, kBytes = 210;
  template <typename Sink>
  XLASERVE_INLINE static void Decode(const uint8_t* block, Sink sink) {
    const uint8_t *ql = block, *qh = block + 128;
    const float d = HalfToFloat(block + 208);
    alignas(64) float scales[16], offsets[16];  // d * scale[j], -32 * that
    for (int j = 0; j < 16; j += kLanes) {
      const Vec scale = ToFloat(Widen<true>(block + 192 + j)) * d;
      Store(scales + j, scale);
      Store(offsets + j, scale * -32.0f);
    }
    asm volatile("" : : "r"(scales), "r"(offsets) : "memory");  // as in Q4_K::Decode
    for (int h = 0; h < 2; ++h) {
      Ints q[4][32 / kLanes];  // quarter t, lanes i
      for (int i = 0; i < 32; i += kLanes) {
        const Ints low0 = Widen(ql + 64 * h + i), low1 = Widen(ql + 64 * h + 32 + i);
        const Ints high = Widen(qh + 32 * h + i);
        q[0][i / kLanes] = (low0 & 15) | ((high & 3) << 4);
        q[1][i / kLanes] = (low1 & 15) | ((high & 12) << 2);
        q[2][i / kLanes] = (low0 >> 4) | (high & 48);
        q[3][i / kLanes] = (low1 >> 4) | ((high >> 2) & 48);
      }
      for (int t = 0; t < 4; ++t) {
        for (int i = 0; i < 32; i += kLanes) {
          const int e = 128 * h + 32 * t + i;
          sink(e, ToFloat(q[t][i / kLanes]) * scales[e / 16] + offsets[e / 16]);
        }
      }
    }
  }
};

// i8_row (ours, for --quantization int8): a row is its float32 scale then K int8 q: w = scale * q.
// Any K: it decodes kStep weights at a time (Decode), and one (Weight) in a K's last part step.
struct I8Row {
  static constexpr int64_t kBlock = 1, kBytes = 1, kHeader = 4, kStep = 32;
  template <typename Sink>
  XLASERVE_INLINE static void Decode(const uint8_t* row, int64_t first, Sink sink) {
    const float scale = FloatAt(row);
    for (int i = 0; i < kStep; i += kLanes)
      sink(i, ToFloat(Widen<true>(row + kHeader + first + i)) * scale);
  }
  static float Weight(const uint8_t* row, int64_t e) {
    return static_cast<float>(static_cast<int8_t>(row[kHeader + e])) * FloatAt(row);
  }
};

template <typename F>
constexpr bool kIsI8Row = std::is_same_v<F, I8Row>;

// Weights decoded in steps: a GGUF format's block, or i8_row's kStep.
template <typename F>
constexpr int64_t kStep = kIsI8Row<F> ? I8Row::kStep : F::kBlock;

template <typename F>
constexpr int64_t RowBytes(int64_t k) {
  if constexpr (kIsI8Row<F>) return I8Row::kHeader + k;
  return k / F::kBlock * F::kBytes;
}

// sink(i, w) for weights first + i ... of a row, one step of them (first a multiple of kStep<F>).
template <typename F, typename Sink>
XLASERVE_INLINE void DecodeStep(const uint8_t* row, int64_t first, Sink sink) {
  if constexpr (kIsI8Row<F>) {
    I8Row::Decode(row, first, sink);
  } else {
    F::Decode(row + first / F::kBlock * F::kBytes, sink);
  }
}

// out[0, count) = weights [first, first + count) of a row (first a multiple of kStep<F>; count
// one too, but for the end of an i8_row K).
template <typename F>
inline void DecodeRange(const uint8_t* row, int64_t first, int64_t count, float* out) {
  int64_t i = 0;
  for (; i + kStep<F> <= count; i += kStep<F>)
    DecodeStep<F>(row, first + i,
                  [out, i](int j, Vec w) XLASERVE_INLINE_LAMBDA { Store(out + i + j, w); });
  if constexpr (kIsI8Row<F>) {
    for (; i < count; ++i) out[i] = I8Row::Weight(row, first + i);
  }
}

// (Shared by both quantized GEMMs, quantized_gemm_cpu.cc and q8_gemm_cpu.cc.)
// tile(R, C, r, c) (R and C as std::integral_constant) for the tiles of rows x cols: kRows x kCols,
// and smaller ones at the ends. Rows outer: a tile's rows of x stay in L1 across its columns.
template <int R, int C, typename Tile>
inline void OneTile(int64_t rows, int64_t cols, int64_t r, int64_t c, Tile& tile) {
  if constexpr (R > 1) {
    if (rows < R) return OneTile<R - 1, C>(rows, cols, r, c, tile);
  }
  if constexpr (C > 1) {
    if (cols < C) return OneTile<R, C - 1>(rows, cols, r, c, tile);
  }
  tile(std::integral_constant<int, R>{}, std::integral_constant<int, C>{}, r, c);
}

template <int kRows, int kCols, typename Tile>
inline void ForTiles(int64_t rows, int64_t cols, Tile tile) {
  for (int64_t r = 0; r < rows; r += kRows)
    for (int64_t c = 0; c < cols; c += kCols)
      OneTile<kRows, kCols>(std::min<int64_t>(kRows, rows - r), std::min<int64_t>(kCols, cols - c),
                            r, c, tile);
}

// run(F{}) with the format `code` names; false for an unknown code.
template <typename Run>
bool WithFormat(int64_t code, Run run) {
  switch (code) {
    case kQ8_0: run(Q8_0{}); return true;
    case kQ4_0: run(Q4_0{}); return true;
    case kQ4_1: run(Q4_1{}); return true;
    case kQ5_0: run(Q5_0{}); return true;
    case kQ5_1: run(Q5_1{}); return true;
    case kQ4_K: run(Q4_K{}); return true;
    case kQ6_K: run(Q6_K{}); return true;
    case kI8Row: run(I8Row{}); return true;
    default: return false;
  }
}

}  // namespace xlaserve::quantized
