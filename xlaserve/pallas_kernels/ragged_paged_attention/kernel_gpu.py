"""Ragged paged attention as a Pallas GPU kernel (Triton lowering).

Same signature and semantics as `reference.ragged_paged_attention` (the specification), plus
`interpret` (passed to `pallas_call`: False on a GPU, True to run it on CPU) and the block sizes
`q_block` / `kv_block_pages`.

One program per (work item, kv head), a work item being up to `q_block` new tokens of one
sequence (work_items.py), so decode-only, prefill-only and mixed batches are one grid. A program
holds its item's queries for the G query heads of its kv head as the rows of one block (GQA: one
matmul for the group), then walks the sequence's pages `kv_block_pages` at a time, gathering the
pages' K and V by page index, with an online softmax in float32. Only the pages up to the item's
last query position are read; page-table slots past them may hold garbage and are replaced by
page 0 before use, whose keys are masked.

Attention sinks (one logit per query head, `sinks`) come in laid out as the rows, [Hkv, rows]:
a program starts its running max at its rows' sinks and its denominator at 1.

Split KV (flash-decoding): where (work items x kv heads) alone would leave the GPU short of
programs (decode buckets under 256 rows of Llama-3.1-8B: batch 1 is 8 programs on 132 SMs), the
grid gets a third axis of `num_kv_splits`: program (w, h, s) attends the s-th of `num_kv_splits` equal shares of the
item's KV blocks and writes its partial state (unnormalized float32 output, running max and
denominator); `combine_kv_splits` merges the partials in XLA after the kernel with the
log-sum-exp rule. Only split 0 starts from the sink, so a sink is counted once. The shares are
cut from each item's own block range, so a short sequence leaves its later splits empty (they
write max MASK_VALUE, denominator 0, and weigh nothing in the merge).

Triton's dot wants power-of-two dimensions of at least 16, so the row block is padded up to one
(padding rows are masked and dropped) and a KV block is a power of two of at least 16 tokens.
Items of one token (every decode bucket) are the tokens in order, so there the kernel reads its
rows of q [T, Hq, D] itself (the padding rows repeat the group's heads) and, unsplit, writes its
rows of the output in place: no gather of q into blocks or of the output back around the call.

New K/V go into the cache two ways. Where each sequence's new tokens are one item apiece
(one-token items), the kernel writes them itself: a sequence's new keys are attended from the
new rows and only older ones from the cache, so no program reads a slot another writes (the
cache is one operand, aliased in and out). Elsewhere (prefill and mixed items, which read other
items' new keys from the cache) XLA's scatter writes them before the kernel, in place when the
cache is donated.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from xlaserve.pallas_kernels.ragged_paged_attention.gpu_program import attention_program
from xlaserve.pallas_kernels.ragged_paged_attention.reference import (check_local,
                                                                       check_mla_shapes,
                                                                       check_sinks)
from xlaserve.pallas_kernels.ragged_paged_attention.work_items import (
    default_q_block, gather_outputs, gather_queries, lse_of, make_work_items, new_token_slots,
    query_group, sanitize_metadata, write_new_kv_with_xla, write_new_rows_with_xla)

KV_BLOCK_TOKENS = 64  # keys per loop step; K and V of one step stay in registers/shared memory
# Shared memory for the KV blocks: an H100 gives a block 227 KiB (A100: 163), less the queries
# and scores (up to 128 rows x 128 dims in float32: 64 KiB).
SHARED_MEMORY_FOR_KV = 160 << 10
# Split KV: a decode grid with fewer than TARGET_PROGRAMS programs splits each item's KV into
# up to MAX_KV_SPLITS shares. Set from an H200 sweep of decode batches on Llama-3.1-8B's heads
# (benchmarks/sweep_gpu_attention.py, 2026-11-26, bfloat16; docs/tpu-gpu.md): 4 splits were the
# fastest, or within the run's noise of it, at 1, 8 and 64 rows (8, 64 and 512 programs
# unsplit; at 64 rows 18% faster than none), no split at 256 rows (2048 programs; 2 splits were
# 7% slower), and 8 or 16 splits never beat 4. Prefill and mixed buckets (items of several
# rows) were not swept: they keep the earlier, smaller target (2 programs per H100 SM).
TARGET_PROGRAMS = 2048
# Grids of this many items or more are never split, whatever their kv heads: at 256 decode rows
# the unsplit kernel was the fastest for Llama-3.1-8B's heads (above) and for Qwen2.5-0.5B's (2
# kv heads, 512 programs unsplit: 26.9 us against 35.4 us with the 4 splits the program target
# gave, 31.8 with 2; H200, 256-token context, 2026-11-27, `sweep_gpu_attention.py --heads
# qwen2.5-0.5b`), while at 64 rows 4 splits stayed the fastest for both (Qwen's: 25.7 against
# 37.1 us unsplit, 1024-token context). Llama at tp 4 has Qwen's 2 kv heads a device.
NO_SPLIT_ITEMS = 256
TARGET_PROGRAMS_PREFILL = 264
MAX_KV_SPLITS = 4
# MLA: query heads per program (they all read the same latent rows, so fewer programs read the
# KV fewer times, but a program's [rows, latent width] float32 accumulator lives in registers: 16
# rows x 512 is 64 registers a thread at 4 warps) and rows per program at most.
MLA_HEADS_PER_PROGRAM = 16
MLA_MAX_ROWS = 32


def next_power_of_two(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def default_kv_block_pages(page_size, pages_per_seq):
    """Pages per KV step: KV_BLOCK_TOKENS keys, or one page where pages are bigger."""
    return max(1, min(KV_BLOCK_TOKENS // page_size, next_power_of_two(pages_per_seq)))


def check_shapes(block_tokens: int, head_dim: int, itemsize: int) -> None:
    """Raises ValueError for shapes Triton cannot compile: its dot wants power-of-two dims of at
    least 16 (the head dim, and a KV block: a page, or KV_BLOCK_TOKENS of smaller pages), and one
    KV block's K and V must fit in shared memory."""
    if block_tokens != next_power_of_two(block_tokens) or block_tokens < 16 or (
            head_dim != next_power_of_two(head_dim)):
        raise ValueError("the Pallas GPU attention kernel needs power-of-two head dims and pages "
                         f"(KV blocks) of at least 16 tokens; got head dim {head_dim}, "
                         f"{block_tokens}-token blocks")
    if kv_block_bytes(block_tokens, head_dim, itemsize) > SHARED_MEMORY_FOR_KV:
        raise ValueError(f"the Pallas GPU attention kernel holds a page's K and V in shared "
                         f"memory: {block_tokens}-token pages of head dim {head_dim} are too big; "
                         "use a smaller --page-size")


def kv_block_bytes(block_tokens: int, head_dim: int, itemsize: int) -> int:
    return 2 * block_tokens * head_dim * itemsize  # K and V


def query_rows_for(head_dim: int) -> int:
    """The most query rows an item holds: 128 up to head dim 128 (the queries and scores within
    SHARED_MEMORY_FOR_KV's allowance), fewer as heads widen so that rows x head dim stays
    128 x 128: Gemma 4's 512-wide heads at 128 rows asked Triton for 256 KiB of an H100's 227
    (its 2048-token prefill bucket, compiled deviceless), 32 rows fit."""
    return min(128, max(16, 128 * 128 // head_dim))


def default_num_stages(block_bytes: int) -> int:
    """Triton's software pipeline keeps `num_stages` KV blocks (of `block_bytes`: K and V, or
    MLA's latent rows) in shared memory: two where they fit, else one (float32 128-token pages of
    head dim 128 asked for 264 KiB against an H100's 227, compiled deviceless)."""
    return 2 if 2 * block_bytes <= SHARED_MEMORY_FOR_KV else 1


def default_num_kv_splits(num_items: int, num_kv_heads: int, num_kv_blocks: int,
                          q_block: int = 1) -> int:
    """KV splits per (work item, kv head): as many as bring the grid to TARGET_PROGRAMS (items of
    `q_block` > 1 rows: TARGET_PROGRAMS_PREFILL), at most MAX_KV_SPLITS and the KV blocks a full
    page table has; 1 (no split) where the grid has half of the target already. Static: the
    kernel is compiled per bucket shape.

    Llama-3.1-8B (8 kv heads), 64-token KV blocks, 4096-token context (64 blocks), decode buckets
    (one item per row): 1 to 64 rows -> 4 splits (batch 1 runs 32 programs of 16 blocks each,
    not 8 of 64), 128 rows -> 2, 256 rows and more -> 1 (the kernel as before). Prefill buckets
    of many items (512 tokens over 64 sequences: 120 items) are not split. The cost: each program writes rows x (D + 2) float32 partials that the merge reads back; for
    decode items (16 rows) at 64 rows x 8 heads x 4 splits, 2048 x 16 x 130 x 4 B = 17 MB per
    layer each way, against the 134 MB of KV those rows read at a 1024-token context."""
    if num_items >= NO_SPLIT_ITEMS:
        return 1
    programs = num_items * num_kv_heads
    target = TARGET_PROGRAMS if q_block == 1 else TARGET_PROGRAMS_PREFILL
    return max(1, min(target // programs, MAX_KV_SPLITS, num_kv_blocks))


def ragged_paged_attention(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                           sm_scale, sliding_window=None, soft_cap=None, sinks=None,
                           interpret=False, q_block=None, kv_block_pages=None, num_kv_splits=None,
                           num_warps=4, num_stages=None, prefix_only=False,
                           decode_io_in_kernel=True, attention_chunk=None):
    """See `reference.ragged_paged_attention`; returns (out, kv_cache), or with `prefix_only`
    (out, lse, kv_cache). `num_kv_splits`: split-KV programs per (work item, kv head), default
    `default_num_kv_splits`. `decode_io_in_kernel=False`: one-token items take the general path
    too (q gathered per item, the output gathered back, new K/V written by XLA's scatter), the
    form before 2026-11-27, kept so that a GPU run times both (sweep_gpu_attention.py)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, group = k.shape[1], query_group(q, k)
    num_pages, page_size = kv_cache.shape[:2]
    pages_per_seq = page_indices.shape[1]
    sliding_window, attention_chunk = check_local(sliding_window, attention_chunk)
    if kv_block_pages is None:
        kv_block_pages = default_kv_block_pages(page_size, pages_per_seq)
    block_tokens = kv_block_pages * page_size
    check_shapes(block_tokens, head_dim, kv_cache.dtype.itemsize)
    if num_stages is None:
        num_stages = default_num_stages(kv_block_bytes(block_tokens, head_dim,
                                                       kv_cache.dtype.itemsize))
    kv_lens, page_indices, cu_q_lens, num_seqs = sanitize_metadata(
        kv_lens, page_indices, cu_q_lens, num_seqs, num_tokens)
    token_page, token_slot = new_token_slots(kv_lens, page_indices, cu_q_lens, num_tokens,
                                             page_size)
    if q_block is None:
        q_block = default_q_block(num_tokens, page_indices.shape[0], group,
                                  max_rows=query_rows_for(head_dim))
    # The cache as [pages, page_size, Hkv, 2, D]: program (w, h, s) sees K and V of head h.
    by_head = (num_pages, page_size, num_kv_heads, 2, head_dim)
    whole_cache = (num_pages, page_size, None, None, head_dim)
    new_kv = None
    if q_block == 1 and not prefix_only and decode_io_in_kernel:
        # One-token items: the kernel writes each token's K/V into the cache itself and attends
        # the step's new keys from k and v (XLA's scatter before the call took 9 us a layer of a
        # 256-row Llama-3.1-8B step on an H200, ncu). One cache operand, updated in place.
        # K and V as one operand [T * Hkv * 2, D], one fusion (RoPE'd K, V) where two were.
        new_kv = (jnp.stack([k, v], axis=2).reshape(-1, head_dim), token_page, token_slot)
        caches = [kv_cache.reshape(by_head)]
        cache_specs = [pl.BlockSpec((num_pages, page_size, None, 2, head_dim),
                                    lambda w, h, s: (0, 0, h, 0, 0))]
    else:
        kv_cache = write_new_kv_with_xla(kv_cache, k, v, token_page, token_slot)
        cache = kv_cache.reshape(by_head)
        caches = [cache, cache]  # K of head h as one operand and V as another, one buffer
        cache_specs = [pl.BlockSpec(whole_cache, lambda w, h, s: (0, 0, h, 0, 0)),  # K
                       pl.BlockSpec(whole_cache, lambda w, h, s: (0, 0, h, 1, 0))]  # V
    result = _attend_items(
        q, caches, cache_specs, sinks, kv_lens, page_indices, cu_q_lens, num_seqs,
        num_kv_heads=num_kv_heads, group=group, q_block=q_block,
        kv_block_pages=kv_block_pages, num_kv_splits=num_kv_splits, out_dim=head_dim,
        num_warps=num_warps, num_stages=num_stages, interpret=interpret, new_kv=new_kv,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, value_dim=None,
        prefix_only=prefix_only, direct_io=decode_io_in_kernel, attention_chunk=attention_chunk)
    if new_kv is not None:
        result, cache = result
        kv_cache = cache.reshape(kv_cache.shape)
    return (*result, kv_cache) if prefix_only else (result, kv_cache)


def mla_ragged_paged_attention(q, latent, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs,
                               *, sm_scale, value_dim, interpret=False, q_block=None,
                               kv_block_pages=None, num_kv_splits=None, heads_per_program=None,
                               num_warps=4, num_stages=None, prefix_only=False,
                               decode_io_in_kernel=True):
    """See `reference.mla_ragged_paged_attention`; returns (out, kv_cache), or with
    `prefix_only` (out, lse, kv_cache) over each sequence's keys from before this step. Every
    query head reads the same latent rows, so the heads are cut into programs of
    `heads_per_program` (default MLA_HEADS_PER_PROGRAM) that play the kv heads' part in the
    grid: program (w, j, s) attends heads [j * n, (j + 1) * n) of item w. Triton's dot wants
    power-of-two widths, so a block's scores are two dots, the latent part (value_dim lanes,
    which are also the values) and the RoPE'd part (the rest of the row).
    `decode_io_in_kernel`: as `ragged_paged_attention`'s."""
    check_mla_shapes(q, latent, kv_cache, value_dim)
    num_tokens, num_q_heads, row_dim = q.shape
    page_size = kv_cache.shape[1]
    pages_per_seq = page_indices.shape[1]
    heads = heads_per_program or math.gcd(num_q_heads, MLA_HEADS_PER_PROGRAM)
    if num_q_heads % heads:
        raise ValueError(f"{num_q_heads} heads do not split into programs of {heads}")
    if kv_block_pages is None:
        kv_block_pages = default_kv_block_pages(page_size, pages_per_seq)
    block_tokens = kv_block_pages * page_size
    itemsize = kv_cache.dtype.itemsize
    check_mla_kernel_shapes(block_tokens, value_dim, row_dim, itemsize)
    if num_stages is None:
        num_stages = default_num_stages(block_tokens * row_dim * itemsize)
    kv_lens, page_indices, cu_q_lens, num_seqs = sanitize_metadata(
        kv_lens, page_indices, cu_q_lens, num_seqs, num_tokens)
    token_page, token_slot = new_token_slots(kv_lens, page_indices, cu_q_lens, num_tokens,
                                             page_size)
    if q_block is None:
        q_block = default_q_block(num_tokens, page_indices.shape[0], heads, max_rows=MLA_MAX_ROWS)
    new_kv = None
    if (q_block == 1 and not prefix_only and kv_cache.shape[2] == row_dim
            and decode_io_in_kernel):
        # One-token items write their latent rows themselves (the MHA kernel's reason); a cache
        # wider than its rows (TPU's lane padding) keeps XLA's write of the zero padding.
        new_kv = (latent, token_page, token_slot)
    else:
        latent = jnp.pad(latent, ((0, 0), (0, kv_cache.shape[2] - row_dim)))  # the cache's width
        kv_cache = write_new_rows_with_xla(kv_cache, latent, token_page, token_slot)
    # The programs of `heads` query heads take the kv heads' place in the grid.
    result = _attend_items(
        q, [kv_cache], [pl.BlockSpec(kv_cache.shape, lambda w, h, s: (0, 0, 0))], None, kv_lens,
        page_indices, cu_q_lens, num_seqs, num_kv_heads=num_q_heads // heads, group=heads,
        q_block=q_block, kv_block_pages=kv_block_pages,
        num_kv_splits=num_kv_splits, out_dim=value_dim, num_warps=num_warps,
        num_stages=num_stages, interpret=interpret, new_kv=new_kv, sm_scale=sm_scale,
        sliding_window=None, soft_cap=None, value_dim=value_dim, prefix_only=prefix_only,
        direct_io=decode_io_in_kernel, attention_chunk=None)
    if new_kv is not None:
        result, kv_cache = result
    return (*result, kv_cache) if prefix_only else (result, kv_cache)


def check_mla_kernel_shapes(block_tokens: int, value_dim: int, row_dim: int, itemsize: int):
    """ValueError for MLA shapes Triton cannot compile: power-of-two latent and RoPE widths of
    at least 16 and KV blocks of at least 16 tokens, one block's rows in shared memory."""
    widths = (block_tokens, value_dim, row_dim - value_dim)
    if any(x < 16 or x != next_power_of_two(x) for x in widths):
        raise ValueError("the Pallas GPU latent attention kernel needs power-of-two latent and "
                         "RoPE widths and KV blocks of at least 16; got "
                         f"{value_dim} + {row_dim - value_dim}, {block_tokens}-token blocks")
    if block_tokens * row_dim * itemsize > SHARED_MEMORY_FOR_KV:
        raise ValueError(f"the Pallas GPU latent attention kernel holds a KV block in shared "
                         f"memory: {block_tokens}-token pages of {row_dim} are too big; use a "
                         "smaller --page-size")


def _attend_items(q, caches, cache_specs, sinks, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                  num_kv_heads, group, q_block, kv_block_pages, num_kv_splits, out_dim, num_warps,
                  num_stages, interpret, new_kv=None, direct_io=True, **static):
    """What both entries share, from sanitized metadata, `q_block` (the entry's choice) and the
    cache with the new rows written (or, with `new_kv`, to be written by the kernel):
    the work items, q gathered per item for the grid's (work items, kv heads or head programs,
    KV splits), the pallas_call, the merge of the splits and the outputs in token order:
    out [T, Hq, out_dim] in q's dtype; with static["prefix_only"], (out, lse [T, Hq] float32).
    `new_kv` (one-token items only): (new rows: MHA's K/V [T * Hkv * 2, D], token t's K of kv
    head h at row (t * Hkv + h) * 2, its V next, or MLA's latent rows [T, row width]; token_page,
    token_slot [T]) of new tokens the kernel writes into `caches[0]` (its only cache, not yet
    written) and attends from there; then returns (out, the cache). `direct_io=False`: one-token
    items gather q and their output as longer items do."""
    num_tokens, num_q_heads = q.shape[:2]
    pages_per_seq = page_indices.shape[1]
    rows = max(16, next_power_of_two(q_block * group))
    item_seq, item_row0 = make_work_items(cu_q_lens, num_tokens, q_block)
    # Items of one token (decode buckets) are the tokens themselves, in order: the kernel reads
    # its rows of q and writes its rows of the output in place (`direct`), where a gather padded
    # q to the block's rows (7 us a layer of a 256-row Llama-3.1-8B step on an H200, ncu) and the
    # output was gathered back.
    direct = direct_io and q_block == 1 and not static["prefix_only"]
    if direct:
        q_items = q.reshape(num_tokens * num_q_heads, q.shape[2])
        q_item_shape = (num_tokens, num_kv_heads, rows, q.shape[2])
        item_spec = pl.BlockSpec(q_items.shape, lambda w, h, s: (0, 0))
    else:
        q_items = gather_queries(q, cu_q_lens, item_seq, item_row0, q_block, num_kv_heads, rows)
        q_item_shape = q_items.shape
        item_spec = pl.BlockSpec((None, None, rows, q_items.shape[3]),
                                 lambda w, h, s: (w, h, 0, 0))
    # Whole KV steps of the page table, so that a step's slice of it is always in range.
    padded_pages = -(-pages_per_seq // kv_block_pages) * kv_block_pages
    page_indices = jnp.pad(page_indices, ((0, 0), (0, padded_pages - pages_per_seq)))
    num_items = q_item_shape[0]
    if num_kv_splits is None:
        num_kv_splits = default_num_kv_splits(num_items, num_kv_heads,
                                              padded_pages // kv_block_pages, q_block)
    sinks_in = []
    if sinks is not None:
        sinks_in = [sinks_by_row(check_sinks(sinks, num_q_heads), num_kv_heads, q_block, rows,
                                 direct)]
    new_in, new_specs = [], []
    if new_kv is not None:
        assert direct, "only one-token items write their own K/V"
        new_in = list(new_kv)
        new_specs = [pl.BlockSpec(x.shape, lambda w, h, s, n=x.ndim: (0,) * n) for x in new_in]
    kernel = functools.partial(attention_program, num_kv_splits=num_kv_splits,
                               has_sinks=bool(sinks_in), q_block=q_block, group=group,
                               page_size=caches[0].shape[1], kv_block_pages=kv_block_pages,
                               rows=rows, direct=direct, writes_new_kv=bool(new_in), **static)
    metadata = [pl.BlockSpec(x.shape, lambda w, h, s, n=x.ndim: (0,) * n)
                for x in (item_seq, item_row0, kv_lens, cu_q_lens, num_seqs, page_indices)]
    with_lse = static["prefix_only"]
    if num_kv_splits == 1 and direct:  # the output in token order, written in place
        out_shape = [jax.ShapeDtypeStruct((num_tokens * num_q_heads, out_dim), q.dtype)]
        out_specs = [pl.BlockSpec(out_shape[0].shape, lambda w, h, s: (0, 0))]
    elif num_kv_splits == 1:  # the output itself, normalized (and its log-sum-exp)
        out_shape = [jax.ShapeDtypeStruct(q_item_shape[:3] + (out_dim,), q.dtype)]
        out_specs = [pl.BlockSpec((None, None, rows, out_dim), lambda w, h, s: (w, h, 0, 0))]
        if with_lse:
            out_shape.append(jax.ShapeDtypeStruct(q_item_shape[:3], jnp.float32))
            out_specs.append(pl.BlockSpec((None, None, rows), lambda w, h, s: (w, h, 0)))
    else:  # per split: unnormalized output [W, Hkv, splits, rows, D], max and denominator
        split_shape = (num_items, num_kv_heads, num_kv_splits, rows)
        out_shape = (jax.ShapeDtypeStruct(split_shape + (out_dim,), jnp.float32),
                     jax.ShapeDtypeStruct(split_shape, jnp.float32),
                     jax.ShapeDtypeStruct(split_shape, jnp.float32))
        out_specs = (pl.BlockSpec((None, None, None, rows, out_dim),
                                  lambda w, h, s: (w, h, s, 0, 0)),) + (
            pl.BlockSpec((None, None, None, rows), lambda w, h, s: (w, h, s, 0)),) * 2
    aliases = {}
    if new_in:  # the cache, updated in place: the last output
        aliases = {len(metadata) + 1: len(out_shape)}
        out_shape, out_specs = [*out_shape, caches[0]], [*out_specs, cache_specs[0]]
    result = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(num_items, num_kv_heads, num_kv_splits),
        in_specs=metadata + [item_spec] + cache_specs + new_specs
        + [pl.BlockSpec((None, rows), lambda w, h, s: (h, 0))] * len(sinks_in),
        out_specs=out_specs,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(item_seq, item_row0, kv_lens, cu_q_lens, num_seqs, page_indices, q_items, *caches,
      *new_in, *sinks_in)
    if new_in:
        *result, cache = result
    out = _outputs_in_token_order(result, cu_q_lens, q, group, q_block, num_kv_splits, direct,
                                  with_lse, out_dim)
    return (out, cache) if new_in else out


def _outputs_in_token_order(result, cu_q_lens, q, group, q_block, num_kv_splits, direct,
                            with_lse, out_dim):
    """The kernel's outputs (per item, or per split) as out [T, Hq, out_dim] (and lse)."""
    num_tokens, num_q_heads = q.shape[:2]
    if num_kv_splits == 1 and direct:
        return result[0].reshape(num_tokens, num_q_heads, out_dim)
    if num_kv_splits == 1:
        out_items, lse_items = result if with_lse else (result[0], None)
    else:
        out_items, lse_items = combine_kv_splits(*result)
        out_items = out_items.astype(q.dtype)
    if direct:  # item w is token w; a dead item's rows came out 0
        return out_items[:, :, :group].reshape(num_tokens, num_q_heads, out_dim)
    out = gather_outputs(out_items, cu_q_lens, q_block, num_tokens, num_q_heads)
    if not with_lse:
        return out
    return out, gather_outputs(lse_items[..., None], cu_q_lens, q_block, num_tokens,
                               num_q_heads)[..., 0]


def combine_kv_splits(acc, m, l):
    """Merges split-KV partials (acc [W, Hkv, splits, rows, D], m and l [W, Hkv, splits, rows]:
    each split's unnormalized output, running max and denominator) into the normalized output
    [W, Hkv, rows, D] (float32) and its log-sum-exp [W, Hkv, rows] (`lse_of`), by the rule:
    weight exp(m_s - max_s m_s) on each. An empty split (m = MASK_VALUE, l = 0) weighs 0 beside any real one; a row with no key and
    no sink in any split comes out 0. A split whose keys were all masked for a row holds junk
    with m = MASK_VALUE, and weighs exp(MASK_VALUE - m_real) = 0 beside the row's own key."""
    m_all = m.max(axis=2, keepdims=True)
    weight = jnp.exp(m - m_all)
    l_all = (weight * l).sum(axis=2)
    acc_all = (weight[..., None] * acc).sum(axis=2)
    return acc_all / jnp.where(l_all == 0, 1.0, l_all)[..., None], lse_of(m_all[:, :, 0], l_all)


def sinks_by_row(sinks, num_kv_heads, q_block, rows, direct=False):
    """f32[Hq] -> [Hkv, rows]: row r * G + g of kv head h gets sinks[h * G + g] (the layout of
    gather_queries); rows past q_block * G (padding, dropped) get 0. `direct`: row r is head
    r % G (the kernel's rows of a one-token item)."""
    if direct:
        return sinks.reshape(num_kv_heads, -1)[:, jnp.arange(rows) % (sinks.size // num_kv_heads)]
    by_head = sinks.reshape(num_kv_heads, 1, -1)
    by_row = jnp.tile(by_head, (1, q_block, 1)).reshape(num_kv_heads, -1)
    return jnp.pad(by_row, ((0, 0), (0, rows - by_row.shape[1])))
