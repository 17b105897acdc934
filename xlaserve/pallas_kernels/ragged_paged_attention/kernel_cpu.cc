// Ragged paged attention for the CPU, as an XLA FFI custom call (see kernel_cpu.py and the kernel
// contract in docs/architecture.md; reference.py is the specification this must equal).
//
// Why native code: XLA's CPU backend runs the jnp reference as gathers, transposes and many tiny
// batched matmuls, which reach 2-4 GB/s; decode attention is a stream over the KV pages and should
// run near memory bandwidth. A work item is one query row with all its heads, for head dims that
// are a multiple of 8 (`AttendOneRow`, attend_one_row.h; on a bfloat16 cache with AVX512_BF16 and
// head dims that are a multiple of 32, `AttendOneRowBf16`, attend_one_row_bf16.h), or one
// sequence's block of up to 16 query rows for other head dims (`Attend`, attend_blocks.h). Each
// reads each key's cache row (every kv head's K and V) front to back in tiles, with an online
// softmax in float32 (started at the attention sinks where the optional last operand gives them:
// `StartSums`). Items are spread over XLA's intra-op pool; this file sets them up.
//
// Built by kernel_cpu.py with the host compiler (-O3 -march=native). The inner loops use GCC
// vector extensions (16 floats), which compile to whatever vector registers the CPU has.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#include "attend_blocks.h"
#include "attend_one_row.h"
#include "attend_one_row_bf16.h"
#include "attention_common.h"
#include "parallel.h"  // xlaserve/native: ParallelFor
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace xlaserve::attention_cpu;  // NOLINT: this file's kernel, split by item kind

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
  void (*attend)(const Problem&, const WorkItem&, const WorkItem*, Scratch&) =
      one_row_items ? AttendOneRow<T> : Attend<T>;
#ifdef __AVX512BF16__
  if (std::is_same_v<T, uint16_t> && p.bf16_pairs) {
    switch (p.head_dim) {
      case 32: attend = AttendOneRowBf16<1>; break;
      case 64: attend = AttendOneRowBf16<2>; break;
      case 96: attend = AttendOneRowBf16<3>; break;
      case 128: attend = AttendOneRowBf16<4>; break;
      default: break;
    }
  }
#endif
  xlaserve::ParallelForAhead(pool, static_cast<int64_t>(items.size()), [&](int64_t i, int64_t next) {
    attend(p, items[i], next >= 0 ? &items[next] : nullptr, LocalScratch(p));
  });
}

ffi::Error RaggedPagedAttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                                    ffi::AnyBuffer v, ffi::AnyBuffer kv_cache,
                                    ffi::Buffer<ffi::S32> kv_lens,
                                    ffi::Buffer<ffi::S32> page_indices,
                                    ffi::Buffer<ffi::S32> cu_q_lens,
                                    ffi::Buffer<ffi::S32> num_seqs,
                                    std::optional<ffi::Buffer<ffi::F32>> sinks,
                                    ffi::Result<ffi::AnyBuffer> out,
                                    ffi::Result<ffi::AnyBuffer> kv_cache_out, float sm_scale,
                                    int32_t sliding_window, float soft_cap, bool bf16_pairs) {
  const auto dtype = q.element_type();
  if (dtype != ffi::F32 && dtype != ffi::BF16)
    return ffi::Error::InvalidArgument("ragged paged attention (CPU): float32 or bfloat16 only");
  if (k.element_type() != dtype || v.element_type() != dtype || kv_cache.element_type() != dtype)
    return ffi::Error::InvalidArgument("ragged paged attention (CPU): q, k, v and cache dtypes differ");
  auto qd = q.dimensions(), kd = k.dimensions(), cd = kv_cache.dimensions(),
       pd = page_indices.dimensions();
  // The cache is [pages, page_size, 2 * Hkv, D] or the same memory flat, [pages, page_size,
  // 2 * Hkv * D] (the runtime's): taking both means no reshape around this call, which XLA's
  // copy insertion answered with a copy of the whole (donated, aliased) cache.
  if (qd.size() != 3 || kd.size() != 3 || (cd.size() != 3 && cd.size() != 4) || pd.size() != 2)
    return ffi::Error::InvalidArgument("ragged paged attention (CPU): bad ranks");
  if (bf16_pairs && !kHasBf16Pairs)
    return ffi::Error::InvalidArgument("ragged paged attention (CPU): bf16_pairs needs AVX512_BF16");
  Problem p;
  p.bf16 = dtype == ffi::BF16;
  p.bf16_pairs = bf16_pairs;
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
  const int64_t token_row = cd.size() == 4 ? cd[2] * cd[3] : cd[2];
  if (p.num_kv_heads <= 0 || p.num_q_heads % p.num_kv_heads ||
      token_row != 2 * p.num_kv_heads * p.head_dim ||
      (cd.size() == 4 && cd[3] != p.head_dim) || kv_lens.element_count() != static_cast<size_t>(p.max_seqs) ||
      cu_q_lens.element_count() != static_cast<size_t>(p.max_seqs + 1))
    return ffi::Error::InvalidArgument("ragged paged attention (CPU): inconsistent shapes");
  if (sinks && sinks->element_count() != static_cast<size_t>(p.num_q_heads))
    return ffi::Error::InvalidArgument("ragged paged attention (CPU): one sink per query head");
  p.sinks = sinks ? sinks->typed_data() : nullptr;
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
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Attr<bool>("bf16_pairs"));
