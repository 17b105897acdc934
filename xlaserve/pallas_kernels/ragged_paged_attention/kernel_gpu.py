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

Triton's dot wants power-of-two dimensions of at least 16, so the row block is padded up to one
(padding rows are masked and dropped) and a KV block is a power of two of at least 16 tokens.

New K/V are written into the cache by XLA's scatter before the kernel (in place when the cache
is donated): it is already a coalesced GPU kernel, and Triton has no DMA engine to gain from.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from xlaserve.pallas_kernels.ragged_paged_attention.reference import check_sinks
from xlaserve.pallas_kernels.ragged_paged_attention.work_items import (
    MASK_VALUE, default_q_block, gather_queries, item_span, make_work_items, new_token_slots,
    query_group, sanitize_metadata, scatter_outputs, write_new_kv_with_xla)

KV_BLOCK_TOKENS = 64  # keys per loop step; K and V of one step stay in registers/shared memory
# Shared memory for the KV blocks: an H100 gives a block 227 KiB (A100: 163), less the queries
# and scores (up to 128 rows x 128 dims in float32: 64 KiB).
SHARED_MEMORY_FOR_KV = 160 << 10


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


def default_num_stages(block_tokens: int, head_dim: int, itemsize: int) -> int:
    """Triton's software pipeline keeps `num_stages` KV blocks in shared memory: two where they
    fit, else one (float32 128-token pages of head dim 128 asked for 264 KiB against an H100's
    227, compiled deviceless)."""
    return 2 if 2 * kv_block_bytes(block_tokens, head_dim, itemsize) <= SHARED_MEMORY_FOR_KV else 1


def ragged_paged_attention(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                           sm_scale, sliding_window=None, soft_cap=None, sinks=None,
                           interpret=False, q_block=None, kv_block_pages=None, num_warps=4,
                           num_stages=None):
    """See `reference.ragged_paged_attention`; returns (out, kv_cache)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, group = k.shape[1], query_group(q, k)
    num_pages, page_size = kv_cache.shape[:2]
    max_seqs, pages_per_seq = page_indices.shape
    if kv_block_pages is None:
        kv_block_pages = default_kv_block_pages(page_size, pages_per_seq)
    block_tokens = kv_block_pages * page_size
    check_shapes(block_tokens, head_dim, kv_cache.dtype.itemsize)
    if num_stages is None:
        num_stages = default_num_stages(block_tokens, head_dim, kv_cache.dtype.itemsize)
    kv_lens, page_indices, cu_q_lens, num_seqs = sanitize_metadata(
        kv_lens, page_indices, cu_q_lens, num_seqs, num_tokens)

    token_page, token_slot = new_token_slots(kv_lens, page_indices, cu_q_lens, num_tokens,
                                             page_size)
    kv_cache = write_new_kv_with_xla(kv_cache, k, v, token_page, token_slot)

    if q_block is None:
        q_block = default_q_block(num_tokens, max_seqs, group, max_rows=128)
    rows = max(16, next_power_of_two(q_block * group))
    item_seq, item_row0 = make_work_items(cu_q_lens, num_tokens, q_block)
    q_items = gather_queries(q, cu_q_lens, item_seq, item_row0, q_block, num_kv_heads, rows)
    # Whole KV steps of the page table, so that a step's slice of it is always in range.
    padded_pages = -(-pages_per_seq // kv_block_pages) * kv_block_pages
    page_indices = jnp.pad(page_indices, ((0, 0), (0, padded_pages - pages_per_seq)))

    kernel = functools.partial(
        _attention_kernel, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        q_block=q_block, group=group, page_size=page_size, kv_block_pages=kv_block_pages,
        has_sinks=sinks is not None)
    # The cache as [pages, page_size, Hkv, 2, D]: program (w, h) sees K of head h as one
    # [pages, page_size, D] operand and V as another, both views of the same buffer.
    cache = kv_cache.reshape(num_pages, page_size, num_kv_heads, 2, head_dim)
    whole_cache = (num_pages, page_size, None, None, head_dim)
    item_spec = pl.BlockSpec((None, None, rows, head_dim), lambda w, h: (w, h, 0, 0))
    metadata = [pl.BlockSpec(x.shape, lambda w, h, n=x.ndim: (0,) * n)
                for x in (item_seq, item_row0, kv_lens, cu_q_lens, num_seqs, page_indices)]
    sinks_in = []
    if sinks is not None:
        sinks_in = [sinks_by_row(check_sinks(sinks, num_q_heads), num_kv_heads, q_block, rows)]
    out_items = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q_items.shape, q.dtype),
        grid=(q_items.shape[0], num_kv_heads),
        in_specs=metadata + [
            item_spec,
            pl.BlockSpec(whole_cache, lambda w, h: (0, 0, h, 0, 0)),  # K
            pl.BlockSpec(whole_cache, lambda w, h: (0, 0, h, 1, 0)),  # V
        ] + [pl.BlockSpec((None, rows), lambda w, h: (h, 0))] * len(sinks_in),
        out_specs=item_spec,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(item_seq, item_row0, kv_lens, cu_q_lens, num_seqs, page_indices, q_items, cache, cache,
      *sinks_in)
    out = scatter_outputs(out_items, cu_q_lens, item_seq, item_row0, q_block, num_tokens,
                          num_q_heads)
    return out, kv_cache


def sinks_by_row(sinks, num_kv_heads, q_block, rows):
    """f32[Hq] -> [Hkv, rows]: row r * G + g of kv head h gets sinks[h * G + g] (the layout of
    gather_queries); rows past q_block * G (padding, dropped) get 0."""
    by_head = sinks.reshape(num_kv_heads, 1, -1)
    by_row = jnp.tile(by_head, (1, q_block, 1)).reshape(num_kv_heads, -1)
    return jnp.pad(by_row, ((0, 0), (0, rows - by_row.shape[1])))


def _attention_kernel(item_seq_ref, item_row0_ref, kv_lens_ref, cu_q_lens_ref, num_seqs_ref,
                      page_indices_ref, q_ref, k_ref, v_ref, *refs, sm_scale, sliding_window,
                      soft_cap, q_block, group, page_size, kv_block_pages, has_sinks):
    sinks_ref, o_ref = refs if has_sinks else (None, *refs)
    rows, head_dim = q_ref.shape
    max_seqs = kv_lens_ref.shape[0]
    block_tokens = kv_block_pages * page_size
    item = pl.program_id(0)
    item_seq = item_seq_ref[item]
    live = item_seq < num_seqs_ref[0]
    seq = jnp.minimum(item_seq, max_seqs - 1)  # unused item slots read row S-1 and attend nothing
    span = item_span(kv_lens_ref[seq], cu_q_lens_ref[seq + 1] - cu_q_lens_ref[seq],
                     item_row0_ref[item], q_block=q_block, page_size=page_size,
                     block_tokens=block_tokens, sliding_window=sliding_window)
    first_pos, num_rows, last_pos, pages_needed, start_block, end_block = span
    end_block = jnp.where(live, end_block, 0)

    row_in_item = jnp.arange(rows) // group  # row r * G + g is the item's token r
    row_pos = first_pos + row_in_item
    row_valid = row_in_item < num_rows
    q = q_ref[...]
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None  # no TF32 for f32

    def attend_block(block, carry):
        m_prev, l_prev, acc_prev = carry
        slot = block * kv_block_pages + jnp.arange(kv_block_pages)
        pages = page_indices_ref[seq, pl.ds(block * kv_block_pages, kv_block_pages)]
        pages = jnp.where(slot < pages_needed, pages, 0)  # past the needed pages: garbage
        k = k_ref[pages].reshape(block_tokens, head_dim)
        v = v_ref[pages].reshape(block_tokens, head_dim)
        key_pos = block * block_tokens + jnp.arange(block_tokens)
        # Slots past the last attended key hold stale data or NaN: p * NaN is NaN even at p=0.
        v = jnp.where((key_pos <= last_pos)[:, None], v, 0)
        scores_dtype = jnp.promote_types(q.dtype, k.dtype)  # as the reference's einsum
        q_, k = q.astype(scores_dtype), k.astype(scores_dtype)
        s = lax.dot_general(q_, k, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32) * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        mask = row_valid[:, None] & (key_pos[None, :] <= row_pos[:, None])
        if sliding_window is not None:
            mask &= row_pos[:, None] - key_pos[None, :] < sliding_window
        s = jnp.where(mask, s, MASK_VALUE)
        m_next = jnp.maximum(m_prev, s.max(axis=1))
        p = jnp.exp(s - m_next[:, None])
        alpha = jnp.exp(m_prev - m_next)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)
        return m_next, alpha * l_prev + p.sum(axis=1), alpha[:, None] * acc_prev + pv

    if sinks_ref is None:
        m_start, l_start = jnp.full((rows,), MASK_VALUE, jnp.float32), 0.0
    else:
        m_start, l_start = sinks_ref[...], 1.0
    carry = (m_start, jnp.full((rows,), l_start, jnp.float32),
             jnp.zeros((rows, head_dim), jnp.float32))
    _, l, acc = lax.fori_loop(start_block, end_block, attend_block, carry)
    # l >= 1 on real rows (their own key or sink scores exp(0)); 0 only where nothing was
    # attended and there is no sink.
    o_ref[...] = (acc / jnp.where(l == 0, 1.0, l)[:, None]).astype(o_ref.dtype)
