// Work items of multi-head latent attention (DeepSeek-V2/V3's MLA, absorbed form): one query row
// with every head, against one latent cache row per key; the float32 arithmetic (a float32 cache,
// or a bfloat16 one widened), and the item loop that attend_latent_bf16.h's pairs path shares.
#pragma once

#include "attention_common.h"

namespace xlaserve::attention_cpu {

// --- multi-head latent attention: items of one query row, every head -----------------------
//
// Every query head reads the same cache row of a key: the key is the whole row (Dk = 576
// entries for DeepSeek-V3), the value its first value_dim (512). So a tile of keys is read and
// prepared once (widened from bfloat16, or interleaved into pairs) for all heads, and each row
// loaded serves Hq x (Dk + value_dim) multiply-adds: arithmetic, not memory, is the cost here
// (16 heads: 15 per bfloat16 byte), and the loops are laid out for the vector units. The query
// heads sit in the lanes of a Vec16, 16 per head block (the item's query transposed once, zero
// lanes past Hq), so a key's scores for 16 heads are Dk multiply-adds of a query column by one
// broadcast key entry: no horizontal sums, kScoreKeys keys in independent accumulators. The
// online softmax then runs across the tile's 16 score vectors, 16 heads at a time, and the value
// sum keeps kValueHeads heads x kValueVecs vectors of 16 output floats in registers per key.
// Measured on one Sapphire Rapids core (a VM, one 512-bit FMA a cycle): a tile of 16 keys for
// DeepSeek-V3's 16 heads (17408 vector FMAs) in 6.3-7 us from cache, 7.5-9 us from memory.
constexpr int kLanes = 16;  // query heads of a head block, one per lane of a Vec16
#ifdef __AVX512F__          // 32 registers of 16 floats
constexpr int kScoreKeys = 8;  // keys scored together (8 chains hide the multiply-add latency)
constexpr int kValueVecs = 4;  // 16-float vectors of a head's output summed together
#else  // AVX2 (16 registers of 8 floats: a Vec16 takes 2) or NEON (32 of 4: it takes 4)
constexpr int kScoreKeys = 4;
constexpr int kValueVecs = 1;
#endif
constexpr int kValueHeads = 4;  // heads whose value sums share each loaded value vector
constexpr int kScoreDims = 64;  // key entries scored between two prefetch steps

// The vector the score and value loops compute in: the register's width. GCC lowers a Vec16
// on AVX2 through the stack and general registers (the float32 decode of 64 sequences x 1024
// keys took 170 ms on 2 Zen 3 cores, 14x off their FMA peak, where XLA's jnp took 61), so there
// a Vec16 of 16 heads is worked as kParts vectors of 8.
#ifdef __AVX512F__
using VecN = Vec16;
#else
using VecN = Vec8;
#endif
constexpr int kNative = sizeof(VecN) / sizeof(float);
constexpr int kParts = 16 / kNative;
inline VecN LoadN(const float* x) {
  VecN v;
  std::memcpy(&v, x, sizeof(v));
  return v;
}
inline void StoreN(float* x, VecN v) { std::memcpy(x, &v, sizeof(v)); }

inline Vec16 Splat16(float f) { return Vec16{} + f; }
inline int64_t HeadBlocks(const Problem& p) { return (p.num_q_heads + kLanes - 1) / kLanes; }

struct LatentScratch {
  std::vector<float> q_t;              // [blocks][Dk][kLanes]: the query heads, transposed
  std::vector<uint32_t> q_pairs;       // [blocks][Dk / 2][kLanes]: the same as bfloat16 pairs
  std::vector<float> acc, m, l;        // [Hq][value_dim] running sums; [blocks * kLanes] each
  std::vector<float> probs;            // [kRowTile][kLanes]: a head block's tile probabilities
  std::vector<uint32_t> prob_pairs;    // [kRowTile / 2][kLanes]: the same as bfloat16 pairs
  std::vector<uint32_t> value_pairs;   // [kRowTile / 2][value_dim]: two keys' values interleaved
  std::vector<float> converted, zeros; // [kRowTile][Dk] widened rows; [Dk] zeros
  explicit LatentScratch(const Problem& p) {
    const int64_t lanes = HeadBlocks(p) * kLanes, dk = p.head_dim;
    q_t.resize(lanes * dk);
    q_pairs.resize(lanes * (dk / 2));
    acc.resize(p.num_q_heads * p.value_dim);
    m.resize(lanes);
    l.resize(lanes);
    probs.resize(kRowTile * kLanes);
    prob_pairs.resize(kRowTile / 2 * kLanes);
    value_pairs.resize(kRowTile / 2 * p.value_dim);
    converted.resize(kRowTile * dk);
    zeros.resize(dk);
  }
};

// dst[b][x][lane] = get(h, x) for query head h = kLanes * b + lane and x < width; 0 past Hq.
template <typename D, typename Get>
void HeadsToLanes(int64_t heads, int64_t width, D* dst, Get get) {
  const int64_t blocks = (heads + kLanes - 1) / kLanes;
  std::fill(dst, dst + blocks * width * kLanes, D(0));
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t x = 0; x < width; ++x)
      dst[(h / kLanes * width + x) * kLanes + h % kLanes] = get(h, x);
}

// One tile's step of the online softmax for a head block (its 16 lanes of m and l): s[j] the
// scores of key j, of which keys j < n with live[j] != 0 count. Writes every key's
// probabilities to probs[j] (0 for dead keys and j >= n) and returns the factor alpha that
// the running sums scale by. The tile has a live key, so every lane's new max is finite.
inline Vec16 SoftmaxStep(Vec16* s, int64_t n, const float* live, float sm_scale, float* m, float* l,
                         float* probs) {
  Vec16 tile_max = Splat16(-INFINITY);
  for (int64_t j = 0; j < n; ++j) {
    s[j] *= sm_scale;
    if (live[j] != 0.0f) tile_max = tile_max > s[j] ? tile_max : s[j];
  }
  const Vec16 m_old = Load16(m);
  const Vec16 m_new = m_old > tile_max ? m_old : tile_max;
  const Vec16 alpha = m_old == Splat16(-INFINITY) ? Vec16{} : ExpNonPositive(m_old - m_new);
  Vec16 sum = {};
  for (int64_t j = 0; j < kRowTile; ++j) {  // dead keys: 0, selected (their rows are zeros)
    const Vec16 prob = j < n && live[j] != 0.0f ? ExpNonPositive(s[j] - m_new) : Vec16{};
    Store16(probs + kLanes * j, prob);
    sum += prob;
  }
  Store16(m, m_new);
  Store16(l, Load16(l) * alpha + sum);
  return alpha;
}

// The next tile's key rows, asked for a few cache lines at each of a tile's `steps` steps:
// asked for all at once (or a row at a time), they stall on the core's few outstanding misses
// (KeyTile::PrefetchNext's comment), and DeepSeek's rows are 18-36 lines each.
template <typename T>
struct SpreadPrefetch {
  const T* cache;
  const KeyTile& tile;
  int64_t lines_per_row, steps, step = 0, asked = 0;

  void Step() { AskUntil(++step * kRowTile * lines_per_row / steps); }
  void Rest() { AskUntil(kRowTile * lines_per_row); }  // a last tile takes fewer steps

  void AskUntil(int64_t until) {
    for (; asked < std::min(until, kRowTile * lines_per_row); ++asked) {
      const int64_t row = tile.next_rows[asked / lines_per_row];
      if (row >= 0)
        __builtin_prefetch(
            reinterpret_cast<const char*>(cache + row) + 64 * (asked % lines_per_row), 0, 2);
    }
  }
};

// An item: the query row's heads (a Path's constructor lays them out), then tile by tile of
// kRowTile keys: the tile's rows (Path::LoadTile), and per head block the scores of kScoreKeys
// keys over kScoreDims entries at a time (Path::Score), the softmax step, and the value sums of
// up to kValueHeads heads at a time (Path::Accumulate); the next tile's rows are prefetched
// between those steps. Path: WidenedLatent<T> below, or PairedLatent (attend_latent_bf16.h).
template <typename Path>
void AttendLatent(const Problem& p, const WorkItem& item, const WorkItem* following,
                  LatentScratch& scratch) {
  using T = typename Path::Element;
  using C = typename Path::Cache;
  const int64_t hq = p.num_q_heads, blocks = HeadBlocks(p), dk = p.head_dim;
  const C* cache = static_cast<const C*>(p.cache);
  const RowKeys keys(p, item);
  Path path(p, scratch, static_cast<const T*>(p.q) + item.first_row * hq * dk);
  std::fill(scratch.acc.begin(), scratch.acc.end(), 0.0f);
  StartSums(p, blocks * kLanes, scratch.m.data(), scratch.l.data());
  const int64_t lines_per_row = (dk * static_cast<int64_t>(sizeof(C)) + 63) / 64;
  const int64_t steps = blocks * (kRowTile / kScoreKeys) * ((dk + kScoreDims - 1) / kScoreDims) +
                        (hq + kValueHeads - 1) / kValueHeads;
  for (int64_t tile_start = keys.lowest_key; tile_start <= keys.last_key; tile_start += kRowTile) {
    const int64_t n = std::min<int64_t>(kRowTile, keys.last_key - tile_start + 1);
    KeyTile tile(p, item.seq, tile_start, keys.last_key);
    tile.NextIsFirstOf(p, following);
    if (!tile.any_live) continue;
    path.LoadTile(cache, tile, n);
    SpreadPrefetch<C> prefetch{cache, tile, lines_per_row, steps};
    for (int64_t b = 0; b < blocks; ++b) {
      Vec16 s[kRowTile] = {};
      for (int64_t j = 0; j < n; j += kScoreKeys)
        for (int64_t x = 0; x < dk; x += kScoreDims, prefetch.Step())
          path.Score(b, j, x, std::min<int64_t>(x + kScoreDims, dk), s + j);
      float alpha[kLanes];
      Store16(alpha, SoftmaxStep(s, n, tile.live, p.sm_scale, scratch.m.data() + b * kLanes,
                                 scratch.l.data() + b * kLanes, scratch.probs.data()));
      path.StartValues();
      const int64_t heads = std::min<int64_t>(kLanes, hq - b * kLanes);
      for (int64_t lane = 0; lane < heads; lane += kValueHeads, prefetch.Step())
        path.Accumulate(b * kLanes + lane, std::min<int64_t>(kValueHeads, heads - lane), n,
                        alpha + lane);
    }
    prefetch.Rest();
  }
  path.Store(static_cast<T*>(p.out) + item.first_row * hq * p.value_dim);
  if (p.lse != nullptr)  // m is of scaled scores (SoftmaxStep); a row without keys stays -inf
    for (int64_t h = 0; h < hq; ++h)
      if (scratch.l[h] > 0) p.lse[item.first_row * hq + h] = scratch.m[h] + std::log(scratch.l[h]);
}

// acc_h[x0:x0 + 16V] = acc_h * alpha[h] + sum_{j < n} probs[j][h] * key_rows[j][x0:...] for the
// H heads at acc (rows vd apart; probs and alpha start at the first one's lane), in registers.
template <int H, int V>
inline void AccumulateValues(float* acc, int64_t vd, const float* alpha, const float* probs,
                             const float* const* key_rows, int64_t n, int64_t x0) {
  constexpr int kVecs = V * kParts;
  VecN o[H][kVecs];
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < kVecs; ++c) o[h][c] = LoadN(acc + h * vd + x0 + kNative * c) * alpha[h];
  for (int64_t j = 0; j < n; ++j) {
    VecN v[kVecs];
    for (int c = 0; c < kVecs; ++c) v[c] = LoadN(key_rows[j] + x0 + kNative * c);
    for (int h = 0; h < H; ++h) {
      const float pj = probs[kLanes * j + h];
      for (int c = 0; c < kVecs; ++c) o[h][c] += pj * v[c];
    }
  }
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < kVecs; ++c) StoreN(acc + h * vd + x0 + kNative * c, o[h][c]);
}

// The same over every value entry: vectors of 16 (kValueVecs at a time), then one by one.
template <int H>
void AccumulateHeads(float* acc, int64_t vd, const float* alpha, const float* probs,
                     const float* const* key_rows, int64_t n) {
  int64_t x0 = 0;
  for (; x0 + 16 * kValueVecs <= vd; x0 += 16 * kValueVecs)
    AccumulateValues<H, kValueVecs>(acc, vd, alpha, probs, key_rows, n, x0);
  for (; x0 + 16 <= vd; x0 += 16) AccumulateValues<H, 1>(acc, vd, alpha, probs, key_rows, n, x0);
  for (; x0 < vd; ++x0)  // a value dim that is not a multiple of 16
    for (int h = 0; h < H; ++h) {
      float sum = acc[h * vd + x0] * alpha[h];
      for (int64_t j = 0; j < n; ++j) sum += probs[kLanes * j + h] * key_rows[j][x0];
      acc[h * vd + x0] = sum;
    }
}

// s[j] += {q_h[x0:x1] . key_rows[j][x0:x1] for the block's 16 heads h}, K keys; q_t: the
// block's [Dk][kLanes].
template <int K>
inline void ScoreKeys(const float* q_t, int64_t x0, int64_t x1, const float* const* key_rows,
                      Vec16* s) {
  VecN acc[K][kParts];
  float* sums = reinterpret_cast<float*>(s);  // K x 16 floats
  for (int j = 0; j < K; ++j)
    for (int c = 0; c < kParts; ++c) acc[j][c] = LoadN(sums + 16 * j + kNative * c);
  for (int64_t x = x0; x < x1; ++x) {
    VecN qx[kParts];
    for (int c = 0; c < kParts; ++c) qx[c] = LoadN(q_t + kLanes * x + kNative * c);
    for (int j = 0; j < K; ++j) {
      const float key = key_rows[j][x];
      for (int c = 0; c < kParts; ++c) acc[j][c] += qx[c] * key;
    }
  }
  for (int j = 0; j < K; ++j)
    for (int c = 0; c < kParts; ++c) StoreN(sums + 16 * j + kNative * c, acc[j][c]);
}

// The float32 arithmetic: a float32 cache read in place, a bfloat16 or FP8 one (C) widened tile
// by tile (each row once, for every head: a few percent of the arithmetic it feeds). Any Dk,
// value_dim.
template <typename T, typename C = T>
struct WidenedLatent {
  using Element = T;
  using Cache = C;
  const Problem& p;
  LatentScratch& scratch;
  const float* key_rows[kRowTile];

  WidenedLatent(const Problem& p, LatentScratch& scratch, const T* q) : p(p), scratch(scratch) {
    HeadsToLanes(p.num_q_heads, p.head_dim, scratch.q_t.data(), [&](int64_t h, int64_t x) {
      if constexpr (std::is_same_v<T, float>) return q[h * p.head_dim + x];
      else return Bf16ToF32(q[h * p.head_dim + x]);
    });
  }

  void LoadTile(const C* cache, const KeyTile& tile, int64_t /*n*/) {
    for (int64_t j = 0; j < kRowTile; ++j)
      key_rows[j] = KeyRow<C>(cache, tile.rows[j], p.head_dim, scratch, j);
  }

  void Score(int64_t block, int64_t j, int64_t x0, int64_t x1, Vec16* s) const {
    ScoreKeys<kScoreKeys>(scratch.q_t.data() + block * p.head_dim * kLanes, x0, x1, key_rows + j, s);
  }

  void StartValues() {}

  void Accumulate(int64_t head, int64_t heads, int64_t n, const float* alpha) const {
    float* acc = scratch.acc.data() + head * p.value_dim;
    const float* probs = scratch.probs.data() + head % kLanes;
    switch (heads) {
      case 1: AccumulateHeads<1>(acc, p.value_dim, alpha, probs, key_rows, n); break;
      case 2: AccumulateHeads<2>(acc, p.value_dim, alpha, probs, key_rows, n); break;
      case 3: AccumulateHeads<3>(acc, p.value_dim, alpha, probs, key_rows, n); break;
      default: AccumulateHeads<kValueHeads>(acc, p.value_dim, alpha, probs, key_rows, n); break;
    }
  }

  void Store(T* out) const {
    float* acc = scratch.acc.data();
    for (int64_t h = 0; h < p.num_q_heads; ++h) {
      const float inv = scratch.l[h] > 0 ? 1.0f / scratch.l[h] : 0.0f;
      for (int64_t x = 0; x < p.value_dim; ++x) acc[h * p.value_dim + x] *= inv;
    }
    StoreRow<T>(acc, out, p.num_q_heads * p.value_dim);
  }
};
}  // namespace xlaserve::attention_cpu
