// An encoder's attention on the CPU (issue 54), as an XLA FFI custom call (bidirectional_cpu.py):
// each token of a ragged batch against every key of its own sequence (or those at most `window`
// positions away), no cache. new_tokens.reference_new_token_attention(causal=False) is the
// specification this must equal.
//
// Why native code: XLA ran the blocked jnp form as 128-row blocks of tiny batched dots and masked
// exps, 21 ms a layer for 47 inputs of ~40 tokens (12 heads of 32, 2-core AMD EPYC) where the
// work is ~3 ms at the GEMMs' rate. Here a work item is one head of up to kRows query rows of one
// sequence: their scores against the sequence's keys (each key row loaded once for the rows),
// softmax in float32 with ExpNonPositive, then the values, all in the item's scratch.
//
// q, k, v [T, H, D] float32 (k and v already one head per query head), cu_q_lens [S + 1],
// num_seqs [1]; out [T, H, D] float32, padding rows 0. D a multiple of 16.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"  // xlaserve/native: ParallelFor
#include "vectors.h"   // xlaserve/native: Vec16, ExpNonPositive
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using xlaserve::Load16;
using xlaserve::Store16;
using xlaserve::Sum16;
using xlaserve::Vec16;

constexpr int kRows = 4;  // query rows an item takes together (each key row loaded once for them)

struct Item {
  int64_t first_key, end_key;  // the sequence's rows [first_key, end_key)
  int64_t first_row, rows;     // the item's query rows
  int64_t head;
};

struct Shapes {
  int64_t heads, dim, window;
  float scale;
};

// The item's rows against keys [lo, hi) of one head: scores into `s` (kRows x stride), softmax,
// then out = sum_j p_j v_j for each row (rows may have keys of their own, `window` > 0).
void Attend(const float* q, const float* k, const float* v, float* out, const Item& item,
            const Shapes& sh, std::vector<float>& scratch) {
  const int64_t d = sh.dim, stride = sh.heads * d, h = item.head;
  const int64_t span = item.end_key - item.first_key;
  scratch.resize(static_cast<size_t>(kRows * span));
  float* s = scratch.data();
  int64_t lo[kRows], hi[kRows];
  for (int64_t r = 0; r < item.rows; ++r) {
    const int64_t row = item.first_row + r;
    lo[r] = sh.window > 0 ? std::max(item.first_key, row - sh.window) : item.first_key;
    hi[r] = sh.window > 0 ? std::min(item.end_key, row + sh.window + 1) : item.end_key;
  }
  const int64_t first = *std::min_element(lo, lo + item.rows);
  const int64_t last = *std::max_element(hi, hi + item.rows);
  for (int64_t j = first; j < last; ++j) {  // scores: each key row once for the item's rows
    const float* kj = k + j * stride + h * d;
    Vec16 acc[kRows] = {};
    for (int64_t x = 0; x < d; x += 16) {
      const Vec16 kx = Load16(kj + x);
      for (int64_t r = 0; r < item.rows; ++r)
        acc[r] += Load16(q + (item.first_row + r) * stride + h * d + x) * kx;
    }
    for (int64_t r = 0; r < item.rows; ++r)
      s[r * span + (j - item.first_key)] = Sum16(acc[r]) * sh.scale;
  }
  for (int64_t r = 0; r < item.rows; ++r) {  // softmax over the row's own keys
    float* row = s + r * span - item.first_key;
    float m = -INFINITY;
    for (int64_t j = lo[r]; j < hi[r]; ++j) m = std::max(m, row[j]);
    float sum = 0.0f;
    for (int64_t j = lo[r]; j < hi[r]; ++j) {
      row[j] = xlaserve::ExpNonPositive(row[j] - m);
      sum += row[j];
    }
    const float inv = 1.0f / sum;  // the row's own key is in range: sum >= 1
    for (int64_t j = lo[r]; j < hi[r]; ++j) row[j] *= inv;
  }
  for (int64_t x = 0; x < d; x += 16) {  // values
    Vec16 acc[kRows] = {};
    for (int64_t j = first; j < last; ++j) {
      const Vec16 vx = Load16(v + j * stride + h * d + x);
      for (int64_t r = 0; r < item.rows; ++r)
        if (j >= lo[r] && j < hi[r]) acc[r] += s[r * span + (j - item.first_key)] * vx;
    }
    for (int64_t r = 0; r < item.rows; ++r)
      Store16(out + (item.first_row + r) * stride + h * d + x, acc[r]);
  }
}

ffi::Error BidirectionalImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                             ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                             ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs,
                             ffi::ResultBuffer<ffi::F32> out, float sm_scale, int32_t window) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 3 || kd.size() != 3 || vd.size() != 3 || qd[2] % 16 != 0 ||
      !std::equal(qd.begin(), qd.end(), kd.begin()) || !std::equal(qd.begin(), qd.end(), vd.begin()))
    return ffi::Error::InvalidArgument(
        "bidirectional attention (CPU): q, k, v [T, H, D] alike, D a multiple of 16");
  const int64_t tokens = qd[0];
  const Shapes sh{qd[1], qd[2], window, sm_scale};
  float* o = out->typed_data();
  std::fill(o, o + tokens * sh.heads * sh.dim, 0.0f);
  const int32_t* cu = cu_q_lens.typed_data();
  const int64_t max_seqs = static_cast<int64_t>(cu_q_lens.element_count()) - 1;
  const int64_t seqs = std::clamp<int64_t>(num_seqs.typed_data()[0], 0, max_seqs);
  std::vector<Item> items;
  for (int64_t s = 0; s < seqs; ++s) {
    const int64_t start = std::clamp<int64_t>(cu[s], 0, tokens);
    const int64_t end = std::clamp<int64_t>(cu[s + 1], start, tokens);
    for (int64_t h = 0; h < sh.heads; ++h)
      for (int64_t r = start; r < end; r += kRows)
        items.push_back({start, end, r, std::min<int64_t>(kRows, end - r), h});
  }
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  xlaserve::ParallelFor(pool, static_cast<int64_t>(items.size()), [&](int64_t i) {
    thread_local std::vector<float> scratch;
    Attend(qp, kp, vp, o, items[i], sh, scratch);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveBidirectionalAttention, BidirectionalImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("window"));
