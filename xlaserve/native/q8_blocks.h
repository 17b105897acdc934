// Integer dot products of GGUF weight blocks with activations quantized per block, as llama.cpp
// multiplies its own formats (ggml-quants.c, ggml-cpu/quants.c): the Q8 GEMM's building blocks
// (q8_gemm_cpu.cc).
//
// Activations. A row of x is quantized the way ggml's x86 code quantizes it for each weight type:
// - blocks of 32 (Q8_0, and Q8_1 which also keeps s), for Q8_0, Q4_0, Q5_0 (Q8_0) and Q4_1, Q5_1
//   (Q8_1) weights: amax = max |x|, d = amax / 127 (stored rounded to float16), id = 127 / amax
//   (0 when amax is 0), q = round-half-even(x * id), s = float16(d * sum(q));
// - blocks of 256 (Q8_K), for Q4_K and Q6_K weights: max = the x of largest |x| (the first),
//   iscale = -127 / max, q = min(127, round-half-even(iscale * x)), d = 1 / iscale (float32), and
//   the sums of q per 16 (ggml's bsums); a block of zeros has d = 0, q = 0.
// Each row keeps its q (K int8), d and s per block and the sums of q per 16 values (`XRows`).
//
// Dot products. A weight block's q times x's q is summed in int32 (exact), then scaled in
// float32 as ggml's vec_dot_*: Q8_0/Q4_0/Q5_0 d_w * d_x * isum (q - 8 or q - 16 signed);
// Q4_1/Q5_1 d_w * d_x * isum + m_w * s_x; Q4_K d_w * d_x * sum_j scale_j * isum_j - dmin_w *
// d_x * sum_j min_j * bsum_j; Q6_K d_w * d_x * sum_g scale_g * (isum_g - 32 * bsum_g). The
// integer parts equal ggml's; only the float32 summation order of the blocks differs.
//
// Paths: AVX2 (maddubs + madd), AVX-512 VNNI and AVX-VNNI (vpdpbusd), on 256-bit registers; and a
// portable one in plain C++ (ARM's compilers, any other CPU).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "quantized_blocks.h"  // the formats' codes and their float16 scales (HalfToFloat)

namespace xlaserve::q8 {

using quantized::HalfToFloat;

// A float rounded to float16 and back: ggml stores d and s as float16 (round to nearest even).
XLASERVE_INLINE float RoundToHalf(float f) { return static_cast<float>(static_cast<_Float16>(f)); }

XLASERVE_INLINE int32_t RoundHalfEven(float f) { return static_cast<int32_t>(std::nearbyint(f)); }

// Rows of x quantized: q [M, K] int8; d [M, K / block]; s [M, K / 32] (blocks of 32 only);
// sum16 [M, K / 16] int32.
struct XRows {
  int8_t* q;
  float* d;
  float* s;
  int32_t* sum16;
  int64_t k;
  bool k_blocks;  // Q8_K's 256-value blocks, else 32
  const int8_t* Q(int64_t r) const { return q + r * k; }
  const float* D(int64_t r) const { return d + r * (k / (k_blocks ? 256 : 32)); }
  const float* S(int64_t r) const { return s + r * (k / 32); }
  const int32_t* Sum16(int64_t r) const { return sum16 + r * (k / 16); }
};

// Rows of x quantized in blocks of 32 for the interleaved layouts (q8_interleaved.h), 8 rows a
// tile: tile t holds, block by block, its 8 rows' 32 values side by side (q [tiles, blocks, 8,
// 32]) and their d, s and sums of q ([tiles, blocks, 8]): a tile of rows finds a block's x at one
// pointer and constant offsets (with a pointer a row, 8 rows' pointers left the general
// registers short and the loop reloaded them from the stack).
struct XTiles {
  int8_t* q;
  float* d;
  float* s;
  int32_t* sum32;
  int64_t blocks;
  int64_t QAt(int64_t r) const { return r / 8 * blocks * 256 + r % 8 * 32; }  // row r, block 0
  int64_t At(int64_t r) const { return r / 8 * blocks * 8 + r % 8; }           // its d, s, sum
};

// One block of 32 values into q, d, s and the sums of q's two halves.
XLASERVE_INLINE void QuantizeBlock32(const float* v, int8_t* q, float& d, float& s, int32_t& low,
                                     int32_t& high) {
#if defined(__AVX2__)
  __m256 x[4];
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 amax8 = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm256_loadu_ps(v + 8 * i);
    amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, x[i]));
  }
  __m128 amax4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
  amax4 = _mm_max_ps(amax4, _mm_movehl_ps(amax4, amax4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(amax4, _mm_movehdup_ps(amax4)));
  const float scale = amax / 127.0f;
  const __m256 inverse = _mm256_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
  __m256i ints[4];  // rounded to nearest even, the default rounding mode
  for (int i = 0; i < 4; ++i) ints[i] = _mm256_cvtps_epi32(_mm256_mul_ps(x[i], inverse));
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(ints[0], ints[1]),
                                            _mm256_packs_epi32(ints[2], ints[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  const auto sum8 = [](__m256i v) {
    const __m128i four = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    const __m128i two = _mm_add_epi32(four, _mm_unpackhi_epi64(four, four));
    return _mm_cvtsi128_si32(_mm_add_epi32(two, _mm_shuffle_epi32(two, 1)));
  };
  low = sum8(_mm256_add_epi32(ints[0], ints[1]));
  high = sum8(_mm256_add_epi32(ints[2], ints[3]));
#else
  float amax = 0.0f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
  const float scale = amax / 127.0f, inverse = amax != 0.0f ? 127.0f / amax : 0.0f;
  int32_t halves[2] = {0, 0};
  for (int i = 0; i < 32; ++i) {
    const int32_t value = RoundHalfEven(v[i] * inverse);
    q[i] = static_cast<int8_t>(value);
    halves[i / 16] += value;
  }
  low = halves[0];
  high = halves[1];
#endif
  d = RoundToHalf(scale);
  s = RoundToHalf(scale * static_cast<float>(low + high));
}

// One row of K values (K a multiple of 32) into blocks of 32: q, d, s, sum16 of that row.
inline void QuantizeBlocks32(const float* x, int64_t k, int8_t* q, float* d, float* s,
                             int32_t* sum16) {
  for (int64_t b = 0; b < k / 32; ++b)
    QuantizeBlock32(x + 32 * b, q + 32 * b, d[b], s[b], sum16[2 * b], sum16[2 * b + 1]);
}

// Row r of x (K values) into its places in `tiles`.
inline void QuantizeTiled32(const float* x, int64_t r, const XTiles& tiles) {
  int8_t* q = tiles.q + tiles.QAt(r);
  const int64_t at = tiles.At(r);
  for (int64_t b = 0; b < tiles.blocks; ++b) {
    int32_t low, high;
    QuantizeBlock32(x + 32 * b, q + 256 * b, tiles.d[at + 8 * b], tiles.s[at + 8 * b], low, high);
    tiles.sum32[at + 8 * b] = low + high;
  }
}

// One row of K values (K a multiple of 256) into Q8_K blocks: q, d, sum16.
inline void QuantizeBlocksK(const float* x, int64_t k, int8_t* q, float* d, int32_t* sum16) {
  for (int64_t b = 0; b < k / 256; ++b) {
    const float* v = x + 256 * b;
    float amax = 0.0f, max = 0.0f;
    for (int i = 0; i < 256; ++i) {
      if (std::fabs(v[i]) > amax) {
        amax = std::fabs(v[i]);
        max = v[i];
      }
    }
    const float iscale = amax != 0.0f ? -127.0f / max : 0.0f;
    d[b] = amax != 0.0f ? 1.0f / iscale : 0.0f;
    for (int g = 0; g < 16; ++g) {
      int32_t sum = 0;
      for (int i = 16 * g; i < 16 * g + 16; ++i) {
        const int32_t value = std::min(127, RoundHalfEven(iscale * v[i]));
        q[256 * b + i] = static_cast<int8_t>(value);
        sum += value;
      }
      sum16[16 * b + g] = sum;
    }
  }
}

#if defined(__AVX2__)
// 32 bytes (weights or x's q) in a register; `Lanes` 8 int32 partial sums; `Sums` 8 floats.
typedef __m256i Bytes;
typedef __m256i Lanes;
typedef __m256 Sums;

XLASERVE_INLINE Bytes LoadBytes(const void* p) {
  return _mm256_loadu_si256(static_cast<const __m256i*>(p));
}

// Lane i: sum over j < 4 of u[4i + j] * s[4i + j], u unsigned (at most 128 here), s signed.
XLASERVE_INLINE Lanes DotUS(Bytes u, Bytes s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else  // pairs in int16 cannot saturate: |u * s| <= 128 * 127, two of them < 2^15
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// The same for signed w (no -128): |w| times s with w's sign.
XLASERVE_INLINE Lanes DotSS(Bytes w, Bytes s) {
  return DotUS(_mm256_sign_epi8(w, w), _mm256_sign_epi8(s, w));
}

// Lane i: (u . s over bytes 4i..4i+3), each pair of products scaled by the int16 scale of its
// half: `low` for bytes 0-15, `high` for 16-31 (u at most 63: the pairs fit int16).
XLASERVE_INLINE Lanes DotScaled(Bytes u, Bytes s, int16_t low, int16_t high) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                           _mm256_set_m128i(_mm_set1_epi16(high), _mm_set1_epi16(low)));
}

XLASERVE_INLINE Lanes ZeroLanes() { return _mm256_setzero_si256(); }
XLASERVE_INLINE Lanes Add(Lanes a, Lanes b) { return _mm256_add_epi32(a, b); }
XLASERVE_INLINE Sums ZeroSums() { return _mm256_setzero_ps(); }
XLASERVE_INLINE Sums MultiplyAdd(Lanes p, float scale, Sums acc) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(scale), acc);
}
XLASERVE_INLINE float Total(Sums acc) {
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

XLASERVE_INLINE Bytes Low4(Bytes b) { return _mm256_and_si256(b, _mm256_set1_epi8(15)); }
XLASERVE_INLINE Bytes High4(Bytes b) { return Low4(_mm256_srli_epi16(b, 4)); }
// 16 bytes of nibbles -> 32 values: the low nibbles, then the high ones (GGUF's order).
XLASERVE_INLINE Bytes Nibbles(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return Low4(_mm256_set_m128i(_mm_srli_epi16(b, 4), b));
}
// Byte j: 16 where bit j of qh is set, else 0.
XLASERVE_INLINE Bytes FifthBits(uint32_t qh) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int32_t>(qh)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit),
                          _mm256_set1_epi8(16));
}
XLASERVE_INLINE Bytes Or(Bytes a, Bytes b) { return _mm256_or_si256(a, b); }
XLASERVE_INLINE Bytes Minus(Bytes a, int8_t v) { return _mm256_sub_epi8(a, _mm256_set1_epi8(v)); }
// Bits (shift, shift + 1) of every byte of qh moved to bits 4 and 5.
XLASERVE_INLINE Bytes TwoBitsAt4(Bytes qh, int shift) {
  const __m256i moved = shift <= 4 ? _mm256_sll_epi16(qh, _mm_cvtsi32_si128(4 - shift))
                                   : _mm256_srl_epi16(qh, _mm_cvtsi32_si128(shift - 4));
  return _mm256_and_si256(moved, _mm256_set1_epi8(0x30));
}
#else
// Portable: the same operations on plain arrays, summed in scalars.
struct Bytes {
  int8_t v[32];
};
typedef int32_t Lanes;
typedef float Sums;

XLASERVE_INLINE Bytes LoadBytes(const void* p) {
  Bytes b;
  std::memcpy(b.v, p, 32);
  return b;
}
XLASERVE_INLINE Lanes DotUS(Bytes u, Bytes s) {
  int32_t sum = 0;
  for (int i = 0; i < 32; ++i) sum += static_cast<uint8_t>(u.v[i]) * s.v[i];
  return sum;
}
XLASERVE_INLINE Lanes DotSS(Bytes w, Bytes s) {
  int32_t sum = 0;
  for (int i = 0; i < 32; ++i) sum += w.v[i] * s.v[i];
  return sum;
}
XLASERVE_INLINE Lanes DotScaled(Bytes u, Bytes s, int16_t low, int16_t high) {
  int32_t halves[2] = {0, 0};
  for (int i = 0; i < 32; ++i) halves[i / 16] += static_cast<uint8_t>(u.v[i]) * s.v[i];
  return halves[0] * low + halves[1] * high;
}
XLASERVE_INLINE Lanes ZeroLanes() { return 0; }
XLASERVE_INLINE Lanes Add(Lanes a, Lanes b) { return a + b; }
XLASERVE_INLINE Sums ZeroSums() { return 0.0f; }
XLASERVE_INLINE Sums MultiplyAdd(Lanes p, float scale, Sums acc) {
  return static_cast<float>(p) * scale + acc;
}
XLASERVE_INLINE float Total(Sums acc) { return acc; }
XLASERVE_INLINE Bytes Low4(Bytes b) {
  for (auto& v : b.v) v = static_cast<int8_t>(static_cast<uint8_t>(v) & 15);
  return b;
}
XLASERVE_INLINE Bytes High4(Bytes b) {
  for (auto& v : b.v) v = static_cast<int8_t>(static_cast<uint8_t>(v) >> 4);
  return b;
}
XLASERVE_INLINE Bytes Nibbles(const uint8_t* p) {
  Bytes b;
  for (int i = 0; i < 16; ++i) {
    b.v[i] = static_cast<int8_t>(p[i] & 15);
    b.v[16 + i] = static_cast<int8_t>(p[i] >> 4);
  }
  return b;
}
XLASERVE_INLINE Bytes FifthBits(uint32_t qh) {
  Bytes b;
  for (int i = 0; i < 32; ++i) b.v[i] = static_cast<int8_t>((qh >> i) & 1 ? 16 : 0);
  return b;
}
XLASERVE_INLINE Bytes Or(Bytes a, Bytes b) {
  for (int i = 0; i < 32; ++i) a.v[i] = static_cast<int8_t>(a.v[i] | b.v[i]);
  return a;
}
XLASERVE_INLINE Bytes Minus(Bytes a, int8_t v) {
  for (auto& x : a.v) x = static_cast<int8_t>(x - v);
  return a;
}
XLASERVE_INLINE Bytes TwoBitsAt4(Bytes qh, int shift) {
  for (auto& v : qh.v) v = static_cast<int8_t>(((static_cast<uint8_t>(v) >> shift) & 3) << 4);
  return qh;
}
#endif

// A weight block of 32 ready to multiply: q signed (kSigned) or unsigned, d, m (Q4_1, Q5_1).
struct Block32 {
  Bytes q;
  float d, m;
};

struct Q8_0 {
  static constexpr int64_t kBlock = 32, kBytes = 34;
  static constexpr bool kSigned = true, kHasMin = false;
  XLASERVE_INLINE static Block32 Prepare(const uint8_t* b) {
    return {LoadBytes(b + 2), HalfToFloat(b), 0.0f};
  }
};
struct Q4_0 {
  static constexpr int64_t kBlock = 32, kBytes = 18;
  static constexpr bool kSigned = true, kHasMin = false;
  XLASERVE_INLINE static Block32 Prepare(const uint8_t* b) {
    return {Minus(Nibbles(b + 2), 8), HalfToFloat(b), 0.0f};
  }
};
struct Q4_1 {
  static constexpr int64_t kBlock = 32, kBytes = 20;
  static constexpr bool kSigned = false, kHasMin = true;
  XLASERVE_INLINE static Block32 Prepare(const uint8_t* b) {
    return {Nibbles(b + 4), HalfToFloat(b), HalfToFloat(b + 2)};
  }
};
struct Q5_0 {
  static constexpr int64_t kBlock = 32, kBytes = 22;
  static constexpr bool kSigned = true, kHasMin = false;
  XLASERVE_INLINE static Block32 Prepare(const uint8_t* b) {
    return {Minus(Or(Nibbles(b + 6), FifthBits(quantized::U32At(b + 2))), 16), HalfToFloat(b),
            0.0f};
  }
};
struct Q5_1 {
  static constexpr int64_t kBlock = 32, kBytes = 24;
  static constexpr bool kSigned = false, kHasMin = true;
  XLASERVE_INLINE static Block32 Prepare(const uint8_t* b) {
    return {Or(Nibbles(b + 8), FifthBits(quantized::U32At(b + 4))), HalfToFloat(b),
            HalfToFloat(b + 2)};
  }
};

// A K-quant block's scales: the integer scale of each of its 16 groups of 16 (a Q4_K sub-block's
// scale twice), its float d, and Q4_K's mins with dmin.
struct BlockK {
  int16_t scale[16];
  int16_t min[8];
  float d, dmin;
};

struct Q4_K {  // f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
  static constexpr int64_t kBlock = 256, kBytes = 144;
  XLASERVE_INLINE static void Prepare(const uint8_t* b, BlockK& out) {
    const uint8_t* s = b + 4;  // ggml's get_scale_min_k4
    for (int j = 0; j < 8; ++j) {
      const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
      out.min[j] = static_cast<int16_t>(j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4));
      out.scale[2 * j] = out.scale[2 * j + 1] = static_cast<int16_t>(sc);
    }
    out.d = HalfToFloat(b);
    out.dmin = HalfToFloat(b + 2);
  }
  // Sub-block j's 32 q (0..15): bytes 32 (j / 2) ... of the nibbles, low for j even.
  XLASERVE_INLINE static Bytes Sub(const uint8_t* b, int j) {
    const Bytes packed = LoadBytes(b + 16 + 32 * (j / 2));
    return j % 2 ? High4(packed) : Low4(packed);
  }
  // The mins' part, less d_x: dmin * sum_j min_j * (x's sum of sub-block j), to subtract.
  XLASERVE_INLINE static float Correction(const BlockK& w, const int32_t* sum16) {
    int32_t total = 0;
    for (int j = 0; j < 8; ++j) total += w.min[j] * (sum16[2 * j] + sum16[2 * j + 1]);
    return w.dmin * static_cast<float>(total);
  }
};

// Q6_K: 128 bytes of low nibbles (ql), 64 of high 2-bit pairs (qh), 16 int8 scales, f16 d.
// Weights 128 h + 32 t + l (h < 2, t < 4, l < 32): the low (t < 2) or high nibble of
// ql[64 h + 32 (t % 2) + l], bits 2t, 2t + 1 of qh[32 h + l] above, minus 32; group (of 16) 8 h +
// 2 t + l / 16 scaled by scales[that group].
struct Q6_K {
  static constexpr int64_t kBlock = 256, kBytes = 210;
  XLASERVE_INLINE static void Prepare(const uint8_t* b, BlockK& out) {
    for (int g = 0; g < 16; ++g) out.scale[g] = static_cast<int8_t>(b[192 + g]);
    out.d = HalfToFloat(b + 208);
    out.dmin = 0.0f;
  }
  XLASERVE_INLINE static Bytes Sub(const uint8_t* b, int j) {  // j = 4 h + t, q unsigned 0..63
    const int h = j / 4, t = j % 4;
    const Bytes ql = LoadBytes(b + 64 * h + 32 * (t % 2));
    return Or(t < 2 ? Low4(ql) : High4(ql), TwoBitsAt4(LoadBytes(b + 128 + 32 * h), 2 * t));
  }
  XLASERVE_INLINE static float Correction(const BlockK& w, const int32_t* sum16) {
    int32_t total = 0;
    for (int g = 0; g < 16; ++g) total += w.scale[g] * sum16[g];
    return w.d * static_cast<float>(32 * total);
  }
};

}  // namespace xlaserve::q8
