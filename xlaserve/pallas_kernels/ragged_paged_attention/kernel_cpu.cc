// Ragged paged attention for the CPU, as an XLA FFI custom call (see kernel_cpu.py and the kernel
// contract in DESIGN.md; reference.py is the specification this must equal).
//
// Why native code: XLA's CPU backend runs the jnp reference as gathers, transposes and many tiny
// batched matmuls, which reach 2-4 GB/s; decode attention is a stream over the KV pages and should
// run near memory bandwidth. Here a work item is one query row with all its heads (`AttendOneRow`,
// head dims that are a multiple of 8) or, for other head dims, one sequence's block of up to 16
// query rows (`Attend`); either reads each key's cache row (every kv head's K and V) front to back
// in tiles, with an online softmax in float32. Items are spread over XLA's intra-op pool.
//
// Built by kernel_cpu.py with the host compiler (-O3 -march=native). The inner loops use GCC
// vector extensions (16 floats), which compile to whatever vector registers the CPU has.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "parallel.h"  // xlaserve/native: ParallelFor, Vec16 helpers
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using xlaserve::Bf16ToF32;
using xlaserve::Load16;
using xlaserve::Store16;
using xlaserve::Sum16;
using xlaserve::Vec16;
using xlaserve::Vec8;

constexpr int kKeyTile = 32;       // keys scored together
constexpr int kQueryBlock = 16;    // query rows of one sequence per work item
constexpr int kTransposeRows = 8;  // from this many (row, head) pairs, score against a transposed tile

inline uint16_t F32ToBf16(float f) {  // round to nearest even, as XLA's convert
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

typedef int32_t Vec8i __attribute__((vector_size(32)));

// exp(x) for x <= 0, ~1 ulp (Cephes' polynomial), for a float or an 8-float vector (`Vec8`);
// vectorizes, unlike std::exp without fast-math.
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
    const Vec8i bits = (__builtin_convertvector(n, Vec8i) + 127) << 23;
    std::memcpy(&scale, &bits, sizeof(scale));
  }
  return p * scale;
}

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

struct Problem {
  bool bf16;
  const void* q;
  const void* k;
  const void* v;
  void* cache;  // the output cache (the input's contents, updated)
  void* out;
  int64_t num_tokens, num_q_heads, num_kv_heads, head_dim, num_pages, page_size, max_seqs,
      pages_per_seq;
  const int32_t* kv_lens;
  const int32_t* page_indices;
  const int32_t* cu_q_lens;
  int32_t num_seqs;
  float sm_scale;
  int32_t sliding_window;  // <= 0: none
  float soft_cap;          // <= 0: none
};

struct WorkItem {
  int32_t seq, first_row, num_rows;  // rows are token indices into q; every kv head of them
};

// Sequence s: its new tokens [cu[s], cu[s+1]) sit at positions [kv_len - q_len, kv_len).
struct SeqSpan {
  int64_t first_token, q_len, first_pos;
  bool ok;
};

SeqSpan Span(const Problem& p, int64_t s) {
  int64_t begin = p.cu_q_lens[s], end = p.cu_q_lens[s + 1];
  int64_t kv_len = p.kv_lens[s];
  SeqSpan span{begin, end - begin, kv_len - (end - begin), true};
  // Garbage metadata never reads or writes out of bounds: such a sequence is skipped (output 0).
  span.ok = begin >= 0 && end >= begin && end <= p.num_tokens && span.first_pos >= 0 &&
            kv_len <= p.pages_per_seq * p.page_size;
  return span;
}

// Offset of the cache row (all 2 * kv_heads K/V vectors) of sequence s at position pos, or -1.
inline int64_t TokenRow(const Problem& p, int64_t s, int64_t pos) {
  int64_t page = p.page_indices[s * p.pages_per_seq + pos / p.page_size];
  if (page < 0 || page >= p.num_pages) return -1;
  return (page * p.page_size + pos % p.page_size) * 2 * p.num_kv_heads * p.head_dim;
}

template <typename T>
void LoadRow(const T* src, float* dst, int64_t n);
template <>
void LoadRow<float>(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}
template <>
void LoadRow<uint16_t>(const uint16_t* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = Bf16ToF32(src[i]);
}

template <typename T>
void StoreRow(const float* src, T* dst, int64_t n);
template <>
void StoreRow<float>(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}
template <>
void StoreRow<uint16_t>(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = F32ToBf16(src[i]);
}

// Writes the new tokens' K and V into their pages (before attention, which reads every key from
// the cache, the new ones included).
template <typename T>
void WriteNewKv(const Problem& p) {
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  T* cache = static_cast<T*>(p.cache);
  const int64_t d = p.head_dim;
  for (int64_t s = 0; s < p.num_seqs; ++s) {
    SeqSpan span = Span(p, s);
    if (!span.ok) continue;
    for (int64_t i = 0; i < span.q_len; ++i) {
      int64_t t = span.first_token + i, row = TokenRow(p, s, span.first_pos + i);
      if (row < 0) continue;
      for (int64_t h = 0; h < p.num_kv_heads; ++h) {
        std::memcpy(cache + row + 2 * h * d, k + (t * p.num_kv_heads + h) * d, d * sizeof(T));
        std::memcpy(cache + row + (2 * h + 1) * d, v + (t * p.num_kv_heads + h) * d, d * sizeof(T));
      }
    }
  }
}

struct Scratch {
  std::vector<float> q, acc, m, l, scores, converted, keys_t, zeros;
  explicit Scratch(const Problem& p) {
    const int64_t rows = kQueryBlock * p.num_q_heads, d = p.head_dim;
    const int64_t token_row = 2 * p.num_kv_heads * d;
    q.resize(rows * d);
    acc.resize(rows * d);
    m.resize(rows);
    l.resize(rows);
    scores.resize(rows * kKeyTile);
    converted.resize(kKeyTile * token_row);
    keys_t.resize(kKeyTile * d);
    zeros.resize(token_row);
  }
};

// The cache row at `row` (every head's K and V) as floats: in place for float32, widened into
// slot j of the scratch for bfloat16; a row of zeros for a key outside the pool (row < 0).
template <typename T>
const float* KeyRow(const T* cache, int64_t row, int64_t token_row, Scratch& scratch, int64_t j) {
  if (row < 0) return scratch.zeros.data();
  if constexpr (std::is_same_v<T, float>) {
    return cache + row;
  } else {
    float* converted = scratch.converted.data() + j * token_row;
    LoadRow<T>(cache + row, converted, token_row);
    return converted;
  }
}

// One sequence's block of query rows, all heads. Row i of the scratch is (query row i / Hq,
// query head i % Hq); query head hq reads kv head hq / G (GQA). Keys are visited tile by tile in
// position order, each token's cache row (every head's K and V, contiguous) read once.
template <typename T>
void Attend(const Problem& p, const WorkItem& item, Scratch& scratch) {
  const int64_t d = p.head_dim, hq_count = p.num_q_heads, group = p.num_q_heads / p.num_kv_heads;
  const int64_t rows = item.num_rows * hq_count, token_row = 2 * p.num_kv_heads * d;
  const T* q = static_cast<const T*>(p.q);
  const T* cache = static_cast<const T*>(p.cache);
  T* out = static_cast<T*>(p.out);
  SeqSpan span = Span(p, item.seq);
  const int64_t first_pos = span.first_pos + (item.first_row - span.first_token);
  const int64_t last_pos = first_pos + item.num_rows - 1;
  int64_t lowest_key = 0;
  if (p.sliding_window > 0) lowest_key = std::max<int64_t>(0, first_pos - p.sliding_window + 1);
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
  std::fill(m, m + rows, -INFINITY);
  std::fill(l, l + rows, 0.0f);

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
      key_rows[j] = KeyRow<T>(cache, key_ok[j] ? row : -1, token_row, scratch, j);
    }
    // While this tile computes, ask for the next tile's rows, one row per key scored: a page is
    // only 16-64 rows, too short for the hardware prefetcher to ramp up on its own, and one burst
    // of requests for a whole tile stalls on the core's few outstanding misses.
    const int64_t row_bytes = token_row * static_cast<int64_t>(sizeof(T));
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
      int64_t lo = 0, hi = std::min<int64_t>(n, pos - tile_start + 1);  // keys <= pos
      if (p.sliding_window > 0) lo = std::max<int64_t>(0, pos - p.sliding_window + 1 - tile_start);
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

// --- items of one query row, every head ---------------------------------------------------
//
// A decoding sequence has one query row per head, and the general path above scores key by key with
// a horizontal sum per (head, key) and runs its softmax and value loop one key at a time: about
// 150 cycles per (query head, key) on an AVX2 core, 20x the arithmetic. Here a tile of 16 keys is
// scored as 16 dot products in independent accumulators whose horizontal sums come out together
// (`Sums8`), the softmax runs on 8-lane vectors, and the value sum keeps 64 floats of the head's
// output row in registers. Prefill rows run the same way, one item per row: a block of rows
// scored through transposed key tiles (the general path) was 4-8x slower. Takes head dims that are
// a multiple of 8; others take the general path.
constexpr int kRowTile = 16;

inline Vec8 Load8(const float* x) {
  Vec8 v;
  std::memcpy(&v, x, 32);
  return v;
}
inline void Store8(float* x, Vec8 v) { std::memcpy(x, &v, 32); }
inline Vec8 Splat8(float f) { return Vec8{} + f; }

// Sums of neighbouring pairs within each 128-bit half, a's then b's (x86's `hadd`).
inline Vec8 PairSums(Vec8 a, Vec8 b) {
  return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
         __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

// {sum(a[0]), ..., sum(a[7])}: eight horizontal sums for the price of about two.
inline Vec8 Sums8(const Vec8* a) {
  const Vec8 low = PairSums(PairSums(a[0], a[1]), PairSums(a[2], a[3]));
  const Vec8 high = PairSums(PairSums(a[4], a[5]), PairSums(a[6], a[7]));
  return __builtin_shufflevector(low, high, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(low, high, 4, 5, 6, 7, 12, 13, 14, 15);
}

inline float Max8(Vec8 v) {
  float m = v[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, v[i]);
  return m;
}

inline float Sum8(Vec8 v) {
  const xlaserve::Vec4 half = __builtin_shufflevector(v, v, 0, 1, 2, 3) +
                              __builtin_shufflevector(v, v, 4, 5, 6, 7);
  return (half[0] + half[2]) + (half[1] + half[3]);
}

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

template <typename T>
void AttendOneRow(const Problem& p, const WorkItem& item, Scratch& scratch) {
  const int64_t d = p.head_dim, hq_count = p.num_q_heads, group = p.num_q_heads / p.num_kv_heads;
  const int64_t token_row = 2 * p.num_kv_heads * d;
  const T* q = static_cast<const T*>(p.q);
  const T* cache = static_cast<const T*>(p.cache);
  T* out = static_cast<T*>(p.out);
  const SeqSpan span = Span(p, item.seq);
  const int64_t pos = span.first_pos + (item.first_row - span.first_token);
  int64_t lowest_key = 0;
  if (p.sliding_window > 0) lowest_key = std::max<int64_t>(0, pos - p.sliding_window + 1);

  float* qs = scratch.q.data();
  float* acc = scratch.acc.data();
  float* m = scratch.m.data();
  float* l = scratch.l.data();
  LoadRow<T>(q + item.first_row * hq_count * d, qs, hq_count * d);
  for (int64_t x = 0; x < hq_count * d; ++x) qs[x] *= p.sm_scale;
  std::fill(acc, acc + hq_count * d, 0.0f);
  std::fill(m, m + hq_count, -INFINITY);
  std::fill(l, l + hq_count, 0.0f);

  const float* key_rows[kRowTile];
  int64_t next_rows[kRowTile];
  float live_lanes[kRowTile];
  const int64_t row_bytes = token_row * static_cast<int64_t>(sizeof(T));
  for (int64_t tile_start = lowest_key; tile_start <= pos; tile_start += kRowTile) {
    const int64_t n = std::min<int64_t>(kRowTile, pos - tile_start + 1);
    for (int64_t j = 0; j < kRowTile; ++j) {
      const int64_t row = j < n ? TokenRow(p, item.seq, tile_start + j) : -1;
      live_lanes[j] = row >= 0 ? 1.0f : 0.0f;  // past the tile's end, or a page outside the pool
      key_rows[j] = KeyRow<T>(cache, row, token_row, scratch, j);
      const int64_t next = tile_start + kRowTile + j;
      next_rows[j] = next <= pos ? TokenRow(p, item.seq, next) : -1;
    }
    const Vec8 live[2] = {Load8(live_lanes), Load8(live_lanes + 8)};
    // The next tile's rows are requested a few at a time between heads, while this tile
    // computes: asked for all at once, the requests overflowed the core's miss buffers and the
    // prefetch instructions themselves stalled (16% of the kernel's time).
    int64_t prefetched = 0;
    for (int64_t hq = 0; hq < hq_count; ++hq) {
      for (const int64_t until = (hq + 1) * kRowTile / hq_count; prefetched < until; ++prefetched) {
        if (next_rows[prefetched] < 0) continue;
        const char* bytes = reinterpret_cast<const char*>(cache + next_rows[prefetched]);
        for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(bytes + b, 0, 2);
      }
      const int64_t h = hq / group;
      Vec8 s[2];
      ScoreTile16(qs + hq * d, d, key_rows, 2 * h * d, s);
      if (p.soft_cap > 0)
        for (int half = 0; half < 2; ++half)
          for (int j = 0; j < 8; ++j) s[half][j] = p.soft_cap * std::tanh(s[half][j] / p.soft_cap);
      // Dead lanes may hold anything (a zero row's score, or NaN through the soft cap).
      for (int half = 0; half < 2; ++half) s[half] = live[half] > Splat8(0.0f) ? s[half] : Splat8(-INFINITY);
      const float tile_max = std::max(Max8(s[0]), Max8(s[1]));
      if (tile_max == -INFINITY) continue;  // no live key in this tile
      const float new_max = std::max(m[hq], tile_max);
      const float alpha = m[hq] == -INFINITY ? 0.0f : ExpNonPositive(m[hq] - new_max);
      float probs[kRowTile];
      for (int half = 0; half < 2; ++half) {
        const Vec8 x = live[half] > Splat8(0.0f) ? s[half] - new_max : Splat8(0.0f);
        Store8(probs + 8 * half, live[half] > Splat8(0.0f) ? ExpNonPositive(x) : Splat8(0.0f));
      }
      m[hq] = new_max;
      l[hq] = l[hq] * alpha + Sum8(Load8(probs) + Load8(probs + 8));
      AccumulateTile(acc + hq * d, d, alpha, key_rows, (2 * h + 1) * d, n, probs);
    }
  }
  for (int64_t hq = 0; hq < hq_count; ++hq) {
    const float inv = l[hq] > 0 ? 1.0f / l[hq] : 0.0f;
    for (int64_t x = 0; x < d; ++x) acc[hq * d + x] *= inv;
  }
  StoreRow<T>(acc, out + item.first_row * hq_count * d, hq_count * d);
}

Scratch& LocalScratch(const Problem& p) {  // one per thread, regrown for bigger problems
  thread_local std::unique_ptr<Scratch> scratch;
  thread_local int64_t heads = 0, dim = 0, kv_heads = 0;
  if (!scratch || heads != p.num_q_heads || dim != p.head_dim || kv_heads != p.num_kv_heads) {
    scratch = std::make_unique<Scratch>(p);
    heads = p.num_q_heads, dim = p.head_dim, kv_heads = p.num_kv_heads;
  }
  return *scratch;
}

template <typename T>
void Run(ffi::ThreadPool& pool, const Problem& p) {
  T* out = static_cast<T*>(p.out);
  std::fill(out, out + p.num_tokens * p.num_q_heads * p.head_dim, T(0));  // padding rows are 0
  WriteNewKv<T>(p);
  const bool one_row_items = p.head_dim % 8 == 0;
  std::vector<WorkItem> items;
  for (int32_t s = 0; s < p.num_seqs; ++s) {
    SeqSpan span = Span(p, s);
    if (!span.ok) continue;
    const int64_t block = one_row_items ? 1 : kQueryBlock;
    for (int64_t r = 0; r < span.q_len; r += block) {
      int32_t n = static_cast<int32_t>(std::min<int64_t>(block, span.q_len - r));
      items.push_back({s, static_cast<int32_t>(span.first_token + r), n});
    }
  }
  xlaserve::ParallelFor(pool, static_cast<int64_t>(items.size()),
                        [&](int64_t i) {
                          if (one_row_items)
                            AttendOneRow<T>(p, items[i], LocalScratch(p));
                          else
                            Attend<T>(p, items[i], LocalScratch(p));
                        });
}

ffi::Error RaggedPagedAttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                                    ffi::AnyBuffer v, ffi::AnyBuffer kv_cache,
                                    ffi::Buffer<ffi::S32> kv_lens,
                                    ffi::Buffer<ffi::S32> page_indices,
                                    ffi::Buffer<ffi::S32> cu_q_lens,
                                    ffi::Buffer<ffi::S32> num_seqs,
                                    ffi::Result<ffi::AnyBuffer> out,
                                    ffi::Result<ffi::AnyBuffer> kv_cache_out, float sm_scale,
                                    int32_t sliding_window, float soft_cap) {
  const auto dtype = q.element_type();
  if (dtype != ffi::F32 && dtype != ffi::BF16)
    return ffi::Error::InvalidArgument("ragged paged attention (CPU): float32 or bfloat16 only");
  if (k.element_type() != dtype || v.element_type() != dtype || kv_cache.element_type() != dtype)
    return ffi::Error::InvalidArgument("ragged paged attention (CPU): q, k, v and cache dtypes differ");
  auto qd = q.dimensions(), kd = k.dimensions(), cd = kv_cache.dimensions(),
       pd = page_indices.dimensions();
  if (qd.size() != 3 || kd.size() != 3 || cd.size() != 4 || pd.size() != 2)
    return ffi::Error::InvalidArgument("ragged paged attention (CPU): bad ranks");
  Problem p;
  p.bf16 = dtype == ffi::BF16;
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.cache = kv_cache_out->untyped_data();
  p.out = out->untyped_data();
  p.num_tokens = qd[0];
  p.num_q_heads = qd[1];
  p.head_dim = qd[2];
  p.num_kv_heads = kd[1];
  p.num_pages = cd[0];
  p.page_size = cd[1];
  p.max_seqs = pd[0];
  p.pages_per_seq = pd[1];
  if (p.num_kv_heads <= 0 || p.num_q_heads % p.num_kv_heads || cd[2] != 2 * p.num_kv_heads ||
      cd[3] != p.head_dim || kv_lens.element_count() != static_cast<size_t>(p.max_seqs) ||
      cu_q_lens.element_count() != static_cast<size_t>(p.max_seqs + 1))
    return ffi::Error::InvalidArgument("ragged paged attention (CPU): inconsistent shapes");
  p.kv_lens = kv_lens.typed_data();
  p.page_indices = page_indices.typed_data();
  p.cu_q_lens = cu_q_lens.typed_data();
  p.num_seqs = std::clamp<int32_t>(num_seqs.typed_data()[0], 0, static_cast<int32_t>(p.max_seqs));
  p.sm_scale = sm_scale;
  p.sliding_window = sliding_window;
  p.soft_cap = soft_cap;
  if (kv_cache_out->untyped_data() != kv_cache.untyped_data())  // XLA chose not to alias
    std::memcpy(kv_cache_out->untyped_data(), kv_cache.untyped_data(), kv_cache.size_bytes());
  if (p.bf16)
    Run<uint16_t>(pool, p);
  else
    Run<float>(pool, p);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveRaggedPagedAttention, RaggedPagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // q
                                  .Arg<ffi::AnyBuffer>()         // k
                                  .Arg<ffi::AnyBuffer>()         // v
                                  .Arg<ffi::AnyBuffer>()         // kv_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_indices
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Ret<ffi::AnyBuffer>()         // out
                                  .Ret<ffi::AnyBuffer>()         // kv_cache (aliases the input)
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<float>("soft_cap"));
