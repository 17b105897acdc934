"""Ragged paged attention as a Pallas TPU (Mosaic) kernel.

Same signature and semantics as `reference.ragged_paged_attention` (the specification), plus
`interpret` (passed to `pallas_call`: False on a TPU, `pltpu.InterpretParams()` to simulate one on
CPU, DMAs and semaphores included) and the block sizes `q_block` / `kv_block_pages`.

`_attention` runs one grid step per work item (see work_items.py: up to `q_block` new tokens of
one sequence), so decode-only, prefill-only and mixed batches run the same grid. The metadata is
scalar-prefetched into SMEM; the step walks the item's KV pages `kv_block_pages` at a time, each
page one async DMA from HBM into a double-buffered VMEM block (block b+1 is in flight while b is
attended), and keeps an online softmax in float32 VMEM scratch. Every page of a block is read
once for all kv heads; each kv head attends with the G query heads of its group stacked as rows
of one matmul.

Across work items: while an item attends its last KV block, the next item's first block is
already being fetched into the other buffer, so a sequence boundary does not wait on a cold
fetch. The grid therefore runs in order ("arbitrary": the buffer slot and whether the next block
is in flight pass from step to step in SMEM); v5e and v6e have one TensorCore a chip, so no
megacore split is lost there.

New K/V are written by the kernel, not by an XLA scatter before it (which was one more pass over
the step's new rows and a scatter fusion per layer). The cache is aliased in -> out and stays in
HBM. A token-sized DMA cannot do it: a bfloat16 token is half of a packed 32-bit sublane, and
Mosaic refuses DMAs at unaligned offsets along tiled dimensions (the first design, a DMA per
token, compiled for float32 only; tests/kernels/test_compile_kernels.py). So the kernel writes
whole sublane tiles: each page that receives new tokens is already in the VMEM block for
attention; the item's new rows (gathered per item in the cache layout, a small
[W, rows, 2*Hkv*D] input) are merged into it there (a dynamic sublane roll and a select, in
float32, exact), the block is attended (so the item sees its own new keys), and the tiles of the
page that hold new rows (`written_tiles`: 16 rows of bfloat16, 8 of float32) are DMA'd back to
HBM, the other rows of those tiles as they were read. Writing whole pages back instead cost a
decode item a page per layer (256 tokens on v6e at 256 requests: ~67 MB a layer for 256 decode
rows of Llama-3.1-8B at tp 4, against ~4 MB in 16-row tiles). A later item of the same sequence
reads those pages, so before its first block is fetched the writes are waited for; another sequence's pages are never written in the same step (the prefix cache shares whole
pages only, and never the page a request writes: runtime/scheduler/prefix_cache.py), so its prefetch
starts before the writes.

Layout: the kernel works on the cache as `[pages, page_size, 2*Hkv*D]`: a page is one contiguous
DMA, tokens are sublanes, and K and V of head h are the lane ranges [2hD, 2hD+D) and
[2hD+D, 2hD+2D). With D = 64 a head's K|V pair is exactly 128 lanes, so head dim 64 needs no
padding. The runtime stores the cache in this shape (`transformer.kv_cache_shape`): a
`[pages, page_size, 2*Hkv, D]` array is tiled on TPU by its last two dims (a 64-wide head dim
padded to 128 lanes), so viewing it flat is a relayout copy of the whole cache per layer and step,
which compiling for v6e showed. `page_size` must be a multiple of 8 (16 for bfloat16) so that
each page DMA lands on whole sublane tiles (`tpu_shape_checks.check_shapes`).

Attention sinks (one logit per query head, `sinks`) sit in SMEM; each item starts the running max
of row r * G + g of kv head h at sinks[h * G + g] and the denominator at 1.

Nothing past a sequence's needed pages is fetched; slots past the last attended position (stale
or uninitialised VMEM) are masked in the scores and zeroed in V, since p * NaN is NaN even at p=0.
Padding tokens belong to no work item, so they write nothing.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from xlaserve.pallas_kernels.ragged_paged_attention.reference import (
    check_local, check_mla_shapes, check_sinks, widened)
from xlaserve.pallas_kernels.ragged_paged_attention.tpu_page_writes import (
    gather_new_rows, merge_new_rows, sublanes, written_tiles)
from xlaserve.pallas_kernels.ragged_paged_attention.tpu_shape_checks import check_shapes
from xlaserve.pallas_kernels.ragged_paged_attention.work_items import (
    MASK_VALUE, chunk_starts, default_q_block, gather_queries, item_span, lse_of, make_work_items,
    query_group, round_up, sanitize_metadata, scatter_outputs)

LANES = 128
KV_BUFFER_BYTES = 4 << 20  # one of the two KV blocks in VMEM
MAX_KV_BLOCK_TOKENS = 512


def default_kv_block_pages(page_size, token_bytes, pages_per_seq):
    """Pages per KV block: up to 512 tokens, at most 4 MiB per buffer (two are live), so that
    the double buffer, the f32 scores and the accumulators fit the default scoped VMEM.
    `token_bytes`: one token's cache row (2 * Hkv * D entries, or MLA's latent row)."""
    tokens = min(MAX_KV_BLOCK_TOKENS, KV_BUFFER_BYTES // token_bytes)
    return max(1, min(tokens // page_size, pages_per_seq))


def ragged_paged_attention(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                           sm_scale, sliding_window=None, soft_cap=None, sinks=None,
                           interpret=False, q_block=None, kv_block_pages=None, prefix_only=False,
                           attention_chunk=None):
    """See `reference.ragged_paged_attention`; returns (out, kv_cache), or with `prefix_only`
    (out, lse, kv_cache)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, group = k.shape[1], query_group(q, k)
    num_pages, page_size = kv_cache.shape[:2]
    if sinks is not None:
        sinks = check_sinks(sinks, num_q_heads)
    sliding_window, attention_chunk = check_local(sliding_window, attention_chunk)
    # Free only when the cache is stored flat (the runtime's layout); a [.., 2*Hkv, D] array is
    # tiled on its last two dims on TPU, and this reshape would copy the whole cache.
    flat_cache = kv_cache.reshape(num_pages, page_size, 2 * num_kv_heads * head_dim)
    new_kv = jnp.stack([k, v], axis=2).reshape(num_tokens, -1)  # K of kv head h, then its V
    *out, flat_cache = _attend_items(
        q, new_kv, flat_cache, sinks, kv_lens, page_indices, cu_q_lens, num_seqs,
        num_kv_heads=num_kv_heads, group=group, q_block=q_block, kv_block_pages=kv_block_pages,
        interpret=interpret, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        prefix_only=prefix_only, attention_chunk=attention_chunk)
    return (*out, flat_cache.reshape(kv_cache.shape))


def mla_ragged_paged_attention(q, latent, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs,
                               *, sm_scale, value_dim, interpret=False, q_block=None,
                               kv_block_pages=None, prefix_only=False):
    """See `reference.mla_ragged_paged_attention`: the same kernel with one kv head whose keys
    are the cache rows' first Dk lanes and values their first `value_dim` lanes (every query head
    is in the one group). The cache's rows should be whole 128-lane tiles (Dc a multiple of 128:
    transformer.kv_cache_shape pads them). Returns (out, kv_cache); with `prefix_only` (out, lse,
    kv_cache) over each sequence's keys from before this step: the new rows are written as
    always, and the blocks past the prefix are read for that but not attended."""
    check_mla_shapes(q, latent, kv_cache, value_dim)
    latent = jnp.pad(latent, ((0, 0), (0, kv_cache.shape[2] - q.shape[2])))  # to the cache's lanes
    return _attend_items(
        q, latent, kv_cache, None, kv_lens, page_indices, cu_q_lens, num_seqs, num_kv_heads=1,
        group=q.shape[1], q_block=q_block, kv_block_pages=kv_block_pages, interpret=interpret,
        sm_scale=sm_scale, sliding_window=None, soft_cap=None, value_dim=value_dim,
        prefix_only=prefix_only, attention_chunk=None)


def _attend_items(q, new_rows, flat_cache, sinks, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                  num_kv_heads, group, q_block, kv_block_pages, interpret, **static):
    """What both entries share: the shape checks, the metadata sanitized, the work items, q and
    the new rows [T, lanes] (in the cache's token layout) gathered per item, the kernel, and the
    outputs back in token order. Returns (out [T, Hq, value_dim or D], flat_cache), or with
    static["prefix_only"] (out, lse [T, Hq] float32, flat_cache)."""
    num_tokens, num_q_heads = q.shape[:2]
    page_size = flat_cache.shape[1]
    max_seqs, pages_per_seq = page_indices.shape
    check_shapes(page_size, flat_cache.dtype, max_seqs, pages_per_seq)
    kv_lens, page_indices, cu_q_lens, num_seqs = sanitize_metadata(
        kv_lens, page_indices, cu_q_lens, num_seqs, num_tokens)
    if q_block is None:
        q_block = default_q_block(num_tokens, max_seqs, group)
    if kv_block_pages is None:
        kv_block_pages = default_kv_block_pages(
            page_size, flat_cache.shape[2] * flat_cache.dtype.itemsize, pages_per_seq)
    item_seq, item_row0 = make_work_items(cu_q_lens, num_tokens, q_block)
    rows = round_up(q_block * group, sublanes(q.dtype))
    q_items = gather_queries(q, cu_q_lens, item_seq, item_row0, q_block, num_kv_heads, rows)
    new_items = gather_new_rows(new_rows, flat_cache.dtype, cu_q_lens, item_seq, item_row0,
                                q_block)
    *out_items, flat_cache = _attention(
        q_items, new_items, flat_cache, sinks, item_seq, item_row0, kv_lens, cu_q_lens, num_seqs,
        page_indices, q_block=q_block, group=group, kv_block_pages=kv_block_pages,
        interpret=interpret, **static)
    outs = [scatter_outputs(x, cu_q_lens, item_seq, item_row0, q_block, num_tokens, num_q_heads)
            for x in out_items]
    if static.get("prefix_only"):  # the lse's one lane; padding tokens (0 there) have no key
        live = jnp.arange(num_tokens) < cu_q_lens[num_seqs[0]]
        outs[1] = jnp.where(live[:, None], outs[1][..., 0], -jnp.inf)
    return (*outs, flat_cache)


def _attention(q_items, new_kv_items, flat_cache, sinks, item_seq, item_row0, kv_lens, cu_q_lens,
               num_seqs, page_indices, *, kv_block_pages, interpret, value_dim=None,
               prefix_only=False, **static):
    """The pallas_call. value_dim None: MHA, kv head h's K and V at lanes [2hD, 2hD+D) and
    [2hD+D, 2hD+2D); else MLA, one kv head whose K is the whole row and V its first value_dim
    lanes (the output's width)."""
    num_items, num_kv_heads, rows, head_dim = q_items.shape
    out_dim = value_dim or head_dim
    page_size = flat_cache.shape[1]
    pages_per_seq = page_indices.shape[1]
    block_tokens = kv_block_pages * page_size
    kernel = functools.partial(_attention_kernel, page_size=page_size, pages_per_seq=pages_per_seq,
                               kv_block_pages=kv_block_pages, has_sinks=sinks is not None,
                               value_dim=value_dim, prefix_only=prefix_only, **static)
    item_spec = pl.BlockSpec((1, num_kv_heads, rows, head_dim), lambda w, *_: (w, 0, 0, 0))
    out_spec = pl.BlockSpec((1, num_kv_heads, rows, out_dim), lambda w, *_: (w, 0, 0, 0))
    new_kv_spec = pl.BlockSpec((1,) + new_kv_items.shape[1:], lambda w, *_: (w, 0, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    in_specs = [item_spec, new_kv_spec, hbm]
    inputs = [q_items, new_kv_items, flat_cache]
    if sinks is not None:  # a few scalars, read once per item
        in_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
        inputs.append(sinks)
    scratch = [
        pltpu.VMEM((2, block_tokens, flat_cache.shape[2]), flat_cache.dtype),  # KV double buffer
        # One per buffer (all page reads of a block signal it), and one for the page writes.
        pltpu.SemaphoreType.DMA((3,)),
        # From one item to the next: the buffer of its first KV block, and whether the previous
        # item already started fetching that block.
        pltpu.SMEM((2,), jnp.int32),
        pltpu.VMEM((num_kv_heads, rows, LANES), jnp.float32),  # running max, lane-replicated
        pltpu.VMEM((num_kv_heads, rows, LANES), jnp.float32),  # running denominator
        pltpu.VMEM((num_kv_heads, rows, out_dim), jnp.float32),  # running numerator
    ]
    num_scalars = 6
    out_shape = [jax.ShapeDtypeStruct(q_items.shape[:3] + (out_dim,), q_items.dtype)]
    out_specs = [out_spec]
    if prefix_only:  # each row's log-sum-exp, one lane
        out_shape.append(jax.ShapeDtypeStruct(q_items.shape[:3] + (1,), jnp.float32))
        out_specs.append(pl.BlockSpec((1, num_kv_heads, rows, 1), lambda w, *_: (w, 0, 0, 0)))
    return pl.pallas_call(
        kernel,
        out_shape=(*out_shape, jax.ShapeDtypeStruct(flat_cache.shape, flat_cache.dtype)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=num_scalars, grid=(num_items,),
            in_specs=in_specs, out_specs=(*out_specs, hbm),
            scratch_shapes=scratch),
        input_output_aliases={num_scalars + 2: len(out_shape)},  # the cache, updated in place
        # In order: an item waits for the KV block the previous one prefetched, and reads the
        # pages an earlier item of its sequence wrote.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
    )(item_seq, item_row0, kv_lens, cu_q_lens, num_seqs, page_indices.reshape(-1), *inputs)


def _attention_kernel(item_seq_ref, item_row0_ref, kv_lens_ref, cu_q_lens_ref, num_seqs_ref,
                      page_indices_ref, q_ref, new_kv_ref, _cache_in, *refs, sm_scale,
                      sliding_window, soft_cap, q_block, group, page_size, pages_per_seq,
                      kv_block_pages, has_sinks, value_dim, prefix_only, attention_chunk):
    sinks_ref, refs = (refs[0], refs[1:]) if has_sinks else (None, refs)
    lse_ref, refs = (refs[1], refs[:1] + refs[2:]) if prefix_only else (None, refs)
    # The cache is read and written through the output, the same HBM buffer as the input.
    o_ref, cache_hbm, kv_buf, sems, state_ref, m_ref, l_ref, acc_ref = refs
    write_sem = sems.at[2]
    item, num_items = pl.program_id(0), pl.num_programs(0)
    block_tokens = kv_block_pages * page_size
    tile = sublanes(cache_hbm.dtype)
    live_seqs, max_seqs = num_seqs_ref[0], kv_lens_ref.shape[0]

    def span_of(w, seq):
        return item_span(kv_lens_ref[seq], cu_q_lens_ref[seq + 1] - cu_q_lens_ref[seq],
                         item_row0_ref[w], q_block=q_block, page_size=page_size,
                         block_tokens=block_tokens, sliding_window=sliding_window,
                         attention_chunk=attention_chunk)

    def for_each_page(seq, pages_needed, block, slot, action):
        """action(copy) on the page reads of KV block `block` of `seq` into buffer `slot`."""
        def body(p, carry):
            page = page_indices_ref[seq * pages_per_seq + block * kv_block_pages + p]
            dst = kv_buf.at[slot, pl.ds(pl.multiple_of(p * page_size, page_size), page_size)]
            action(pltpu.make_async_copy(cache_hbm.at[page], dst, sems.at[slot]))
            return carry
        count = jnp.clip(pages_needed - block * kv_block_pages, 0, kv_block_pages)
        lax.fori_loop(0, count, body, 0)

    @pl.when(item == 0)
    def _():
        state_ref[0], state_ref[1] = 0, 0

    seq = item_seq_ref[item]

    @pl.when(seq >= live_seqs)
    def _():  # an unused item slot (they all come last); its rows are dropped by the wrapper
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
        if lse_ref is not None:
            lse_ref[...] = jnp.full(lse_ref.shape, -jnp.inf, jnp.float32)
        state_ref[1] = 0

    @pl.when(seq < live_seqs)
    def _():
        span = span_of(item, seq)
        first_slot = state_ref[0]
        # The last key attended: the row's own position (a bound per row, in the step), or with
        # prefix_only the last one before this step's new tokens.
        last_key = span.last_pos
        if prefix_only:
            last_key = kv_lens_ref[seq] - (cu_q_lens_ref[seq + 1] - cu_q_lens_ref[seq]) - 1

        @pl.when(state_ref[1] == 0)
        def _():  # the first item (or one whose block nobody prefetched)
            for_each_page(seq, span.pages_needed, span.start_block, first_slot,
                          lambda copy: copy.start())

        following = jnp.minimum(item + 1, num_items - 1)
        next_seq = item_seq_ref[following]
        next_live = (item + 1 < num_items) & (next_seq < live_seqs)
        next_span = span_of(following, jnp.minimum(next_seq, max_seqs - 1))
        # A next item of this sequence reads the pages this one writes: it is fetched only after
        # the writes are done. Another sequence's first block is fetched at once.
        next_same_seq = next_live & (next_seq == seq)

        def prefetch_next(slot):
            for_each_page(next_seq, next_span.pages_needed, next_span.start_block, slot,
                          lambda copy: copy.start())

        def for_each_written_page(block, slot, action):
            """action(page, rows in VMEM, the page in HBM) on each page of the block that
            receives some of the item's new tokens (positions first_pos .. last_pos)."""
            block_page0 = block * kv_block_pages
            first = jnp.maximum(span.first_pos // page_size, block_page0)
            last = jnp.minimum(span.last_pos // page_size, block_page0 + kv_block_pages - 1)

            def body(page, carry):
                offset = pl.multiple_of((page - block_page0) * page_size, page_size)
                rows = kv_buf.at[slot, pl.ds(offset, page_size)]
                action(page, rows, cache_hbm.at[page_indices_ref[seq * pages_per_seq + page]])
                return carry
            lax.fori_loop(first, last + 1, body, 0)

        def write_tiles(page, rows, dst, action):
            """action(copy) on the copies to HBM of the page's tiles that hold new tokens."""
            first, end = written_tiles(page * page_size, span.first_pos, span.last_pos,
                                       page_size=page_size, tile=tile)

            def body(t, carry):
                window = pl.ds(pl.multiple_of(t * tile, tile), tile)
                action(pltpu.make_async_copy(rows.at[window], dst.at[window], write_sem))
                return carry
            lax.fori_loop(first, end, body, 0)

        def write_page(page, rows, dst):
            merge_new_rows(rows, new_kv_ref, page_pos=page * page_size,
                            first_pos=span.first_pos, last_pos=span.last_pos)
            write_tiles(page, rows, dst, lambda copy: copy.start())

        if sinks_ref is None:
            m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
            l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        else:
            _start_at_sinks(sinks_ref, m_ref, l_ref, group)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        def attend_block(block, carry):
            slot = (first_slot + block - span.start_block) % 2
            last = block + 1 == span.end_block

            @pl.when(jnp.logical_not(last))
            def _():
                for_each_page(seq, span.pages_needed, block + 1, 1 - slot,
                              lambda copy: copy.start())

            @pl.when(last & next_live & jnp.logical_not(next_same_seq))
            def _():
                prefetch_next(1 - slot)

            for_each_page(seq, span.pages_needed, block, slot, lambda copy: copy.wait())
            for_each_written_page(block, slot, write_page)  # before attending: own keys too
            wait_writes = lambda: for_each_written_page(
                block, slot, lambda *page: write_tiles(*page, lambda copy: copy.wait()))

            @pl.when(last & next_same_seq)
            def _():
                wait_writes()
                prefetch_next(1 - slot)

            attend = functools.partial(
                _online_softmax_step, q_ref, kv_buf.at[slot], m_ref, l_ref, acc_ref,
                key0=block * block_tokens, first_pos=span.first_pos, last_pos=last_key,
                num_rows=span.num_rows, group=group, sm_scale=sm_scale,
                sliding_window=sliding_window, soft_cap=soft_cap, value_dim=value_dim,
                prefix_only=prefix_only, attention_chunk=attention_chunk)
            if prefix_only:  # a block of new tokens alone is read for its writes, not attended
                pl.when(block * block_tokens <= last_key)(attend)
            else:
                attend()

            @pl.when(jnp.logical_not(last & next_same_seq))
            def _():  # the buffer is refilled two blocks on; the next item may read these pages
                wait_writes()
            return carry

        lax.fori_loop(span.start_block, span.end_block, attend_block, 0)
        num_blocks = jnp.maximum(span.end_block - span.start_block, 0)
        state_ref[0] = (first_slot + num_blocks) % 2
        state_ref[1] = (next_live & (num_blocks > 0)).astype(jnp.int32)
        for h in range(o_ref.shape[1]):
            # l >= 1 on every real row (its own key or its sink scores exp(0)); padding rows only
            # see MASK_VALUE scores, so l counts the block's keys there (or is the sink's 1).
            # With prefix_only a row without a prefix attended nothing: l = 0, acc = 0.
            l = l_ref[h][:, :1]
            if prefix_only:
                lse_ref[0, h] = lse_of(m_ref[h][:, :1], l)
                l = jnp.where(l == 0, 1.0, l)
            o_ref[0, h] = (acc_ref[h] / l).astype(o_ref.dtype)


def _token_of_row(row, group: int):
    """Row i of a kv head's block is the item's token i // G (query head i % G of the group).
    Vector integer division is not a TPU instruction; i + 0.5 keeps the float quotient away from
    integers, so the floor is exact."""
    return jnp.floor((row.astype(jnp.float32) + 0.5) * (1.0 / group)).astype(jnp.int32)


def _start_at_sinks(sinks_ref, m_ref, l_ref, group):
    """The online softmax's state before any key: the running max of row (token, g) of kv head h
    at its query head's sink, sinks[h * G + g], and the denominator at e^0 = 1."""
    num_kv_heads, rows, lanes = m_ref.shape
    row = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    head_in_group = row - _token_of_row(row, group) * group
    for h in range(num_kv_heads):
        m = jnp.zeros((rows, lanes), jnp.float32)
        for g in range(group):  # G selects from scalars, once per item
            m = jnp.where(head_in_group == g, sinks_ref[h * group + g], m)
        m_ref[h] = m
    l_ref[...] = jnp.ones(l_ref.shape, jnp.float32)


def _online_softmax_step(q_ref, kv, m_ref, l_ref, acc_ref, *, key0, first_pos, last_pos, num_rows,
                         group, sm_scale, sliding_window, soft_cap, value_dim, prefix_only=False,
                         attention_chunk=None):
    """Folds one KV block (kv: [block_tokens, 2*Hkv*D] in VMEM, keys key0.. ; with value_dim,
    MLA's [block_tokens, Dk]) into the running max / denominator / numerator of every kv head."""
    num_kv_heads, rows, head_dim = q_ref.shape[1:]
    block_tokens = kv.shape[0]
    key_pos = key0 + lax.broadcasted_iota(jnp.int32, (1, block_tokens), 1)
    row_in_item = _token_of_row(lax.broadcasted_iota(jnp.int32, (rows, 1), 0), group)
    row_pos = first_pos + row_in_item
    mask = (row_in_item < num_rows) & (key_pos <= row_pos)
    if prefix_only:  # last_pos: the prefix's last key, before every row of the item
        mask &= key_pos <= last_pos
    if sliding_window is not None:
        mask &= row_pos - key_pos < sliding_window
    if attention_chunk is not None:  # from each row's own position, with prefix_only too
        mask &= key_pos >= chunk_starts(first_pos, row_in_item, attention_chunk)
    key_attended = key0 + lax.broadcasted_iota(jnp.int32, (block_tokens, 1), 0) <= last_pos

    for h in range(num_kv_heads):
        q = q_ref[0, h]
        if value_dim is None:
            k = kv[:, pl.ds(2 * h * head_dim, head_dim)]
            v = kv[:, pl.ds((2 * h + 1) * head_dim, head_dim)]
        else:  # MLA: the latent row is the key (not its padding lanes), its start the value
            k, v = kv[:, :head_dim], kv[:, :value_dim]
        k, v = widened(k, q.dtype), widened(v, q.dtype)  # an FP8 cache's rows
        v = jnp.where(key_attended, v, 0)
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
