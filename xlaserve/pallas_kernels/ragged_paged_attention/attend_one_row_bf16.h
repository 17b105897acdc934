// Work items of one query row on a bfloat16 cache, with VDPBF16PS (CPUs with AVX512_BF16).
#pragma once

#ifdef __AVX512BF16__
#include <immintrin.h>

#include "attention_common.h"

namespace xlaserve::attention_cpu {

// --- items of one query row, bfloat16, VDPBF16PS ---------------------------------------------
//
// With a bfloat16 cache on a CPU with AVX512_BF16 the dot products run on the bfloat16 data as
// stored: VDPBF16PS multiplies 32 bfloat16 pairs into 16 float32 sums per instruction, and no
// cache row is widened to float32 first (the widening path spent about a fifth of its time
// converting rows, and most of the rest on float32 multiply-adds at half the rate). The query
// heads of a GQA group are scored together (up to kHeadBlock at once), so each key vector loaded
// serves all of them. The value sum multiplies probabilities rounded to bfloat16 -- what the
// reference does (`p.astype(v.dtype)`) -- by the values of two neighbouring keys interleaved into
// pairs. Head dims that are a multiple of 32, up to 128.
constexpr int kHeadBlock = 3;  // 3 heads x 8 keys = 24 score accumulators of the 32 registers

inline Vec8 Fold(__m512 v) {  // the 16 lanes summed pairwise into 8
  const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return _mm512_castps512_ps256(v) + high;
}

// s[g] = {q_g . k_j, j < 8} for N query heads g (rows `q_stride` apart) and the 8 keys at
// key_rows[j] + offset; the head dim is 32 * C.
template <int N, int C>
inline void ScoreKeys8(const uint16_t* q, int64_t q_stride, const uint16_t* const* key_rows,
                       int64_t offset, Vec8* s) {
  __m512 acc[N][8];
  for (int g = 0; g < N; ++g)
    for (int j = 0; j < 8; ++j) acc[g][j] = _mm512_setzero_ps();
  for (int c = 0; c < C; ++c) {
    __m512bh qc[N];
    for (int g = 0; g < N; ++g) qc[g] = (__m512bh)_mm512_loadu_si512(q + g * q_stride + 32 * c);
    for (int j = 0; j < 8; ++j) {
      const __m512bh k = (__m512bh)_mm512_loadu_si512(key_rows[j] + offset + 32 * c);
      for (int g = 0; g < N; ++g) acc[g][j] = _mm512_dpbf16_ps(acc[g][j], qc[g], k);
    }
  }
  for (int g = 0; g < N; ++g) {
    Vec8 folded[8];
    for (int j = 0; j < 8; ++j) folded[j] = Fold(acc[g][j]);
    s[g] = Sums8(folded);
  }
}

// out_g = out_g * alpha[g] + sum_j p_g[j] v_j for N heads over the 16 keys of a tile, the values
// at key_rows[j] + offset. prob_pairs[g][t] holds p_g[2t] and p_g[2t + 1] as bfloat16 (low half
// first). out_g is kept in *pair order*: per 32 dims, VPUNPCK{L,H}WD interleave the two keys'
// values within 128-bit lanes, so the first 16 floats hold dims {0-3, 8-11, 16-19, 24-27} and the
// next 16 dims {4-7, 12-15, 20-23, 28-31} (`FromPairOrder` puts them back).
template <int N, int C>
inline void AccumulatePairs(float* out, int64_t out_stride, const float* alpha,
                            const uint16_t* const* key_rows, int64_t offset,
                            const uint32_t (*prob_pairs)[kRowTile / 2]) {
  for (int c = 0; c < C; ++c) {
    __m512 lo[N], hi[N];
    for (int g = 0; g < N; ++g) {
      const __m512 scale = _mm512_set1_ps(alpha[g]);
      lo[g] = _mm512_mul_ps(_mm512_loadu_ps(out + g * out_stride + 32 * c), scale);
      hi[g] = _mm512_mul_ps(_mm512_loadu_ps(out + g * out_stride + 32 * c + 16), scale);
    }
    for (int t = 0; t < kRowTile / 2; ++t) {
      const __m512i a = _mm512_loadu_si512(key_rows[2 * t] + offset + 32 * c);
      const __m512i b = _mm512_loadu_si512(key_rows[2 * t + 1] + offset + 32 * c);
      const __m512bh low_pairs = (__m512bh)_mm512_unpacklo_epi16(a, b);
      const __m512bh high_pairs = (__m512bh)_mm512_unpackhi_epi16(a, b);
      for (int g = 0; g < N; ++g) {
        const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(prob_pairs[g][t]));
        lo[g] = _mm512_dpbf16_ps(lo[g], p, low_pairs);
        hi[g] = _mm512_dpbf16_ps(hi[g], p, high_pairs);
      }
    }
    for (int g = 0; g < N; ++g) {
      _mm512_storeu_ps(out + g * out_stride + 32 * c, lo[g]);
      _mm512_storeu_ps(out + g * out_stride + 32 * c + 16, hi[g]);
    }
  }
}

// dst[0:32] in dim order from src[0:32] in pair order, divided by `sum`, as bfloat16 (round to
// nearest even, as XLA's convert).
inline void FromPairOrder(const float* src, float sum, uint16_t* dst) {
  const __m512 lo = _mm512_loadu_ps(src), hi = _mm512_loadu_ps(src + 16);
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29,
                                           30, 31);
  const __m512 divisor = _mm512_set1_ps(sum);
  const __m512 x0 = _mm512_div_ps(_mm512_permutex2var_ps(lo, first, hi), divisor);
  const __m512 x1 = _mm512_div_ps(_mm512_permutex2var_ps(lo, second, hi), divisor);
  _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(x1, x0));
}

// The query heads [first, first + N) of kv head h (one GQA group or part of it) over one tile:
// scores, online softmax (m, l, and the running sums in `acc`), value sum.
template <int N, int C>
void AttendHeadsBf16(const Problem& p, const uint16_t* q, int64_t first, int64_t h,
                     const uint16_t* const* key_rows, const Vec8 (&live)[2], float* acc,
                     float* m, float* l) {
  const int64_t d = 32 * C;
  Vec8 s[2][N];
  ScoreKeys8<N, C>(q + first * d, d, key_rows, 2 * h * d, s[0]);
  ScoreKeys8<N, C>(q + first * d, d, key_rows + 8, 2 * h * d, s[1]);
  float alpha[N];
  uint32_t prob_pairs[N][kRowTile / 2];
  for (int g = 0; g < N; ++g) {
    const int64_t hq = first + g;
    Vec8 x[2] = {s[0][g] * p.sm_scale, s[1][g] * p.sm_scale};
    if (p.soft_cap > 0)
      for (int half = 0; half < 2; ++half)
        for (int j = 0; j < 8; ++j) x[half][j] = p.soft_cap * std::tanh(x[half][j] / p.soft_cap);
    // Dead lanes may hold anything (a zero row's score, or NaN through the soft cap).
    for (int half = 0; half < 2; ++half)
      x[half] = live[half] > Splat8(0.0f) ? x[half] : Splat8(-INFINITY);
    const float new_max = std::max(m[hq], std::max(Max8(x[0]), Max8(x[1])));
    alpha[g] = m[hq] == -INFINITY ? 0.0f : ExpNonPositive(m[hq] - new_max);
    float probs[kRowTile];
    for (int half = 0; half < 2; ++half) {
      const Vec8 shifted = live[half] > Splat8(0.0f) ? x[half] - new_max : Splat8(0.0f);
      Store8(probs + 8 * half, live[half] > Splat8(0.0f) ? ExpNonPositive(shifted) : Splat8(0.0f));
    }
    m[hq] = new_max;
    l[hq] = l[hq] * alpha[g] + Sum8(Load8(probs) + Load8(probs + 8));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(prob_pairs[g]),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(probs)));
  }
  AccumulatePairs<N, C>(acc + first * d, d, alpha, key_rows, (2 * h + 1) * d, prob_pairs);
}

template <int C>
void AttendOneRowBf16(const Problem& p, const WorkItem& item, const WorkItem* following,
                      Scratch& scratch) {
  const int64_t d = 32 * C, hq_count = p.num_q_heads, group = p.num_q_heads / p.num_kv_heads;
  const int64_t token_row = 2 * p.num_kv_heads * d;
  const uint16_t* q = static_cast<const uint16_t*>(p.q) + item.first_row * hq_count * d;
  const uint16_t* cache = static_cast<const uint16_t*>(p.cache);
  const uint16_t* zero_row = reinterpret_cast<const uint16_t*>(scratch.zeros.data());
  uint16_t* out = static_cast<uint16_t*>(p.out) + item.first_row * hq_count * d;
  const auto [pos, lowest_key] = OneRow(p, item, scratch);
  float* acc = scratch.acc.data();
  float* m = scratch.m.data();
  float* l = scratch.l.data();

  const uint16_t* key_rows[kRowTile];
  const int64_t row_bytes = token_row * static_cast<int64_t>(sizeof(uint16_t));
  for (int64_t tile_start = lowest_key; tile_start <= pos; tile_start += kRowTile) {
    KeyTile tile(p, item.seq, tile_start, pos);
    tile.NextIsFirstOf(p, following);
    if (!tile.any_live) continue;
    // Dead lanes read a row of zeros: no NaN reaches the value sum.
    for (int64_t j = 0; j < kRowTile; ++j)
      key_rows[j] = tile.rows[j] >= 0 ? cache + tile.rows[j] : zero_row;
    const Vec8 live[2] = {Load8(tile.live), Load8(tile.live + 8)};
    for (int64_t h = 0; h < p.num_kv_heads; ++h) {
      tile.PrefetchNext(cache, (h + 1) * kRowTile / p.num_kv_heads, row_bytes);
      for (int64_t g = 0; g < group; g += kHeadBlock) {
        const int64_t first = h * group + g;
        switch (std::min<int64_t>(kHeadBlock, group - g)) {
          case 1: AttendHeadsBf16<1, C>(p, q, first, h, key_rows, live, acc, m, l); break;
          case 2: AttendHeadsBf16<2, C>(p, q, first, h, key_rows, live, acc, m, l); break;
          default: AttendHeadsBf16<3, C>(p, q, first, h, key_rows, live, acc, m, l); break;
        }
      }
    }
  }
  for (int64_t hq = 0; hq < hq_count; ++hq)
    // A prefix_only row without keys has l = 0 and acc = 0: it comes out 0, not 0 / 0.
    for (int c = 0; c < C; ++c)
      FromPairOrder(acc + hq * d + 32 * c, l[hq] > 0 ? l[hq] : 1.0f, out + hq * d + 32 * c);
  StoreLse(p, item, m, l);
}
}  // namespace xlaserve::attention_cpu
#endif  // __AVX512BF16__
