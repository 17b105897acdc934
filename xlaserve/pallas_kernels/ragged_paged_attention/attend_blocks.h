// The general path of the CPU attention kernel: one sequence's block of up to kQueryBlock query
// rows per work item, any head dim.
#pragma once

#include "attention_common.h"

namespace xlaserve::attention_cpu {

// The inner loops work on 16-float vectors and on blocks of up to 4 query rows that read the
// same kv head, so each K or V chunk is loaded once for the block and the rows' sums are
// independent chains. (A plain `omp simd reduction` dot summed its 16 lanes one by one through
// the stack: 16 dependent adds per dot, the kernel's bottleneck.)
constexpr int kRowBlock = 4;

// scores[g * stride] = q[g] . k for N rows q (stride d) and one key k; d is a multiple of 16.
template <int N>
void ScoreBlock(const float* q, int64_t d, const float* k, float* scores, int64_t stride) {
  Vec16 acc[N] = {};
  for (int64_t x = 0; x < d; x += 16) {
    const Vec16 kx = Load16(k + x);
    for (int g = 0; g < N; ++g) acc[g] += Load16(q + g * d + x) * kx;
  }
  for (int g = 0; g < N; ++g) scores[g * stride] = Sum16(acc[g]);
}

// Scores of N rows q against a whole tile of keys held transposed (keys_t[x][j], kKeyTile
// columns): each key chunk is loaded once for the N rows. kKeyTile is a multiple of 16.
template <int N>
void ScoreTileBlock(const float* q, int64_t d, const float* keys_t, float* scores) {
  constexpr int kChunks = kKeyTile / 16;
  Vec16 acc[N][kChunks] = {};
  for (int64_t x = 0; x < d; ++x) {
    Vec16 kx[kChunks];
    for (int c = 0; c < kChunks; ++c) kx[c] = Load16(keys_t + x * kKeyTile + 16 * c);
    for (int g = 0; g < N; ++g) {
      const float qx = q[g * d + x];
      for (int c = 0; c < kChunks; ++c) acc[g][c] += qx * kx[c];
    }
  }
  for (int g = 0; g < N; ++g)
    for (int c = 0; c < kChunks; ++c) Store16(scores + g * kKeyTile + 16 * c, acc[g][c]);
}

void ScoreTileRows(const float* q, int64_t rows, int64_t d, const float* keys_t, float* scores) {
  for (int64_t b = 0; b < rows; b += kRowBlock) {
    const float* qb = q + b * d;
    float* sb = scores + b * kKeyTile;
    switch (std::min<int64_t>(kRowBlock, rows - b)) {
      case 1: ScoreTileBlock<1>(qb, d, keys_t, sb); break;
      case 2: ScoreTileBlock<2>(qb, d, keys_t, sb); break;
      case 3: ScoreTileBlock<3>(qb, d, keys_t, sb); break;
      default: ScoreTileBlock<4>(qb, d, keys_t, sb); break;
    }
  }
}

// acc[g] += sum_j probs[g][j] v_j for N rows (stride d), the values at key_rows[j] + offset.
template <int N>
void AccumulateBlock(float* acc, int64_t d, const float* const* key_rows, int64_t offset, int64_t n,
                     const float* probs, int64_t prob_stride) {
  for (int64_t x = 0; x < d; x += 16) {
    Vec16 a[N];
    for (int g = 0; g < N; ++g) a[g] = Load16(acc + g * d + x);
    for (int64_t j = 0; j < n; ++j) {
      const Vec16 vx = Load16(key_rows[j] + offset + x);
      for (int g = 0; g < N; ++g) a[g] += probs[g * prob_stride + j] * vx;
    }
    for (int g = 0; g < N; ++g) Store16(acc + g * d + x, a[g]);
  }
}

// Rows [0, rows) in blocks of up to kRowBlock; scores/probs have kKeyTile columns per row.
// Scores one key (column j of `scores`).
void ScoreRows(const float* q, int64_t rows, int64_t d, const float* k, float* scores) {
  for (int64_t b = 0; b < rows; b += kRowBlock) {
    const float* qb = q + b * d;
    float* sb = scores + b * kKeyTile;
    switch (std::min<int64_t>(kRowBlock, rows - b)) {
      case 1: ScoreBlock<1>(qb, d, k, sb, kKeyTile); break;
      case 2: ScoreBlock<2>(qb, d, k, sb, kKeyTile); break;
      case 3: ScoreBlock<3>(qb, d, k, sb, kKeyTile); break;
      default: ScoreBlock<4>(qb, d, k, sb, kKeyTile); break;
    }
  }
}

void AccumulateRows(float* acc, int64_t rows, int64_t d, const float* const* key_rows,
                    int64_t offset, int64_t n, const float* probs) {
  for (int64_t b = 0; b < rows; b += kRowBlock) {
    float* ab = acc + b * d;
    const float* pb = probs + b * kKeyTile;
    switch (std::min<int64_t>(kRowBlock, rows - b)) {
      case 1: AccumulateBlock<1>(ab, d, key_rows, offset, n, pb, kKeyTile); break;
      case 2: AccumulateBlock<2>(ab, d, key_rows, offset, n, pb, kKeyTile); break;
      case 3: AccumulateBlock<3>(ab, d, key_rows, offset, n, pb, kKeyTile); break;
      default: AccumulateBlock<4>(ab, d, key_rows, offset, n, pb, kKeyTile); break;
    }
  }
}

// The same for any d, one row at a time.
void ScoreRowsScalar(const float* q, int64_t rows, int64_t d, const float* k, float* scores) {
  for (int64_t i = 0; i < rows; ++i) {
    float dot = 0.0f;
    for (int64_t x = 0; x < d; ++x) dot += q[i * d + x] * k[x];
    scores[i * kKeyTile] = dot;
  }
}

void AccumulateRowsScalar(float* acc, int64_t rows, int64_t d, const float* const* key_rows,
                          int64_t offset, int64_t n, const float* probs) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < n; ++j)
      for (int64_t x = 0; x < d; ++x) acc[i * d + x] += probs[i * kKeyTile + j] * key_rows[j][offset + x];
}


// One sequence's block of query rows, all heads. Row i of the scratch is (query row i / Hq,
// query head i % Hq); query head hq reads kv head hq / G (GQA). Keys are visited tile by tile in
// position order, each token's cache row (every head's K and V, contiguous) read once.
template <typename T, typename C = T>  // C: the cache's entries (T's, or FP8)
void Attend(const Problem& p, const WorkItem& item, const WorkItem* /*following*/,
            Scratch& scratch) {
  const int64_t d = p.head_dim, hq_count = p.num_q_heads, group = p.num_q_heads / p.num_kv_heads;
  const int64_t rows = item.num_rows * hq_count, token_row = 2 * p.num_kv_heads * d;
  const T* q = static_cast<const T*>(p.q);
  const C* cache = static_cast<const C*>(p.cache);
  T* out = static_cast<T*>(p.out);
  SeqSpan span = Span(p, item.seq);
  const int64_t first_pos = span.first_pos + (item.first_row - span.first_token);
  const int64_t last_pos = first_pos + item.num_rows - 1;
  const int64_t lowest_key = FirstKey(p, first_pos);  // the item's rows' first keys rise with them
  const bool transposed = item.num_rows * group >= kTransposeRows;

  float* qs = scratch.q.data();
  float* acc = scratch.acc.data();
  float* m = scratch.m.data();
  float* l = scratch.l.data();
  float* scores = scratch.scores.data();
  float* keys_t = scratch.keys_t.data();
  LoadRow<T>(q + item.first_row * hq_count * d, qs, rows * d);
#pragma omp simd
  for (int64_t x = 0; x < rows * d; ++x) qs[x] *= p.sm_scale;
  std::fill(acc, acc + rows * d, 0.0f);
  StartSums(p, rows, m, l);

  const bool vectors = d % 16 == 0;
  auto* score_rows = vectors ? ScoreRows : ScoreRowsScalar;
  auto* accumulate_rows = vectors ? AccumulateRows : AccumulateRowsScalar;
  const float* key_rows[kKeyTile];
  bool key_ok[kKeyTile];
  for (int64_t tile_start = lowest_key; tile_start <= last_pos; tile_start += kKeyTile) {
    const int64_t n = std::min<int64_t>(kKeyTile, last_pos - tile_start + 1);
    for (int64_t j = 0; j < n; ++j) {
      int64_t row = TokenRow(p, item.seq, tile_start + j);
      key_ok[j] = row >= 0;  // a page id outside the pool: the key is masked out
      key_rows[j] = KeyRow<C>(cache, key_ok[j] ? row : -1, token_row, scratch, j);
    }
    // While this tile computes, ask for the next tile's rows, one row per key scored: a page is
    // only 16-64 rows, too short for the hardware prefetcher to ramp up on its own, and one burst
    // of requests for a whole tile stalls on the core's few outstanding misses.
    const int64_t row_bytes = token_row * static_cast<int64_t>(sizeof(C));
    auto prefetch_next = [&](int64_t j) {
      const int64_t pos = tile_start + kKeyTile + j;
      if (pos > last_pos) return;
      const int64_t row = TokenRow(p, item.seq, pos);
      if (row < 0) return;
      const char* bytes = reinterpret_cast<const char*>(cache + row);
      for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(bytes + b, 0, 2);
    };
    // scores[i][j] = q_i . k_j, for the kv head of row i
    if (transposed) {
      for (int64_t j = 0; j < kKeyTile; ++j) prefetch_next(j);
      for (int64_t h = 0; h < p.num_kv_heads; ++h) {
        for (int64_t j = 0; j < n; ++j)
          for (int64_t x = 0; x < d; ++x) keys_t[x * kKeyTile + j] = key_rows[j][2 * h * d + x];
        for (int64_t r = 0; r < item.num_rows; ++r) {
          const int64_t i = r * hq_count + h * group;
          ScoreTileRows(qs + i * d, group, d, keys_t, scores + i * kKeyTile);
        }
      }
    } else {
      // Key by key, every head of a key at once: each token's cache row is read front to back
      // in one go, which the hardware prefetcher follows (head by head over the tile read it in
      // 256-byte strides, at a third of the memory bandwidth).
      for (int64_t j = 0; j < n; ++j) {
        prefetch_next(j);
        for (int64_t r = 0; r < item.num_rows; ++r)
          for (int64_t h = 0; h < p.num_kv_heads; ++h) {
            const int64_t i = r * hq_count + h * group;
            score_rows(qs + i * d, group, d, key_rows[j] + 2 * h * d, scores + i * kKeyTile + j);
          }
      }
    }
    // Online softmax over this tile, row by row; masked keys get probability exactly 0.
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t pos = first_pos + i / hq_count;
      // keys [FirstKey(pos), pos]: the window's or the chunk's
      const int64_t lo = std::max<int64_t>(0, FirstKey(p, pos) - tile_start);
      const int64_t hi = std::min<int64_t>(n, pos - tile_start + 1);
      float* s = scores + i * kKeyTile;
      float live[kKeyTile];
      float tile_max = -INFINITY;
      for (int64_t j = 0; j < kKeyTile; ++j) {
        live[j] = (j >= lo && j < hi && key_ok[j]) ? 1.0f : 0.0f;
        if (live[j] == 0.0f) continue;
        if (p.soft_cap > 0) s[j] = p.soft_cap * std::tanh(s[j] / p.soft_cap);
        tile_max = std::max(tile_max, s[j]);
      }
      if (tile_max == -INFINITY) {  // nothing to attend to here
        std::fill(s, s + kKeyTile, 0.0f);
        continue;
      }
      const float new_max = std::max(m[i], tile_max);
      const float alpha = m[i] == -INFINITY ? 0.0f : ExpNonPositive(m[i] - new_max);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < kKeyTile; ++j) {
        // Masked lanes may hold stale scores (NaN included): pin them to 0 before the exp.
        const float x = live[j] != 0.0f ? s[j] - new_max : 0.0f;
        const float prob = ExpNonPositive(x) * live[j];
        s[j] = prob;
        sum += prob;
      }
      m[i] = new_max;
      l[i] = l[i] * alpha + sum;
      float* a = acc + i * d;
#pragma omp simd
      for (int64_t x = 0; x < d; ++x) a[x] *= alpha;
    }
    // acc[i] += sum_j p[i][j] v_j
    for (int64_t r = 0; r < item.num_rows; ++r)
      for (int64_t h = 0; h < p.num_kv_heads; ++h) {
        const int64_t i = r * hq_count + h * group;
        accumulate_rows(acc + i * d, group, d, key_rows, (2 * h + 1) * d, n, scores + i * kKeyTile);
      }
  }
  for (int64_t i = 0; i < rows; ++i) {
    float* a = acc + i * d;
    const float inv = l[i] > 0 ? 1.0f / l[i] : 0.0f;
#pragma omp simd
    for (int64_t x = 0; x < d; ++x) a[x] *= inv;
  }
  StoreRow<T>(acc, out + item.first_row * hq_count * d, rows * d);
}
}  // namespace xlaserve::attention_cpu
