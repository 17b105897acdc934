// Work items of one query row (a decoding sequence) or a block of a prefill's rows, every head
// (head dims that are a multiple of 8), for a float32 cache or a bfloat16 or FP8 one widened to
// float32.
#pragma once

#include "attention_common.h"

namespace xlaserve::attention_cpu {

// --- items of one query row, every head ---------------------------------------------------
//
// A decoding sequence has one query row per head, and the general path above scores key by key with
// a horizontal sum per (head, key) and runs its softmax and value loop one key at a time: about
// 150 cycles per (query head, key) on an AVX2 core, 20x the arithmetic. Here a tile of 16 keys is
// scored as 16 dot products in independent accumulators whose horizontal sums come out together
// (`Sums8`), the softmax runs on 8-lane vectors, and the value sum keeps 64 floats of the head's
// output row in registers. Prefill rows run the same way, up to kPrefillRows of them an item, each
// key tile read once for them (a block of rows scored through transposed key tiles, the general
// path, was 4-8x slower). Takes head dims that are a multiple of 8; others take the general path.

// scores[j] = q . key_rows[j][offset:offset + d] for the 16 keys of a tile.
inline void ScoreTile16(const float* q, int64_t d, const float* const* key_rows, int64_t offset,
                        Vec8* scores) {
  for (int half = 0; half < 2; ++half) {
    Vec8 acc[8] = {};
    const float* const* rows = key_rows + 8 * half;
    for (int64_t x = 0; x < d; x += 8) {
      const Vec8 qx = Load8(q + x);
      for (int j = 0; j < 8; ++j) acc[j] += qx * Load8(rows[j] + offset + x);
    }
    scores[half] = Sums8(acc);
  }
}

// acc[x0:x0 + 8C] = acc * alpha + sum_j probs[j] * key_rows[j][offset + x0:...], in registers.
template <int C>
inline void AccumulateChunks(float* acc, int64_t x0, float alpha, const float* const* key_rows,
                             int64_t offset, int64_t n, const float* probs) {
  Vec8 o[C];
  for (int c = 0; c < C; ++c) o[c] = Load8(acc + x0 + 8 * c) * alpha;
  for (int64_t j = 0; j < n; ++j) {
    const float* v = key_rows[j] + offset + x0;
    const Vec8 pj = Splat8(probs[j]);
    for (int c = 0; c < C; ++c) o[c] += pj * Load8(v + 8 * c);
  }
  for (int c = 0; c < C; ++c) Store8(acc + x0 + 8 * c, o[c]);
}

// acc[0:d] = acc * alpha + sum_j probs[j] * key_rows[j][offset:offset + d]: 64 floats at a time
// (8 accumulators), then 8 at a time.
inline void AccumulateTile(float* acc, int64_t d, float alpha, const float* const* key_rows,
                           int64_t offset, int64_t n, const float* probs) {
  int64_t x0 = 0;
  for (; x0 + 64 <= d; x0 += 64) AccumulateChunks<8>(acc, x0, alpha, key_rows, offset, n, probs);
  for (; x0 < d; x0 += 8) AccumulateChunks<1>(acc, x0, alpha, key_rows, offset, n, probs);
}

// One query head of one row against a tile of keys (key_rows[j] + k_offset, + v_offset its
// value; `live` lanes 0 are not attended): the scores, the online softmax's update of m and l,
// and acc[0:d] = acc * alpha + probs . values.
inline void TileHead(const Problem& p, const float* q, const float* const* key_rows,
                     int64_t k_offset, int64_t v_offset, int64_t n, const Vec8 (&live)[2],
                     float& m, float& l, float* acc) {
  const int64_t d = p.head_dim;
  Vec8 s[2];
  ScoreTile16(q, d, key_rows, k_offset, s);
  if (p.soft_cap > 0)
    for (int half = 0; half < 2; ++half)
      for (int j = 0; j < 8; ++j) s[half][j] = p.soft_cap * std::tanh(s[half][j] / p.soft_cap);
  // Dead lanes may hold anything (a zero row's score, or NaN through the soft cap).
  for (int half = 0; half < 2; ++half) s[half] = live[half] > Splat8(0.0f) ? s[half] : Splat8(-INFINITY);
  const float tile_max = std::max(Max8(s[0]), Max8(s[1]));
  if (tile_max == -INFINITY) return;  // no live key in this tile
  const float new_max = std::max(m, tile_max);
  const float alpha = m == -INFINITY ? 0.0f : ExpNonPositive(m - new_max);
  float probs[kRowTile];
  for (int half = 0; half < 2; ++half) {
    const Vec8 x = live[half] > Splat8(0.0f) ? s[half] - new_max : Splat8(0.0f);
    Store8(probs + 8 * half, live[half] > Splat8(0.0f) ? ExpNonPositive(x) : Splat8(0.0f));
  }
  m = new_max;
  l = l * alpha + Sum8(Load8(probs) + Load8(probs + 8));
  AccumulateTile(acc, d, alpha, key_rows, v_offset, n, probs);
}

// An item of consecutive query rows of one sequence, every head: a decoding row alone, or up to
// kPrefillRows rows of a prefill, which share each tile of keys (read once for the block, not once
// a row: one-row items streamed a long prompt's whole prefix from L3 for every row, 81% of a
// 5,721-token prompt's time on a 2-core Zen 5; with blocks of 8 rows its time to first token went
// from 16.1 to 13.4 s, 16 rows the same). Tiles sit on multiples of kRowTile, whatever the block,
// so a row's sums do not depend on the rows beside it.
template <typename T, typename C = T>  // C: the cache's entries (T's, or FP8)
void AttendOneRow(const Problem& p, const WorkItem& item, const WorkItem* following,
                  Scratch& scratch) {
  const int64_t d = p.head_dim, hq_count = p.num_q_heads, group = p.num_q_heads / p.num_kv_heads;
  const int64_t token_row = 2 * p.num_kv_heads * d, width = hq_count * d, rows = item.num_rows;
  const T* q = static_cast<const T*>(p.q);
  const C* cache = static_cast<const C*>(p.cache);
  T* out = static_cast<T*>(p.out);
  int64_t last[kQueryBlock], lowest[kQueryBlock], first_key = 0, final_key = -1;
  for (int64_t r = 0; r < rows; ++r) {
    const RowKeys keys(p, WorkItem{item.seq, item.first_row + static_cast<int32_t>(r), 1});
    last[r] = keys.last_key;
    lowest[r] = keys.lowest_key;
    first_key = r == 0 ? keys.lowest_key : std::min(first_key, keys.lowest_key);
    final_key = std::max(final_key, keys.last_key);
  }
  float* qs = scratch.q.data();
  float* acc = scratch.acc.data();
  float* m = scratch.m.data();
  float* l = scratch.l.data();
  std::fill(acc, acc + rows * width, 0.0f);
  StartSums(p, rows * hq_count, m, l);
  LoadRow<T>(q + item.first_row * width, qs, rows * width);
  for (int64_t x = 0; x < rows * width; ++x) qs[x] *= p.sm_scale;

  const float* key_rows[kRowTile];
  const int64_t row_bytes = token_row * static_cast<int64_t>(sizeof(C));
  for (int64_t tile_start = first_key / kRowTile * kRowTile; tile_start <= final_key;
       tile_start += kRowTile) {
    const int64_t n = std::min<int64_t>(kRowTile, final_key - tile_start + 1);
    KeyTile tile(p, item.seq, tile_start, final_key);
    tile.NextIsFirstOf(p, following);
    for (int64_t j = 0; j < kRowTile; ++j)
      key_rows[j] = KeyRow<C>(cache, tile.rows[j], token_row, scratch, j);
    const int64_t steps = rows * hq_count;
    for (int64_t r = 0; r < rows; ++r) {
      if (tile_start > last[r] || tile_start + kRowTile <= lowest[r]) continue;
      float live_row[kRowTile];
      for (int64_t j = 0; j < kRowTile; ++j) {
        const int64_t key = tile_start + j;
        live_row[j] = tile.live[j] > 0 && key <= last[r] && key >= lowest[r] ? 1.0f : 0.0f;
      }
      const Vec8 live[2] = {Load8(live_row), Load8(live_row + 8)};
      for (int64_t hq = 0; hq < hq_count; ++hq) {
        tile.PrefetchNext(cache, (r * hq_count + hq + 1) * kRowTile / steps, row_bytes);
        const int64_t h = hq / group, at = r * hq_count + hq;
        TileHead(p, qs + at * d, key_rows, 2 * h * d, (2 * h + 1) * d, n, live, m[at], l[at],
                 acc + at * d);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t hq = 0; hq < hq_count; ++hq) {
      const int64_t at = r * hq_count + hq;
      const float inv = l[at] > 0 ? 1.0f / l[at] : 0.0f;
      for (int64_t x = 0; x < d; ++x) acc[at * d + x] *= inv;
    }
    StoreRow<T>(acc + r * width, out + (item.first_row + r) * width, width);
    StoreLse(p, WorkItem{item.seq, item.first_row + static_cast<int32_t>(r), 1},
             m + r * hq_count, l + r * hq_count);
  }
}
}  // namespace xlaserve::attention_cpu
