// Multi-head latent attention items on a bfloat16 cache with VDPBF16PS (CPUs with AVX512_BF16):
// attend_latent.h's item loop with bfloat16 pairs in place of float32 arithmetic.
#pragma once

#ifdef __AVX512BF16__
#include <immintrin.h>

#include "attend_latent.h"
#include "attend_one_row_bf16.h"  // FromPairOrder

namespace xlaserve::attention_cpu {

// --- multi-head latent attention, bfloat16 pairs -------------------------------------------
//
// VDPBF16PS multiplies 32 bfloat16 pairs into 16 float32 sums, on the rows as stored: half the
// instructions of the float32 arithmetic. (On the Sapphire Rapids VM measured it issued every
// other cycle, a 512-bit FMA every cycle, so a tile took 6.6 us here against 7.1 us widened; a
// CPU that issues it as fast as an FMA gains twice as much.) Scores: the query heads' lanes hold
// pairs of neighbouring dims (q_h[2x], q_h[2x+1]), times one broadcast pair of the key's row.
// Values: as in AttendOneRowBf16, the probabilities rounded to bfloat16 (the reference's
// `p.astype(v.dtype)`) in pairs of neighbouring keys, times those keys' values interleaved into
// pairs -- here once per tile, for every head (`value_pairs`), with the output sums in pair order
// (`FromPairOrder`). Needs an even Dk and a value_dim that is a multiple of 32
// (`PairedLatent::Fits`; DeepSeek's 576 and 512).

// s[j] += {q_h[2 x0:2 x1] . key_rows[j][2 x0:2 x1] for the block's 16 heads h}, K keys;
// q_pairs: the block's [Dk / 2][kLanes] bfloat16 pairs.
template <int K>
inline void ScoreKeyPairs(const uint32_t* q_pairs, int64_t x0, int64_t x1,
                          const uint16_t* const* key_rows, Vec16* s) {
  __m512 acc[K];
  for (int j = 0; j < K; ++j) std::memcpy(acc + j, s + j, sizeof(Vec16));
  for (int64_t x = x0; x < x1; ++x) {
    const __m512bh qx = (__m512bh)_mm512_loadu_si512(q_pairs + kLanes * x);
    for (int j = 0; j < K; ++j) {
      uint32_t key_pair;
      std::memcpy(&key_pair, key_rows[j] + 2 * x, 4);
      acc[j] = _mm512_dpbf16_ps(acc[j], qx, (__m512bh)_mm512_set1_epi32(static_cast<int>(key_pair)));
    }
  }
  for (int j = 0; j < K; ++j) std::memcpy(s + j, acc + j, sizeof(Vec16));
}

// acc_h[x0:x0 + 16V] (pair order) = acc_h * alpha[h] + the tile's value sums for H heads (rows vd
// apart; prob_pairs and alpha start at the first one's lane), over `pairs` pairs of keys.
template <int H, int V>
inline void AccumulateValuePairs(float* acc, int64_t vd, const float* alpha,
                                 const uint32_t* prob_pairs, const uint32_t* value_pairs,
                                 int64_t pairs, int64_t x0) {
  __m512 o[H][V];
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < V; ++c)
      o[h][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + h * vd + x0 + 16 * c), _mm512_set1_ps(alpha[h]));
  for (int64_t t = 0; t < pairs; ++t) {
    __m512bh v[V];
    for (int c = 0; c < V; ++c) v[c] = (__m512bh)_mm512_loadu_si512(value_pairs + t * vd + x0 + 16 * c);
    for (int h = 0; h < H; ++h) {
      const __m512bh pt = (__m512bh)_mm512_set1_epi32(static_cast<int>(prob_pairs[kLanes * t + h]));
      for (int c = 0; c < V; ++c) o[h][c] = _mm512_dpbf16_ps(o[h][c], pt, v[c]);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < V; ++c) _mm512_storeu_ps(acc + h * vd + x0 + 16 * c, o[h][c]);
}

template <int H>
void AccumulateHeadPairs(float* acc, int64_t vd, const float* alpha, const uint32_t* prob_pairs,
                         const uint32_t* value_pairs, int64_t pairs) {
  int64_t x0 = 0;
  for (; x0 + 16 * kValueVecs <= vd; x0 += 16 * kValueVecs)
    AccumulateValuePairs<H, kValueVecs>(acc, vd, alpha, prob_pairs, value_pairs, pairs, x0);
  for (; x0 < vd; x0 += 16)
    AccumulateValuePairs<H, 1>(acc, vd, alpha, prob_pairs, value_pairs, pairs, x0);
}

struct PairedLatent {
  using Element = uint16_t;
  using Cache = uint16_t;
  const Problem& p;
  LatentScratch& scratch;
  const uint16_t* key_rows[kRowTile];
  int64_t pairs = 0;  // pairs of keys in the tile: dead keys past its end are rows of zeros

  static bool Fits(const Problem& p) { return p.head_dim % 2 == 0 && p.value_dim % 32 == 0; }

  PairedLatent(const Problem& p, LatentScratch& scratch, const uint16_t* q) : p(p), scratch(scratch) {
    HeadsToLanes(p.num_q_heads, p.head_dim / 2, scratch.q_pairs.data(), [&](int64_t h, int64_t x) {
      const uint16_t* pair = q + h * p.head_dim + 2 * x;
      return static_cast<uint32_t>(pair[0]) | static_cast<uint32_t>(pair[1]) << 16;
    });
  }

  // The tile's key rows, and their values interleaved key pair by key pair: per 32 dims,
  // VPUNPCK{L,H}WD as AccumulatePairs (attend_one_row_bf16.h) does.
  void LoadTile(const uint16_t* cache, const KeyTile& tile, int64_t n) {
    const uint16_t* zero_row = reinterpret_cast<const uint16_t*>(scratch.zeros.data());
    for (int64_t j = 0; j < kRowTile; ++j)
      key_rows[j] = tile.rows[j] >= 0 ? cache + tile.rows[j] : zero_row;
    pairs = (n + 1) / 2;
    for (int64_t t = 0; t < pairs; ++t) {
      uint32_t* dst = scratch.value_pairs.data() + t * p.value_dim;
      for (int64_t x = 0; x < p.value_dim; x += 32) {
        const __m512i a = _mm512_loadu_si512(key_rows[2 * t] + x);
        const __m512i b = _mm512_loadu_si512(key_rows[2 * t + 1] + x);
        _mm512_storeu_si512(dst + x, _mm512_unpacklo_epi16(a, b));
        _mm512_storeu_si512(dst + x + 16, _mm512_unpackhi_epi16(a, b));
      }
    }
  }

  void Score(int64_t block, int64_t j, int64_t x0, int64_t x1, Vec16* s) const {  // even x0, x1
    ScoreKeyPairs<kScoreKeys>(scratch.q_pairs.data() + block * (p.head_dim / 2) * kLanes, x0 / 2,
                              x1 / 2, key_rows + j, s);
  }

  // The head block's probabilities as bfloat16 pairs of neighbouring keys, every lane: both
  // keys' 16 lanes rounded (VCVTNE2PS2BF16), then interleaved.
  void StartValues() {
    static const uint16_t kInterleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                             8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30,
                                             15, 31};
    const __m512i interleave = _mm512_loadu_si512(kInterleave);
    for (int64_t t = 0; t < pairs; ++t) {
      const float* probs = scratch.probs.data() + 2 * t * kLanes;
      const __m512bh both =
        _mm512_cvtne2ps_pbh(_mm512_loadu_ps(probs + kLanes), _mm512_loadu_ps(probs));
      _mm512_storeu_si512(scratch.prob_pairs.data() + t * kLanes,
                          _mm512_permutexvar_epi16(interleave, (__m512i)both));
    }
  }

  void Accumulate(int64_t head, int64_t heads, int64_t /*n*/, const float* alpha) const {
    float* acc = scratch.acc.data() + head * p.value_dim;
    const uint32_t* probs = scratch.prob_pairs.data() + head % kLanes;
    const uint32_t* values = scratch.value_pairs.data();
    switch (heads) {
      case 1: AccumulateHeadPairs<1>(acc, p.value_dim, alpha, probs, values, pairs); break;
      case 2: AccumulateHeadPairs<2>(acc, p.value_dim, alpha, probs, values, pairs); break;
      case 3: AccumulateHeadPairs<3>(acc, p.value_dim, alpha, probs, values, pairs); break;
      default: AccumulateHeadPairs<kValueHeads>(acc, p.value_dim, alpha, probs, values, pairs); break;
    }
  }

  void Store(uint16_t* out) const {
    for (int64_t h = 0; h < p.num_q_heads; ++h)
      for (int64_t x = 0; x < p.value_dim; x += 32)
        FromPairOrder(scratch.acc.data() + h * p.value_dim + x,
                      scratch.l[h] > 0 ? scratch.l[h] : INFINITY, out + h * p.value_dim + x);
  }
};
}  // namespace xlaserve::attention_cpu
#endif  // __AVX512BF16__
