// The gated delta rule over a ragged step on the CPU (Gated DeltaNet, issue 76), reading and
// writing a state pool in place, as an XLA FFI custom call (kernel_cpu.py):
//
//   per sequence s, value head h, the state S [Dk, Dv] of slot state_slots[s] (zeros where the
//   step holds the sequence's first token: kv_lens[s] == its new tokens), then per row t:
//     S <- S * exp(g[t, h]);  r = k^T S;  S <- S + k (beta[t, h] (v - r))^T;  out[t, h] = q^T S
//   (r = 0 without the delta: `delta` false, Mamba-2's scan, reference.py's form "ssd"),
//   and S back to the slot, but where writes[s] is 0 (a speculative verified row's: the slot
//   keeps the state before the row, model/linear_attention.py commits the accepted drafts').
//
// q and k arrive normalized, q scaled and both repeated to the value heads (the Python side
// does it: elementwise); everything is float32. The work items are (sequence, value head)
// pairs, each one's state read once into a private [Dk, Dv] buffer (64 KB at 128 x 128: in L2)
// and written back once, and two passes over it a row (the decay fused with k^T S; the update
// with q^T S). XLA's CPU loop of the jnp reference moved the whole pool row through memory at
// every row (~0.5 ms a row of a 16-head layer).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"  // xlaserve/native: ParallelFor
#include "vectors.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Step {
  const float *q, *k, *v, *g, *beta;  // [T, Hv, Dk], [T, Hv, Dk], [T, Hv, Dv], [T, Hv] x 2
  float* pool;                        // [slots, Hv, Dk, Dv]
  float* out;                         // [T, Hv, Dv]
  const int32_t *slots, *kv_lens, *cu_q_lens, *writes;
  int64_t heads, dk, dv, num_slots;
  bool delta;
};

// One (sequence, head): its rows [start, end), its state from `slot` (or zeros), back there
// where `write`.
void Run(const Step& s, int64_t start, int64_t end, int64_t slot, bool fresh, bool write,
         int64_t h, float* state, float* remembered) {
  const int64_t dk = s.dk, dv = s.dv, heads = s.heads;
  float* pooled = s.pool + (slot * heads + h) * dk * dv;
  if (fresh) {
    std::fill(state, state + dk * dv, 0.0f);
  } else {
    std::memcpy(state, pooled, sizeof(float) * dk * dv);
  }
  const int64_t vec_end = dv / 16 * 16;
  for (int64_t t = start; t < end; ++t) {
    const float* q = s.q + (t * heads + h) * dk;
    const float* k = s.k + (t * heads + h) * dk;
    const float* v = s.v + (t * heads + h) * dv;
    const float decay = std::exp(s.g[t * heads + h]);
    const float beta = s.beta[t * heads + h];
    std::fill(remembered, remembered + dv, 0.0f);
    for (int64_t i = 0; i < dk; ++i) {  // S *= decay, r += k_i S_i
      float* row = state + i * dv;
      const float ki = k[i];
      int64_t j = 0;
      for (; j < vec_end; j += 16) {
        const xlaserve::Vec16 x = xlaserve::Load16(row + j) * decay;
        xlaserve::Store16(row + j, x);
        xlaserve::Store16(remembered + j, xlaserve::Load16(remembered + j) + x * ki);
      }
      for (; j < dv; ++j) {
        row[j] *= decay;
        remembered[j] += row[j] * ki;
      }
    }
    for (int64_t j = 0; j < dv; ++j)  // the write: beta (v - r), or beta v without the delta
      remembered[j] = beta * (s.delta ? v[j] - remembered[j] : v[j]);
    float* o = s.out + (t * heads + h) * dv;
    std::fill(o, o + dv, 0.0f);
    for (int64_t i = 0; i < dk; ++i) {  // S_i += k_i delta, o += q_i S_i
      float* row = state + i * dv;
      const float ki = k[i], qi = q[i];
      int64_t j = 0;
      for (; j < vec_end; j += 16) {
        const xlaserve::Vec16 x = xlaserve::Load16(row + j) + xlaserve::Load16(remembered + j) * ki;
        xlaserve::Store16(row + j, x);
        xlaserve::Store16(o + j, xlaserve::Load16(o + j) + x * qi);
      }
      for (; j < dv; ++j) {
        row[j] += remembered[j] * ki;
        o[j] += row[j] * qi;
      }
    }
  }
  if (write) std::memcpy(pooled, state, sizeof(float) * dk * dv);
}

ffi::Error GatedDeltaRuleImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                              ffi::AnyBuffer v, ffi::AnyBuffer g, ffi::AnyBuffer beta,
                              ffi::AnyBuffer state_pool, ffi::AnyBuffer state_slots,
                              ffi::AnyBuffer kv_lens, ffi::AnyBuffer cu_q_lens,
                              ffi::AnyBuffer num_seqs, ffi::AnyBuffer writes,
                              ffi::Result<ffi::AnyBuffer> out,
                              ffi::Result<ffi::AnyBuffer> pool_out, bool delta) {
  auto qd = q.dimensions(), vd = v.dimensions(), pd = state_pool.dimensions();
  for (const ffi::AnyBuffer* b : {&q, &k, &v, &g, &beta, &state_pool})
    if (b->element_type() != ffi::F32)
      return ffi::Error::InvalidArgument("gated delta rule (CPU): float32 inputs");
  if (qd.size() != 3 || vd.size() != 3 || pd.size() != 4 || qd[1] != vd[1] || pd[1] != vd[1] ||
      pd[2] != qd[2] || pd[3] != vd[2] || k.element_count() != q.element_count())
    return ffi::Error::InvalidArgument(
        "gated delta rule (CPU): q, k [T, Hv, Dk], v [T, Hv, Dv], pool [slots, Hv, Dk, Dv]");
  Step s{};
  s.q = static_cast<const float*>(q.untyped_data());
  s.k = static_cast<const float*>(k.untyped_data());
  s.v = static_cast<const float*>(v.untyped_data());
  s.g = static_cast<const float*>(g.untyped_data());
  s.beta = static_cast<const float*>(beta.untyped_data());
  s.pool = static_cast<float*>(pool_out->untyped_data());  // aliased to state_pool
  s.out = static_cast<float*>(out->untyped_data());
  s.slots = static_cast<const int32_t*>(state_slots.untyped_data());
  s.kv_lens = static_cast<const int32_t*>(kv_lens.untyped_data());
  s.cu_q_lens = static_cast<const int32_t*>(cu_q_lens.untyped_data());
  s.writes = static_cast<const int32_t*>(writes.untyped_data());
  s.delta = delta;
  if (writes.element_count() != state_slots.element_count())
    return ffi::Error::InvalidArgument("gated delta rule (CPU): writes i32[S] beside state_slots");
  s.heads = vd[1];
  s.dk = qd[2];
  s.dv = vd[2];
  s.num_slots = pd[0];
  const int64_t rows = qd[0];
  const int64_t seqs = std::min<int64_t>(
      static_cast<const int32_t*>(num_seqs.untyped_data())[0],
      static_cast<int64_t>(state_slots.element_count()));
  const int64_t live_rows = seqs > 0 ? std::min<int64_t>(s.cu_q_lens[seqs], rows) : 0;
  std::fill(s.out + live_rows * s.heads * s.dv, s.out + rows * s.heads * s.dv, 0.0f);
  for (int64_t i = 0; i < seqs; ++i)
    if (s.slots[i] < 0 || s.slots[i] >= s.num_slots)
      return ffi::Error::InvalidArgument("gated delta rule (CPU): a state slot out of the pool");
  xlaserve::ParallelFor(pool, seqs * s.heads, [&](int64_t item) {
    const int64_t seq = item / s.heads, h = item % s.heads;
    const int64_t start = s.cu_q_lens[seq], end = std::min<int64_t>(s.cu_q_lens[seq + 1], rows);
    if (end <= start) return;
    std::vector<float> scratch(s.dk * s.dv + s.dv);
    Run(s, start, end, s.slots[seq], s.kv_lens[seq] == end - start, s.writes[seq] != 0, h,
        scratch.data(), scratch.data() + s.dk * s.dv);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveGatedDeltaRule, GatedDeltaRuleImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // q [T, Hv, Dk] normalized, scaled
                                  .Arg<ffi::AnyBuffer>()  // k [T, Hv, Dk] normalized
                                  .Arg<ffi::AnyBuffer>()  // v [T, Hv, Dv]
                                  .Arg<ffi::AnyBuffer>()  // g [T, Hv]
                                  .Arg<ffi::AnyBuffer>()  // beta [T, Hv]
                                  .Arg<ffi::AnyBuffer>()  // state pool [slots, Hv, Dk, Dv]
                                  .Arg<ffi::AnyBuffer>()  // state_slots i32[S]
                                  .Arg<ffi::AnyBuffer>()  // kv_lens i32[S]
                                  .Arg<ffi::AnyBuffer>()  // cu_q_lens i32[S + 1]
                                  .Arg<ffi::AnyBuffer>()  // num_seqs i32[1]
                                  .Arg<ffi::AnyBuffer>()  // writes i32[S]
                                  .Ret<ffi::AnyBuffer>()  // out [T, Hv, Dv]
                                  .Ret<ffi::AnyBuffer>()  // the pool, in place
                                  .Attr<bool>("delta"));  // false: Mamba-2's scan
