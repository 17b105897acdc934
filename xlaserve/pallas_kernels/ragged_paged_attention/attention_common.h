// Shared pieces of the CPU attention kernel (kernel_cpu.cc): the problem, its sequences and
// cache rows, per-thread scratch, and small vector helpers, for both of its custom calls: ragged
// paged attention (a cache row holds every kv head's K and V) and multi-head latent attention (a
// cache row is one latent vector: every head's key and, its first value_dim entries, value).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "vectors.h"  // xlaserve/native: Vec16 helpers, bfloat16, exp

namespace xlaserve::attention_cpu {

using xlaserve::Bf16ToF32;
using xlaserve::ExpNonPositive;
using xlaserve::F32ToBf16;
using xlaserve::Load16;
using xlaserve::Store16;
using xlaserve::Sum16;
using xlaserve::Vec16;
using xlaserve::Vec8;

constexpr int kKeyTile = 32;       // keys scored together
constexpr int kQueryBlock = 16;    // query rows of one sequence per work item
constexpr int kTransposeRows = 8;  // from this many (row, head) pairs, score a transposed tile
constexpr int kRowTile = 16;       // keys per tile of a one-row item
constexpr int kPrefillRows = 8;    // query rows of one sequence per item of AttendOneRow
#ifdef __AVX512BF16__
constexpr bool kHasBf16Pairs = true;
#else
constexpr bool kHasBf16Pairs = false;
#endif

struct Problem {
  bool bf16;
  bool bf16_pairs;  // bfloat16 dot products on VDPBF16PS (AttendOneRowBf16, PairedLatent) where
                    // the head dim fits
  const void* q;
  const void* k;  // [T, Hkv, D], or the latent rows [T, head_dim] (MLA)
  const void* v;  // [T, Hkv, D], or nullptr (MLA: a latent row is the token's cache row)
  void* cache;  // the output cache (the input's contents, updated)
  void* out;
  int64_t num_tokens, num_q_heads, num_kv_heads, head_dim, num_pages, page_size, max_seqs,
      pages_per_seq;
  int64_t value_dim;  // entries of a value vector and of an output head: head_dim, or MLA's rank
  int64_t row_size;   // entries of one token's cache row: 2 * Hkv * head_dim, or MLA's >= head_dim
  const int32_t* kv_lens;
  const int32_t* page_indices;
  const int32_t* cu_q_lens;
  int32_t num_seqs;
  float sm_scale;
  int32_t sliding_window;  // <= 0: none
  int32_t attention_chunk = 0;  // <= 0: none; else a query at q sees keys from q - q % C on
  float soft_cap;          // <= 0: none
  const float* sinks;      // [num_q_heads] attention sinks (gpt-oss), or nullptr: none
  bool prefix_only = false;  // MLA's expanded form: each row attends to its sequence's keys
                             // from before this step alone (RowKeys::last_key)
  float* lse = nullptr;      // [num_tokens, num_q_heads]: each row's log-sum-exp (MLA), or none
};

struct WorkItem {
  int32_t seq, first_row, num_rows;  // rows are token indices into q; every kv head of them
};

// A one-row item's log-sum-exp per query head where the problem asks for it (prefix_only):
// m holds the running max of scaled scores; a row without keys (l = 0) stays -inf.
inline void StoreLse(const Problem& p, const WorkItem& item, const float* m, const float* l) {
  if (p.lse == nullptr) return;
  for (int64_t h = 0; h < p.num_q_heads; ++h)
    if (l[h] > 0) p.lse[item.first_row * p.num_q_heads + h] = m[h] + std::log(l[h]);
}

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

// Offset of the cache row (all 2 * kv_heads K/V vectors, or the latent row) of sequence s at
// position pos, or -1.
inline int64_t TokenRow(const Problem& p, int64_t s, int64_t pos) {
  int64_t page = p.page_indices[s * p.pages_per_seq + pos / p.page_size];
  if (page < 0 || page >= p.num_pages) return -1;
  return (page * p.page_size + pos % p.page_size) * p.row_size;
}

// The first key a query at `pos` sees in its attention chunk (Llama 4: the chunk's start, keys
// before it neither read nor attended), or 0 without one.
inline int64_t ChunkStart(const Problem& p, int64_t pos) {
  return p.attention_chunk > 0 ? pos - pos % p.attention_chunk : 0;
}

// The first key a query at `pos` sees: its sliding window's or attention chunk's start, or 0.
inline int64_t FirstKey(const Problem& p, int64_t pos) {
  if (p.sliding_window > 0) return std::max<int64_t>(0, pos - p.sliding_window + 1);
  return ChunkStart(p, pos);
}

// A one-row item's last key (its query's position; with prefix_only the last before the step's
// new tokens, -1 if none) and first key (0, or where the sliding window or the attention chunk
// starts, from the query's own position, with prefix_only too: reference.py's rule, which
// Gemma 3's image rows take, image_spans.py; past last_key, the row has no key).
struct RowKeys {
  int64_t last_key, lowest_key = 0;

  RowKeys(const Problem& p, const WorkItem& item) {
    const SeqSpan span = Span(p, item.seq);
    const int64_t pos = span.first_pos + (item.first_row - span.first_token);
    last_key = p.prefix_only ? span.first_pos - 1 : pos;
    lowest_key = FirstKey(p, pos);
  }
};

// The keys [start, start + kRowTile) of a one-row item whose query sits at `pos`, and the next
// tile's: `rows[j]` is key j's cache row, or -1 past `pos` or on a page outside the pool (a
// dead lane; `live[j]` is 0).
struct KeyTile {
  int64_t rows[kRowTile], next_rows[kRowTile];
  float live[kRowTile];
  bool any_live = false;
  int64_t prefetched = 0;

  KeyTile(const Problem& p, int64_t seq, int64_t start, int64_t pos) {
    for (int64_t j = 0; j < kRowTile; ++j) {
      rows[j] = start + j <= pos ? TokenRow(p, seq, start + j) : -1;
      live[j] = rows[j] >= 0 ? 1.0f : 0.0f;
      any_live |= rows[j] >= 0;
      const int64_t next = start + kRowTile + j;
      next_rows[j] = next <= pos ? TokenRow(p, seq, next) : -1;
    }
  }

  // On an item's last tile: the tile to prefetch is the first of the item its thread runs next
  // (`following`, if any), whose first rows would otherwise wait on memory.
  void NextIsFirstOf(const Problem& p, const WorkItem* following) {
    if (next_rows[0] >= 0 || following == nullptr) return;  // not the last tile, or no next item
    const RowKeys next(p, *following);
    for (int64_t j = 0; j < kRowTile; ++j)
      next_rows[j] = next.lowest_key + j <= next.last_key ? TokenRow(p, following->seq, next.lowest_key + j) : -1;
  }

  // Asks for the next tile's rows up to `until` (of kRowTile). Callers spread the requests
  // between heads while this tile computes: asked for all at once, they overflowed the core's
  // miss buffers and the prefetch instructions themselves stalled (16% of the kernel's time).
  template <typename T>
  void PrefetchNext(const T* cache, int64_t until, int64_t row_bytes) {
    for (; prefetched < until; ++prefetched) {
      if (next_rows[prefetched] < 0) continue;
      const char* bytes = reinterpret_cast<const char*>(cache + next_rows[prefetched]);
      for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(bytes + b, 0, 2);
    }
  }
};

// An FP8 cache's entries (model/fp8_kv_cache.py), one byte each: e4m3fn (4 exponent bits,
// bias 7, no infinities) and e5m2 (5 bits, bias 15). The model clips before it casts, so only
// finite values are ever stored; NaN and infinity encodings are not decoded.
struct F8E4M3 {
  uint8_t bits;
  static constexpr int kExponentBits = 4, kMantissaBits = 3;
};
struct F8E5M2 {
  uint8_t bits;
  static constexpr int kExponentBits = 5, kMantissaBits = 2;
};

// An FP8 value as float32: a normal one's exponent and mantissa bits moved into float32's
// fields and the exponent rebiased by an integer add; a subnormal one (exponent field 0) is its
// mantissa times 2^(1 - bias - mantissa bits), in float arithmetic (a float32 subnormal built
// from the bits would read as 0 where XLA's threads set denormals-are-zero). Branch-free, so
// that LoadRow's loop vectorizes.
template <typename F>
inline float Fp8ToF32(F x) {
  constexpr int kBias = (1 << (F::kExponentBits - 1)) - 1;
  const uint32_t magnitude = x.bits & 0x7Fu;
  const uint32_t normal_bits =
      (magnitude << (23 - F::kMantissaBits)) + (static_cast<uint32_t>(127 - kBias) << 23);
  float normal;
  std::memcpy(&normal, &normal_bits, 4);
  const float subnormal =
      static_cast<float>(magnitude) * (1.0f / static_cast<float>(1 << (kBias - 1 + F::kMantissaBits)));
  const float value = magnitude < (1u << F::kMantissaBits) ? subnormal : normal;
  return x.bits & 0x80u ? -value : value;
}

// n values of a float32, bfloat16 (uint16_t) or FP8 row as float32, and back (float32 and
// bfloat16: an FP8 row is written by the model, never here).
template <typename T>
void LoadRow(const T* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else if constexpr (std::is_same_v<T, uint16_t>) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dst[i] = Bf16ToF32(src[i]);
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dst[i] = Fp8ToF32(src[i]);
  }
}

template <typename T>
void StoreRow(const float* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = F32ToBf16(src[i]);
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
// slot j of the scratch for bfloat16 and FP8; a row of zeros for a key outside the pool (row < 0).
// (S: a scratch with `zeros` and `converted` rows of token_row floats, Scratch or LatentScratch.)
template <typename T, typename S>
const float* KeyRow(const T* cache, int64_t row, int64_t token_row, S& scratch, int64_t j) {
  if (row < 0) return scratch.zeros.data();
  if constexpr (std::is_same_v<T, float>) {
    return cache + row;
  } else {
    float* converted = scratch.converted.data() + j * token_row;
    LoadRow<T>(cache + row, converted, token_row);
    return converted;
  }
}

// The online softmax's state before any key, for `rows` rows of which row i is query head
// i % num_q_heads: nothing seen (max -inf, denominator 0), or the head's attention sink seen (max
// sinks[h], denominator e^0 = 1: the sink's term, which has no value vector).
inline void StartSums(const Problem& p, int64_t rows, float* m, float* l) {
  for (int64_t i = 0; i < rows; ++i) {
    m[i] = p.sinks ? p.sinks[i % p.num_q_heads] : -INFINITY;
    l[i] = p.sinks ? 1.0f : 0.0f;
  }
}

// RowKeys of an item about to run; starts the running softmax sums of its heads (acc, m, l in
// the scratch).
struct OneRow : RowKeys {
  OneRow(const Problem& p, const WorkItem& item, Scratch& scratch) : RowKeys(p, item) {
    std::fill(scratch.acc.begin(), scratch.acc.begin() + p.num_q_heads * p.head_dim, 0.0f);
    StartSums(p, p.num_q_heads, scratch.m.data(), scratch.l.data());
  }
};

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


}  // namespace xlaserve::attention_cpu
