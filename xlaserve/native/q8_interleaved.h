// GGUF blocks of 8 rows interleaved ("x8" layouts: q8_0x8, q4_0x8, q4_1x8, q5_0x8, q5_1x8), as
// the Q8 GEMM multiplies them (q8_gemm_cpu.cc). quantized_gemm_cpu.py's `interleave_x8` makes
// them from a GGUF tensor's rows at load, `deinterleave_x8` gives the rows back.
//
// Rows 8g ... 8g + 7 of W are group g; a group holds, for each block b in order, the 8 rows'
// block b as: their float16 d (8 x 2 bytes), their float16 m (Q4_1, Q5_1), their 32-bit qh (Q5),
// then their quantized values interleaved 4 bytes at a time: word i of row 0, of row 1, ..., of
// row 7, then word i + 1 ... (the values' bytes as GGUF stores them: 16 bytes of nibbles, or
// Q8_0's 32 int8). A group's bytes are its 8 rows' bytes, reordered.
//
// Why: one 32-byte load then holds 4 consecutive values of 8 rows, so one vpdpbusd multiplies
// them by x's 4 values (broadcast) into 8 int32 lanes, one per output, and a block's 8 outputs
// are scaled and accumulated as one vector: no horizontal sums, no per-output scalar work
// (the one-row-at-a-time dot products of q8_blocks.h spend most of a block on its scales).
#pragma once

#include <cstdint>
#include <cstring>

#include "q8_blocks.h"

namespace xlaserve::q8 {

// A GGUF format's x8 layout: a group's block b at b * kBlockBytes (8 rows' blocks), its float16
// d (then m) first, its values kValuesAt in (after d, m and qh).
template <int64_t kBlockBytes, int64_t kValuesAt>
struct GgufGroup {
  static constexpr bool kFloatScales = false;
  static constexpr int64_t RowBytes(int64_t k) { return k / 32 * (kBlockBytes / 8); }
  XLASERVE_INLINE static const uint8_t* Values(const uint8_t* group, int64_t b) {
    return group + b * kBlockBytes + kValuesAt;
  }
  XLASERVE_INLINE static const uint8_t* Scales(const uint8_t* group, int64_t b) {
    return group + b * kBlockBytes;
  }
};

// The nibble formats' words: word i's low nibbles are values 4i ... 4i + 3, the high ones
// 16 + 4i ...; Q8_0's word i is values 4i ... 4i + 3. Values are q - kZero (signed: as they are).
struct Q8_0x8 : GgufGroup<8 * 34, 16> {
  static constexpr int kZero = 0;
  static constexpr bool kSigned = true, kHasMin = false, kFifth = false;
};
struct Q4_0x8 : GgufGroup<8 * 18, 16> {
  static constexpr int kZero = 8;
  static constexpr bool kSigned = false, kHasMin = false, kFifth = false;
};
struct Q4_1x8 : GgufGroup<8 * 20, 32> {
  static constexpr int kZero = 0;
  static constexpr bool kSigned = false, kHasMin = true, kFifth = false;
};
struct Q5_0x8 : GgufGroup<8 * 22, 48> {
  static constexpr int kZero = 16;
  static constexpr bool kSigned = false, kHasMin = false, kFifth = true;
};
struct Q5_1x8 : GgufGroup<8 * 24, 64> {
  static constexpr int kZero = 0;
  static constexpr bool kSigned = false, kHasMin = true, kFifth = true;
};

// --quantization int8's rows (i8_row: a float32 scale, then K int8 values) as the Q8 GEMM takes
// them (W8A8): a group is its 8 rows' scales, then their values 4 bytes at a time, row by row,
// over the whole of K; "block" b is values 32b ... 32b + 31, all at the row's one scale.
struct I8Rowx8 {
  static constexpr int kZero = 0;
  static constexpr bool kSigned = true, kHasMin = false, kFifth = false, kFloatScales = true;
  static constexpr int64_t RowBytes(int64_t k) { return 4 + k; }
  XLASERVE_INLINE static const uint8_t* Values(const uint8_t* group, int64_t b) {
    return group + 32 + 256 * b;
  }
  XLASERVE_INLINE static const uint8_t* Scales(const uint8_t* group, int64_t) { return group; }
};

// Value `k` (0..31) of row `c` (0..7) of a group block's `values`, unsigned (before kZero) or
// signed.
template <typename F>
XLASERVE_INLINE int32_t GroupValue(const uint8_t* values, int c, int k) {
  if constexpr (F::kSigned) {
    return static_cast<int8_t>(values[32 * (k / 4) + 4 * c + k % 4]);
  } else {
    const int word = (k % 16) / 4, byte = values[32 * word + 4 * c + k % 4];
    int32_t q = k < 16 ? byte & 15 : byte >> 4;
    if constexpr (F::kFifth) {
      q |= ((quantized::U32At(values - 32 + 4 * c) >> k) & 1) << 4;
    }
    return q;
  }
}

// Row c's d and m in a group block's `scales`.
template <typename F>
XLASERVE_INLINE float GroupD(const uint8_t* scales, int c) {
  if constexpr (F::kFloatScales) return quantized::FloatAt(scales + 4 * c);
  return HalfToFloat(scales + 2 * c);
}
template <typename F>
XLASERVE_INLINE float GroupM(const uint8_t* scales, int c) { return HalfToFloat(scales + 16 + 2 * c); }

#if defined(__AVX2__)
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif

// acc + (lane c: u's bytes 4c..4c+3 . s's), u unsigned (at most 255 with VNNI, 128 without), s
// signed.
XLASERVE_INLINE __m256i DotAdd(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                 _mm256_set1_epi16(1)));
#endif
}

// The 8 rows' d (or m, 16 bytes on) of a group block as floats.
XLASERVE_INLINE __m256 EightHalves(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
template <typename F>
XLASERVE_INLINE __m256 EightScales(const uint8_t* scales) {
  if constexpr (F::kFloatScales) return _mm256_loadu_ps(reinterpret_cast<const float*>(scales));
  return EightHalves(scales);
}

// Bytes 4c + t of a register: 16 where bit `first + t` of lane c of qh is set (t < 4).
XLASERVE_INLINE __m256i FifthBitsX8(__m256i qh, int first) {
  const __m256i shifted = _mm256_srl_epi32(qh, _mm_cvtsi32_si128(first));
  const __m256i spread = _mm256_shuffle_epi8(
      shifted, _mm256_set_epi64x(0x0C0C0C0C08080808LL, 0x0404040400000000LL,
                                 0x0C0C0C0C08080808LL, 0x0404040400000000LL));  // lane's byte 0
  const __m256i bits = _mm256_set1_epi32(0x08040201);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bits), bits),
                          _mm256_set1_epi8(16));
}

// The 8 registers of a group block's values: register j holds values 4j ... 4j + 3 of the 8
// rows (row c in bytes 4c ... 4c + 3), unsigned; Q8_0's signed (with VNNI: + 128, unsigned).
template <typename F>
XLASERVE_INLINE void GroupRegisters(const uint8_t* values, __m256i (&w)[8]) {
  if constexpr (F::kSigned) {
    for (int j = 0; j < 8; ++j) {
      w[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + 32 * j));
      if constexpr (kVnni) w[j] = _mm256_xor_si256(w[j], _mm256_set1_epi8(-128));
    }
  } else {
    const __m256i low = _mm256_set1_epi8(15);
    for (int i = 0; i < 4; ++i) {
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + 32 * i));
      w[i] = _mm256_and_si256(packed, low);
      w[i + 4] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
    }
    if constexpr (F::kFifth) {
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values - 32));
      for (int i = 0; i < 4; ++i) {
        w[i] = _mm256_or_si256(w[i], FifthBitsX8(qh, 4 * i));
        w[i + 4] = _mm256_or_si256(w[i + 4], FifthBitsX8(qh, 16 + 4 * i));
      }
    }
  }
}

// y[r, 0..7] for rows x0 ... x0 + R - 1 of x (in one tile of 8) against one group (its
// `blocks` blocks).
template <typename F, int R>
XLASERVE_INLINE void GroupTile(const XTiles& x, int64_t x0, const uint8_t* group, int64_t blocks,
                               float* y, int64_t ldy) {
  // Q8_0 with VNNI multiplies q + 128 (unsigned): 128 times x's sum comes off.
  constexpr int kZero = F::kSigned ? (kVnni ? 128 : 0) : F::kZero;
  const int8_t* xq = x.q + x.QAt(x0);  // block b, row r: + 256 b + 32 r
  const int64_t at = x.At(x0);          // block b, row r: + 8 b + r
  const float *xd = x.d + at, *xs = x.s + at;
  const int32_t* xsum = x.sum32 + at;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* scales = F::Scales(group, b);
    __m256i w[8];
    GroupRegisters<F>(F::Values(group, b), w);
    const __m256 d = EightScales<F>(scales);
    __m256 m;
    if constexpr (F::kHasMin) m = EightHalves(scales + 16);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int8_t* row = xq + 256 * b + 32 * r;
      __m256i isum = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        int32_t four;
        std::memcpy(&four, row + 4 * j, 4);
        const __m256i xs = _mm256_set1_epi32(four);
        if constexpr (F::kSigned && !kVnni)
          isum = DotAdd(isum, _mm256_sign_epi8(w[j], w[j]), _mm256_sign_epi8(xs, w[j]));
        else
          isum = DotAdd(isum, w[j], xs);
      }
      if constexpr (kZero != 0)
        isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(kZero * xsum[8 * b + r]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum),
                               _mm256_mul_ps(d, _mm256_set1_ps(xd[8 * b + r])), acc[r]);
      if constexpr (F::kHasMin) acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[8 * b + r]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * ldy, acc[r]);
}
#else
// Portable: the same sums, one output at a time.
template <typename F, int R>
void GroupTile(const XTiles& x, int64_t x0, const uint8_t* group, int64_t blocks, float* y,
               int64_t ldy) {
  constexpr int kZero = F::kSigned ? 0 : F::kZero;
  for (int r = 0; r < R; ++r) {
    const int8_t* xq = x.q + x.QAt(x0 + r);
    const int64_t at = x.At(x0 + r);
    for (int c = 0; c < 8; ++c) {
      float total = 0.0f;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t *values = F::Values(group, b), *scales = F::Scales(group, b);
        int32_t isum = 0;
        for (int k = 0; k < 32; ++k)
          isum += (GroupValue<F>(values, c, k) - kZero) * xq[256 * b + k];
        total += static_cast<float>(isum) * (GroupD<F>(scales, c) * x.d[at + 8 * b]);
        if constexpr (F::kHasMin) total += GroupM<F>(scales, c) * x.s[at + 8 * b];
      }
      y[r * ldy + c] = total;
    }
  }
}
#endif

}  // namespace xlaserve::q8
