// Ragged paged attention for the CPU, as XLA FFI custom calls (see kernel_cpu.py and the kernel
// contract in docs/architecture.md; reference.py is the specification this must equal).
//
// Why native code: XLA's CPU backend runs the jnp reference as gathers, transposes and many tiny
// batched matmuls, which reach 2-4 GB/s; decode attention is a stream over the KV pages and should
// run near memory bandwidth. A work item is one query row with all its heads (a prefill's rows
// kPrefillRows at a time), for head dims that are a multiple of 8 (`AttendOneRow`,
// attend_one_row.h; on a bfloat16 cache with AVX512_BF16 and head dims that are a multiple of 32,
// one row an item, `AttendOneRowBf16`, attend_one_row_bf16.h), or one
// sequence's block of up to 16 query rows for other head dims (`Attend`, attend_blocks.h). Each
// reads each key's cache row (every kv head's K and V) front to back in tiles, with an online
// softmax in float32 (started at the attention sinks where the optional last operand gives them:
// `StartSums`). Items are spread over XLA's intra-op pool; this file sets them up.
//
// Multi-head latent attention (DeepSeek-V2/V3, `XlaserveMlaRaggedPagedAttention`) is the second
// custom call: one latent row per token, every head's key and (its first value_dim entries) value;
// its items are one query row with every head (`AttendLatent`, attend_latent.h; bfloat16 pairs
// in attend_latent_bf16.h), set up by the same code as the first. With `prefix_only` (the
// expanded form's prefix part, model/mla.py) a row attends to its sequence's keys from before
// this step alone and the call also returns each row's log-sum-exp.
//
// q and the output are float32 or bfloat16; the cache is in q's dtype or FP8 (e4m3fn, e5m2:
// --kv-cache-dtype, model/fp8_kv_cache.py), whose rows are widened to float32 as they are read
// (`LoadRow`, attention_common.h), as bfloat16 rows are on CPUs without AVX512_BF16.
//
// Built by kernel_cpu.py with the host compiler (-O3 -march=native). The inner loops use GCC
// vector extensions (16 floats), which compile to whatever vector registers the CPU has.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "attend_blocks.h"
#include "attend_latent.h"
#include "attend_latent_bf16.h"
#include "attend_one_row.h"
#include "attend_one_row_bf16.h"
#include "attention_common.h"
#include "parallel.h"  // xlaserve/native: ParallelFor
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace xlaserve::attention_cpu;  // NOLINT: this file's kernel, split by item kind

// Writes the new tokens' K and V (or latent rows) into their pages (before attention, which
// reads every key from the cache, the new ones included). T: the cache's entries, which the new
// rows come in (an FP8 cache's already scaled and cast by the model).
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
      if (v == nullptr) {  // a latent row of head_dim entries, zeros in the cache row's padding
        std::memcpy(cache + row, k + t * d, d * sizeof(T));
        std::fill(cache + row + d, cache + row + p.row_size, T{});
        continue;
      }
      for (int64_t h = 0; h < p.num_kv_heads; ++h) {
        std::memcpy(cache + row + 2 * h * d, k + (t * p.num_kv_heads + h) * d, d * sizeof(T));
        std::memcpy(cache + row + (2 * h + 1) * d, v + (t * p.num_kv_heads + h) * d, d * sizeof(T));
      }
    }
  }
}

template <typename S>  // Scratch or LatentScratch: one of each per thread, regrown for new shapes
S& LocalScratch(const Problem& p) {
  thread_local std::unique_ptr<S> scratch;
  thread_local int64_t heads = 0, dim = 0, kv_heads = 0, value_dim = 0;
  if (!scratch || heads != p.num_q_heads || dim != p.head_dim || kv_heads != p.num_kv_heads ||
      value_dim != p.value_dim) {
    scratch = std::make_unique<S>(p);
    heads = p.num_q_heads, dim = p.head_dim, kv_heads = p.num_kv_heads, value_dim = p.value_dim;
  }
  return *scratch;
}

template <typename S>
using AttendFn = void (*)(const Problem&, const WorkItem&, const WorkItem*, S&);

// Zeroes the output (padding rows stay 0), writes the new rows, and spreads `attend` over XLA's
// pool, one item per `block` query rows of a sequence (fewer at its end). T: q's and the
// output's entries; C: the cache's.
template <typename T, typename C, typename S>
void Run(ffi::ThreadPool& pool, const Problem& p, AttendFn<S> attend, int64_t block) {
  T* out = static_cast<T*>(p.out);
  std::fill(out, out + p.num_tokens * p.num_q_heads * p.value_dim, T(0));
  if (p.lse != nullptr) std::fill(p.lse, p.lse + p.num_tokens * p.num_q_heads, -INFINITY);
  WriteNewKv<C>(p);
  std::vector<WorkItem> items;
  for (int32_t s = 0; s < p.num_seqs; ++s) {
    SeqSpan span = Span(p, s);
    if (!span.ok) continue;
    for (int64_t r = 0; r < span.q_len; r += block) {
      int32_t n = static_cast<int32_t>(std::min<int64_t>(block, span.q_len - r));
      items.push_back({s, static_cast<int32_t>(span.first_token + r), n});
    }
  }
  xlaserve::ParallelForAhead(pool, static_cast<int64_t>(items.size()), [&](int64_t i, int64_t next) {
    attend(p, items[i], next >= 0 ? &items[next] : nullptr, LocalScratch<S>(p));
  });
}

template <typename T, typename C>
void RunAttention(ffi::ThreadPool& pool, const Problem& p) {
  const bool one_row_items = p.head_dim % 8 == 0;
  AttendFn<Scratch> attend = one_row_items ? AttendOneRow<T, C> : Attend<T, C>;
  int64_t block = one_row_items ? kPrefillRows : kQueryBlock;
#ifdef __AVX512BF16__
  if (std::is_same_v<C, uint16_t> && p.bf16_pairs) {
    switch (p.head_dim) {
      case 32: attend = AttendOneRowBf16<1>; break;
      case 64: attend = AttendOneRowBf16<2>; break;
      case 96: attend = AttendOneRowBf16<3>; break;
      case 128: attend = AttendOneRowBf16<4>; break;
      default: break;
    }
    if (attend != AttendOneRow<T, C>) block = 1;  // one row an item
  }
#endif
  Run<T, C>(pool, p, attend, block);
}

template <typename T, typename C>
void RunLatentAttention(ffi::ThreadPool& pool, const Problem& p) {
  AttendFn<LatentScratch> attend = AttendLatent<WidenedLatent<T, C>>;
#ifdef __AVX512BF16__
  if (std::is_same_v<C, uint16_t> && p.bf16_pairs && PairedLatent::Fits(p))
    attend = AttendLatent<PairedLatent>;
#endif
  Run<T, C>(pool, p, attend, 1);
}

using RunFn = void (*)(ffi::ThreadPool&, const Problem&);

// A custom call's runs by q's dtype (float32, bfloat16) and the cache's (q's, FP8 e4m3fn, e5m2).
template <template <typename, typename> class Kind>
struct Runs {
  static constexpr RunFn by_dtype[2][3] = {
      {Kind<float, float>::Run, Kind<float, F8E4M3>::Run, Kind<float, F8E5M2>::Run},
      {Kind<uint16_t, uint16_t>::Run, Kind<uint16_t, F8E4M3>::Run, Kind<uint16_t, F8E5M2>::Run}};
};
template <typename T, typename C>
struct AttentionRun {
  static void Run(ffi::ThreadPool& pool, const Problem& p) { RunAttention<T, C>(pool, p); }
};
template <typename T, typename C>
struct LatentRun {
  static void Run(ffi::ThreadPool& pool, const Problem& p) { RunLatentAttention<T, C>(pool, p); }
};

// What both custom calls share once their own operands are in `p`: the dtypes (q's, then the
// new rows' and the cache's) and the metadata checked and read, the output cache given the
// input's contents where XLA chose not to alias the two, and the run for q in float32 or
// bfloat16 and a cache in q's dtype or FP8.
ffi::Error Launch(ffi::ThreadPool& pool, Problem& p, const char* name, ffi::DataType dtype,
                  std::initializer_list<ffi::DataType> cache_dtypes, ffi::AnyBuffer kv_cache,
                  ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_indices,
                  ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs,
                  const RunFn (&runs)[2][3]) {
  const std::string prefix = std::string(name) + " (CPU): ";
  if (dtype != ffi::F32 && dtype != ffi::BF16)
    return ffi::Error::InvalidArgument(prefix + "float32 or bfloat16 only");
  const ffi::DataType cache_dtype = *cache_dtypes.begin();
  if (std::any_of(cache_dtypes.begin(), cache_dtypes.end(),
                  [&](ffi::DataType d) { return d != cache_dtype; }))
    return ffi::Error::InvalidArgument(prefix + "the new rows and the cache differ in dtype");
  const int cache_kind = cache_dtype == dtype ? 0 : cache_dtype == ffi::F8E4M3FN ? 1
                         : cache_dtype == ffi::F8E5M2 ? 2 : -1;
  if (cache_kind < 0)
    return ffi::Error::InvalidArgument(prefix + "the cache is in q's dtype or FP8 (e4m3fn, e5m2)");
  if (p.bf16_pairs && cache_kind != 0)
    return ffi::Error::InvalidArgument(prefix + "bf16_pairs takes a bfloat16 cache");
  if (p.bf16_pairs && !kHasBf16Pairs)
    return ffi::Error::InvalidArgument(prefix + "bf16_pairs needs AVX512_BF16");
  auto pd = page_indices.dimensions();
  if (pd.size() != 2 || kv_lens.element_count() != static_cast<size_t>(pd[0]) ||
      cu_q_lens.element_count() != static_cast<size_t>(pd[0] + 1))
    return ffi::Error::InvalidArgument(prefix + "inconsistent shapes");
  p.bf16 = dtype == ffi::BF16;
  p.max_seqs = pd[0];
  p.pages_per_seq = pd[1];
  p.kv_lens = kv_lens.typed_data();
  p.page_indices = page_indices.typed_data();
  p.cu_q_lens = cu_q_lens.typed_data();
  p.num_seqs = std::clamp<int32_t>(num_seqs.typed_data()[0], 0, static_cast<int32_t>(p.max_seqs));
  if (p.cache != kv_cache.untyped_data())  // XLA chose not to alias
    std::memcpy(p.cache, kv_cache.untyped_data(), kv_cache.size_bytes());
  runs[p.bf16 ? 1 : 0][cache_kind](pool, p);
  return ffi::Error::Success();
}

ffi::Error RaggedPagedAttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                                    ffi::AnyBuffer v, ffi::AnyBuffer kv_cache,
                                    ffi::Buffer<ffi::S32> kv_lens,
                                    ffi::Buffer<ffi::S32> page_indices,
                                    ffi::Buffer<ffi::S32> cu_q_lens,
                                    ffi::Buffer<ffi::S32> num_seqs,
                                    std::optional<ffi::Buffer<ffi::F32>> sinks,
                                    ffi::Result<ffi::AnyBuffer> out,
                                    ffi::Result<ffi::AnyBuffer> kv_cache_out,
                                    ffi::Result<ffi::Buffer<ffi::F32>> lse, float sm_scale,
                                    int32_t sliding_window, float soft_cap, bool bf16_pairs,
                                    bool prefix_only, int32_t attention_chunk) {
  auto qd = q.dimensions(), kd = k.dimensions(), cd = kv_cache.dimensions();
  // The cache is [pages, page_size, 2 * Hkv, D] or the same memory flat, [pages, page_size,
  // 2 * Hkv * D] (the runtime's): taking both means no reshape around this call, which XLA's
  // copy insertion answered with a copy of the whole (donated, aliased) cache.
  if (qd.size() != 3 || kd.size() != 3 || (cd.size() != 3 && cd.size() != 4))
    return ffi::Error::InvalidArgument("ragged paged attention (CPU): bad ranks");
  Problem p;
  p.bf16_pairs = bf16_pairs;
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.cache = kv_cache_out->untyped_data();
  p.out = out->untyped_data();
  p.num_tokens = qd[0];
  p.num_q_heads = qd[1];
  p.head_dim = p.value_dim = qd[2];
  p.num_kv_heads = kd[1];
  p.num_pages = cd[0];
  p.page_size = cd[1];
  p.row_size = 2 * p.num_kv_heads * p.head_dim;
  const int64_t token_row = cd.size() == 4 ? cd[2] * cd[3] : cd[2];
  if (p.num_kv_heads <= 0 || p.num_q_heads % p.num_kv_heads || token_row != p.row_size ||
      (cd.size() == 4 && cd[3] != p.head_dim))
    return ffi::Error::InvalidArgument("ragged paged attention (CPU): inconsistent shapes");
  if (sinks && sinks->element_count() != static_cast<size_t>(p.num_q_heads))
    return ffi::Error::InvalidArgument("ragged paged attention (CPU): one sink per query head");
  p.sinks = sinks ? sinks->typed_data() : nullptr;
  p.sm_scale = sm_scale;
  p.sliding_window = sliding_window;
  p.attention_chunk = attention_chunk;
  p.soft_cap = soft_cap;
  // prefix_only (speculative tree rows, tree_tokens.py) runs on the one-row items alone.
  if (lse->element_count() != static_cast<size_t>(prefix_only ? qd[0] * qd[1] : 0) ||
      (prefix_only && p.head_dim % 8 != 0))
    return ffi::Error::InvalidArgument(
        "ragged paged attention (CPU): prefix_only takes an lse [T, Hq] and a head dim that is "
        "a multiple of 8");
  p.prefix_only = prefix_only;
  p.lse = prefix_only ? lse->typed_data() : nullptr;
  return Launch(pool, p, "ragged paged attention", q.element_type(),
                {k.element_type(), v.element_type(), kv_cache.element_type()}, kv_cache, kv_lens,
                page_indices, cu_q_lens, num_seqs, Runs<AttentionRun>::by_dtype);
}

// q [T, Hq, Dk], latent [T, Dk], kv_cache [pages, page_size, Dc >= Dk] (keys are a row's first
// Dk entries, values its first value_dim); out [T, Hq, value_dim].
ffi::Error LatentAttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer latent,
                               ffi::AnyBuffer kv_cache, ffi::Buffer<ffi::S32> kv_lens,
                               ffi::Buffer<ffi::S32> page_indices,
                               ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs,
                               ffi::Result<ffi::AnyBuffer> out,
                               ffi::Result<ffi::AnyBuffer> kv_cache_out,
                               ffi::Result<ffi::Buffer<ffi::F32>> lse, float sm_scale,
                               int32_t value_dim, bool bf16_pairs, bool prefix_only) {
  auto qd = q.dimensions(), ld = latent.dimensions(), cd = kv_cache.dimensions();
  if (qd.size() != 3 || ld.size() != 2 || cd.size() != 3 || ld[0] != qd[0] || ld[1] != qd[2] ||
      cd[2] < qd[2] || value_dim <= 0 || value_dim > qd[2] ||
      lse->element_count() != static_cast<size_t>(prefix_only ? qd[0] * qd[1] : 0))
    return ffi::Error::InvalidArgument("latent attention (CPU): inconsistent shapes");
  Problem p;
  p.bf16_pairs = bf16_pairs;
  p.q = q.untyped_data();
  p.k = latent.untyped_data();
  p.v = nullptr;
  p.cache = kv_cache_out->untyped_data();
  p.out = out->untyped_data();
  p.num_tokens = qd[0];
  p.num_q_heads = qd[1];
  p.num_kv_heads = 1;
  p.head_dim = qd[2];
  p.row_size = cd[2];
  p.value_dim = value_dim;
  p.num_pages = cd[0];
  p.page_size = cd[1];
  p.sinks = nullptr;
  p.sm_scale = sm_scale;
  p.sliding_window = 0;
  p.soft_cap = 0.0f;
  p.prefix_only = prefix_only;
  p.lse = prefix_only ? lse->typed_data() : nullptr;
  return Launch(pool, p, "latent attention", q.element_type(),
                {latent.element_type(), kv_cache.element_type()}, kv_cache, kv_lens, page_indices,
                cu_q_lens, num_seqs, Runs<LatentRun>::by_dtype);
}

}  // namespace

extern "C" int64_t XlaserveAttentionBf16Pairs() { return kHasBf16Pairs; }

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
                                  .OptionalArg<ffi::Buffer<ffi::F32>>()  // sinks [Hq]
                                  .Ret<ffi::AnyBuffer>()         // out
                                  .Ret<ffi::AnyBuffer>()         // kv_cache (aliases the input)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse [T, Hq], or [0]
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Attr<bool>("bf16_pairs")
                                  .Attr<bool>("prefix_only")
                                  .Attr<int32_t>("attention_chunk"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMlaRaggedPagedAttention, LatentAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // q
                                  .Arg<ffi::AnyBuffer>()         // latent
                                  .Arg<ffi::AnyBuffer>()         // kv_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_indices
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Ret<ffi::AnyBuffer>()         // out
                                  .Ret<ffi::AnyBuffer>()         // kv_cache (aliases the input)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse [T, Hq], or [0]
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("value_dim")
                                  .Attr<bool>("bf16_pairs")
                                  .Attr<bool>("prefix_only"));
