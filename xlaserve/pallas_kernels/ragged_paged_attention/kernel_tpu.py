"""Ragged paged attention as a Pallas TPU (Mosaic) kernel.

Same signature and semantics as `reference.ragged_paged_attention` (the specification), plus
`interpret` (passed to `pallas_call`: False on a TPU, `pltpu.InterpretParams()` to simulate one on
CPU, DMAs and semaphores included) and the block sizes `q_block` / `kv_block_pages`.

Two kernels, one after the other in the caller's jit:
1. `_write_new_kv`: a DMA per new token from HBM straight into its cache slot (the cache is an
   aliased HBM operand, so it is updated in place when donated).
2. `_attention`: one grid step per work item (see work_items.py: up to `q_block` new tokens of one
   sequence), so decode-only, prefill-only and mixed batches run the same grid. The metadata is
   scalar-prefetched into SMEM; the step walks the item's KV pages `kv_block_pages` at a time,
   each page one async DMA from HBM into a double-buffered VMEM block (block b+1 is in flight
   while b is attended), and keeps an online softmax in float32 VMEM scratch. Every page of a
   block is read once for all kv heads; each kv head attends with the G query heads of its group
   stacked as rows of one matmul.

Layout: the cache `[pages, page_size, 2*Hkv, D]` is viewed (free reshape) as
`[pages, page_size, 2*Hkv*D]`: a page is one contiguous DMA, tokens are sublanes, and K and V of
head h are the lane ranges [2hD, 2hD+D) and [2hD+D, 2hD+2D). With D = 64 a head's K|V pair is
exactly 128 lanes, so head dim 64 needs no padding of the cache (which would be a copy). On a real
TPU `page_size` should be a multiple of 8 (16 for bfloat16) so that each page DMA lands on whole
sublane tiles.

Nothing past a sequence's needed pages is fetched; slots past the last attended position (stale
or uninitialised VMEM) are masked in the scores and zeroed in V, since p * NaN is NaN even at p=0.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from xlaserve.pallas_kernels.ragged_paged_attention.work_items import (
    MASK_VALUE, default_q_block, gather_queries, item_span, make_work_items, new_token_slots,
    query_group, round_up, sanitize_metadata, scatter_outputs)

LANES = 128
KV_BUFFER_BYTES = 4 << 20  # one of the two KV blocks in VMEM
MAX_KV_BLOCK_TOKENS = 512
WRITE_TOKENS_PER_STEP = 64  # DMAs in flight per grid step of the cache update


def default_kv_block_pages(page_size, num_kv_heads, head_dim, itemsize, pages_per_seq):
    """Pages per KV block: up to 512 tokens, at most 4 MiB per buffer (two are live), so that
    the double buffer, the f32 scores and the accumulators fit the default scoped VMEM."""
    token_bytes = 2 * num_kv_heads * head_dim * itemsize
    tokens = min(MAX_KV_BLOCK_TOKENS, KV_BUFFER_BYTES // token_bytes)
    return max(1, min(tokens // page_size, pages_per_seq))


def sublanes(dtype) -> int:
    """Rows of one VMEM tile: 8 for 32-bit types, 16 for bfloat16 (two rows packed)."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def ragged_paged_attention(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                           sm_scale, sliding_window=None, soft_cap=None, interpret=False,
                           q_block=None, kv_block_pages=None):
    """See `reference.ragged_paged_attention`; returns (out, kv_cache)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, group = k.shape[1], query_group(q, k)
    num_pages, page_size = kv_cache.shape[:2]
    max_seqs, pages_per_seq = page_indices.shape
    kv_lens, page_indices, cu_q_lens, num_seqs = sanitize_metadata(
        kv_lens, page_indices, cu_q_lens, num_seqs, num_tokens)

    flat_cache = kv_cache.reshape(num_pages, page_size, 2 * num_kv_heads * head_dim)
    token_page, token_slot = new_token_slots(kv_lens, page_indices, cu_q_lens, num_tokens,
                                             page_size)
    new_kv = jnp.stack([k, v], axis=2).reshape(num_tokens, 1, -1).astype(kv_cache.dtype)
    flat_cache = _write_new_kv(new_kv, flat_cache, token_page, token_slot, interpret)

    if q_block is None:
        q_block = default_q_block(num_tokens, max_seqs, group)
    if kv_block_pages is None:
        kv_block_pages = default_kv_block_pages(page_size, num_kv_heads, head_dim,
                                                kv_cache.dtype.itemsize, pages_per_seq)
    item_seq, item_row0 = make_work_items(cu_q_lens, num_tokens, q_block)
    rows = round_up(q_block * group, sublanes(q.dtype))
    q_items = gather_queries(q, cu_q_lens, item_seq, item_row0, q_block, num_kv_heads, rows)
    out_items = _attention(q_items, flat_cache, item_seq, item_row0, kv_lens, cu_q_lens, num_seqs,
                           page_indices, sm_scale=sm_scale, sliding_window=sliding_window,
                           soft_cap=soft_cap, q_block=q_block, group=group,
                           kv_block_pages=kv_block_pages, interpret=interpret)
    out = scatter_outputs(out_items, cu_q_lens, item_seq, item_row0, q_block, num_tokens,
                          num_q_heads)
    return out, flat_cache.reshape(kv_cache.shape)


def _write_new_kv(new_kv, flat_cache, token_page, token_slot, interpret):
    """new_kv [T, 1, 2*Hkv*D] into flat_cache [pages, page_size, 2*Hkv*D] at (page, slot);
    tokens with page -1 (padding) are skipped."""
    num_tokens = new_kv.shape[0]
    padded = round_up(num_tokens, WRITE_TOKENS_PER_STEP)
    token_page = jnp.pad(token_page, (0, padded - num_tokens), constant_values=-1)
    token_slot = jnp.pad(token_slot, (0, padded - num_tokens))

    def kernel(token_page_ref, token_slot_ref, new_kv_hbm, _cache_in, cache_hbm, sem):
        first = pl.program_id(0) * WRITE_TOKENS_PER_STEP

        def for_each_live_token(action):
            def body(t, carry):
                token = first + t
                page = token_page_ref[token]

                @pl.when(page >= 0)
                def _():
                    action(pltpu.make_async_copy(
                        new_kv_hbm.at[token], cache_hbm.at[page, pl.ds(token_slot_ref[token], 1)],
                        sem.at[0]))
                return carry
            lax.fori_loop(0, WRITE_TOKENS_PER_STEP, body, 0)

        # Start them all, then wait for them all: the DMAs of a step overlap one another.
        for_each_live_token(lambda copy: copy.start())
        for_each_live_token(lambda copy: copy.wait())

    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(flat_cache.shape, flat_cache.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(padded // WRITE_TOKENS_PER_STEP,),
            in_specs=[any_spec, any_spec], out_specs=any_spec,
            scratch_shapes=[pltpu.SemaphoreType.DMA((1,))]),
        input_output_aliases={3: 0},  # operands count the scalar-prefetch ones: the cache is 3
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
    )(token_page, token_slot, new_kv, flat_cache)


def _attention(q_items, flat_cache, item_seq, item_row0, kv_lens, cu_q_lens, num_seqs,
               page_indices, *, kv_block_pages, interpret, **static):
    num_items, num_kv_heads, rows, head_dim = q_items.shape
    page_size = flat_cache.shape[1]
    pages_per_seq = page_indices.shape[1]
    block_tokens = kv_block_pages * page_size
    kernel = functools.partial(_attention_kernel, page_size=page_size, pages_per_seq=pages_per_seq,
                               kv_block_pages=kv_block_pages, **static)
    item_spec = pl.BlockSpec((1, num_kv_heads, rows, head_dim), lambda w, *_: (w, 0, 0, 0))
    scratch = [
        pltpu.VMEM((2, block_tokens, flat_cache.shape[2]), flat_cache.dtype),  # KV double buffer
        pltpu.SemaphoreType.DMA((2,)),  # one per buffer: all page DMAs of a block signal it
        pltpu.VMEM((num_kv_heads, rows, LANES), jnp.float32),  # running max, lane-replicated
        pltpu.VMEM((num_kv_heads, rows, LANES), jnp.float32),  # running denominator
        pltpu.VMEM((num_kv_heads, rows, head_dim), jnp.float32),  # running numerator
    ]
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q_items.shape, q_items.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6, grid=(num_items,),
            in_specs=[item_spec, pl.BlockSpec(memory_space=pl.ANY)], out_specs=item_spec,
            scratch_shapes=scratch),
        # Items are independent (all DMAs are started and waited within a step), so megacore
        # chips may split them between their cores.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
    )(item_seq, item_row0, kv_lens, cu_q_lens, num_seqs, page_indices.reshape(-1), q_items,
      flat_cache)


def _attention_kernel(item_seq_ref, item_row0_ref, kv_lens_ref, cu_q_lens_ref, num_seqs_ref,
                      page_indices_ref, q_ref, cache_hbm, o_ref, kv_buf, sems, m_ref, l_ref,
                      acc_ref, *, sm_scale, sliding_window, soft_cap, q_block, group, page_size,
                      pages_per_seq, kv_block_pages):
    item = pl.program_id(0)
    seq = item_seq_ref[item]

    @pl.when(seq >= num_seqs_ref[0])
    def _():  # an unused item slot; its rows are dropped by the wrapper
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    @pl.when(seq < num_seqs_ref[0])
    def _():
        block_tokens = kv_block_pages * page_size
        span = item_span(kv_lens_ref[seq], cu_q_lens_ref[seq + 1] - cu_q_lens_ref[seq],
                         item_row0_ref[item], q_block=q_block, page_size=page_size,
                         block_tokens=block_tokens, sliding_window=sliding_window)
        first_pos, num_rows, last_pos, pages_needed, start_block, end_block = span

        def for_each_page(block, slot, action):
            def body(p, carry):
                page = page_indices_ref[seq * pages_per_seq + block * kv_block_pages + p]
                dst = kv_buf.at[slot, pl.ds(pl.multiple_of(p * page_size, page_size), page_size)]
                action(pltpu.make_async_copy(cache_hbm.at[page], dst, sems.at[slot]))
                return carry
            count = jnp.clip(pages_needed - block * kv_block_pages, 0, kv_block_pages)
            lax.fori_loop(0, count, body, 0)

        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        for_each_page(start_block, start_block % 2, lambda copy: copy.start())

        def attend_block(block, carry):
            slot = block % 2

            @pl.when(block + 1 < end_block)
            def _():
                for_each_page(block + 1, 1 - slot, lambda copy: copy.start())

            for_each_page(block, slot, lambda copy: copy.wait())
            _online_softmax_step(q_ref, kv_buf.at[slot], m_ref, l_ref, acc_ref,
                                 key0=block * block_tokens, first_pos=first_pos,
                                 last_pos=last_pos, num_rows=num_rows, group=group,
                                 sm_scale=sm_scale, sliding_window=sliding_window,
                                 soft_cap=soft_cap)
            return carry

        lax.fori_loop(start_block, end_block, attend_block, 0)
        for h in range(o_ref.shape[1]):
            # l >= 1 on every real row (its own key scores exp(0)); padding rows only see
            # MASK_VALUE scores, so l counts the block's keys there and is never 0 either.
            o_ref[0, h] = (acc_ref[h] / l_ref[h][:, :1]).astype(o_ref.dtype)


def _online_softmax_step(q_ref, kv, m_ref, l_ref, acc_ref, *, key0, first_pos, last_pos, num_rows,
                         group, sm_scale, sliding_window, soft_cap):
    """Folds one KV block (kv: [block_tokens, 2*Hkv*D] in VMEM, keys key0.. ) into the running
    max / denominator / numerator of every kv head."""
    num_kv_heads, rows, head_dim = acc_ref.shape
    block_tokens = kv.shape[0]
    key_pos = key0 + lax.broadcasted_iota(jnp.int32, (1, block_tokens), 1)
    # Row i is token i // group of the item. Vector integer division is not a TPU instruction;
    # i + 0.5 keeps the float quotient away from integers, so the floor is exact.
    row_in_item = jnp.floor((lax.broadcasted_iota(jnp.int32, (rows, 1), 0).astype(jnp.float32)
                             + 0.5) * (1.0 / group)).astype(jnp.int32)
    row_pos = first_pos + row_in_item
    mask = (row_in_item < num_rows) & (key_pos <= row_pos)
    if sliding_window is not None:
        mask &= row_pos - key_pos < sliding_window
    key_attended = key0 + lax.broadcasted_iota(jnp.int32, (block_tokens, 1), 0) <= last_pos

    for h in range(num_kv_heads):
        q = q_ref[0, h]
        k = kv[:, pl.ds(2 * h * head_dim, head_dim)]
        v = jnp.where(key_attended, kv[:, pl.ds((2 * h + 1) * head_dim, head_dim)], 0)
        if q.dtype != k.dtype:
            q, k = q.astype(jnp.float32), k.astype(jnp.float32)
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = jnp.where(mask, s, MASK_VALUE)
        m_prev = m_ref[h]
        m_next = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
        p = jnp.exp(s - m_next[:, :1])
        alpha = jnp.exp(m_prev - m_next)
        m_ref[h] = m_next
        l_ref[h] = alpha * l_ref[h] + p.sum(axis=1, keepdims=True)
        pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        acc_ref[h] = acc_ref[h] * alpha[:, :1] + pv
