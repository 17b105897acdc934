"""What one program of the Pallas GPU attention's grid computes (kernel_gpu.py lays out the grid
and its operands): program (w, h, s) attends work item w's rows of kv head h (or of head group h,
MLA) over its share s of the item's KV blocks, an online softmax in float32, and writes its
normalized output or its split's partials. One-token items also attend their sequence's new keys
from k and v and write their own K/V into the cache (`_attend_and_write_new_kv`)."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from xlaserve.pallas_kernels.ragged_paged_attention.reference import widened
from xlaserve.pallas_kernels.ragged_paged_attention.work_items import (MASK_VALUE, chunk_starts,
                                                                        item_span, lse_of)


def attention_program(item_seq_ref, item_row0_ref, kv_lens_ref, cu_q_lens_ref, num_seqs_ref,
                      page_indices_ref, q_ref, *refs, sm_scale, sliding_window, soft_cap, q_block,
                      group, page_size, kv_block_pages, num_kv_splits, has_sinks, value_dim,
                      prefix_only, rows, direct, writes_new_kv, attention_chunk=None):
    # MHA (value_dim None): K and V of the program's kv head (one [.., 2, D] operand where the
    # kernel writes the new K/V itself); MLA: the latent cache.
    num_cache_refs = 2 if value_dim is None and not writes_new_kv else 1
    cache_refs, refs = refs[:num_cache_refs], refs[num_cache_refs:]
    new_kv_refs, refs = (refs[:3], refs[3:]) if writes_new_kv else ((), refs)
    sinks_ref, out_refs = (refs[0], refs[1:]) if has_sinks else (None, refs)
    if writes_new_kv:
        *out_refs, cache_out_ref = out_refs
    head_dim = q_ref.shape[-1]
    max_seqs = kv_lens_ref.shape[0]
    block_tokens = kv_block_pages * page_size
    item = pl.program_id(0)
    item_seq = item_seq_ref[item]
    live = item_seq < num_seqs_ref[0]
    seq = jnp.minimum(item_seq, max_seqs - 1)  # unused item slots read row S-1 and attend nothing
    q_len = cu_q_lens_ref[seq + 1] - cu_q_lens_ref[seq]
    span = item_span(kv_lens_ref[seq], q_len, item_row0_ref[item], q_block=q_block,
                     page_size=page_size, block_tokens=block_tokens,
                     sliding_window=sliding_window, attention_chunk=attention_chunk)
    first_pos, num_rows, last_pos, pages_needed, start_block, end_block = span
    if prefix_only or writes_new_kv:  # from the cache, the keys from before this step alone
        last_pos = kv_lens_ref[seq] - q_len - 1
        pages_needed, end_block = last_pos // page_size + 1, last_pos // block_tokens + 1
    end_block = jnp.where(live, end_block, 0)
    split = pl.program_id(2)
    if num_kv_splits > 1:  # this program's share of the item's blocks; later ones may be empty
        share = (jnp.maximum(end_block - start_block, 0) + num_kv_splits - 1) // num_kv_splits
        start_block = start_block + split * share
        end_block = jnp.minimum(end_block, start_block + share)

    if direct:
        # One token: row r is query head r % G of the program's group, read from q [T * Hq, D]
        # in place. Rows past G repeat the group's heads, so they compute the same outputs
        # bit for bit and their writes to the same rows below are harmless (no masked store:
        # every index stays in bounds, in interpret mode too).
        q_rows = (item * (pl.num_programs(1) * group) + pl.program_id(1) * group
                  + jnp.arange(rows) % group)
        row_in_item = jnp.zeros((rows,), jnp.int32)
    else:
        q_rows = slice(None)
        row_in_item = jnp.arange(rows) // group  # row r * G + g is the item's token r
    row_pos = first_pos + row_in_item
    row_valid = row_in_item < num_rows
    # Each row's first key in its attention chunk (from its own position, with prefix_only too).
    row_first_key = (None if attention_chunk is None
                     else chunk_starts(first_pos, row_in_item, attention_chunk))
    precision = lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None  # no TF32 for f32
    if value_dim is None:
        query_parts = [q_ref[q_rows]]
    else:  # MLA: the latent part and the RoPE'd part, each a power-of-two width for the dot
        query_parts = [q_ref[q_rows, pl.ds(0, value_dim)],
                       q_ref[q_rows, pl.ds(value_dim, head_dim - value_dim)]]

    def read_block(pages):
        """([key parts, as query_parts], values) of the block's pages, [block_tokens, width]."""
        if writes_new_kv and value_dim is None:
            (kv_ref,) = cache_refs
            return ([kv_ref[pages, :, 0].reshape(block_tokens, head_dim)],
                    kv_ref[pages, :, 1].reshape(block_tokens, head_dim))
        if value_dim is None:
            k_ref, v_ref = cache_refs
            return ([k_ref[pages].reshape(block_tokens, head_dim)],
                    v_ref[pages].reshape(block_tokens, head_dim))
        (cache_ref,) = cache_refs
        latent = cache_ref[pages, :, pl.ds(0, value_dim)].reshape(block_tokens, value_dim)
        rope_dim = head_dim - value_dim
        rope = cache_ref[pages, :, pl.ds(value_dim, rope_dim)].reshape(block_tokens, rope_dim)
        return [latent, rope], latent

    def attend_keys(carry, key_parts, v, key_pos, key_valid):
        """The online softmax over one block of keys at positions `key_pos` (`key_valid`: the
        block's keys a row may see at all; NaN-holding ones must be among the others)."""
        m_prev, l_prev, acc_prev = carry
        # An FP8 cache's rows in the queries' dtype. Slots past the last attended key hold
        # stale data or NaN: p * NaN is NaN even at p=0.
        v = jnp.where(key_valid[:, None], widened(v, q_ref.dtype), 0)
        s = 0.0
        for q, k in zip(query_parts, key_parts):
            k = widened(k, q.dtype)
            scores_dtype = jnp.promote_types(q.dtype, k.dtype)  # as the reference's einsum
            s += lax.dot_general(q.astype(scores_dtype), k.astype(scores_dtype),
                                 (((1,), (1,)), ((), ())), precision=precision,
                                 preferred_element_type=jnp.float32)
        s = s * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        mask = (row_valid[:, None] & key_valid[None, :]
                & (key_pos[None, :] <= row_pos[:, None]))
        if sliding_window is not None:
            mask &= row_pos[:, None] - key_pos[None, :] < sliding_window
        if row_first_key is not None:
            mask &= key_pos[None, :] >= row_first_key[:, None]
        s = jnp.where(mask, s, MASK_VALUE)
        m_next = jnp.maximum(m_prev, s.max(axis=1))
        p = jnp.exp(s - m_next[:, None])
        alpha = jnp.exp(m_prev - m_next)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)
        return m_next, alpha * l_prev + p.sum(axis=1), alpha[:, None] * acc_prev + pv

    def attend_block(block, carry):
        slot = block * kv_block_pages + jnp.arange(kv_block_pages)
        pages = page_indices_ref[seq, pl.ds(block * kv_block_pages, kv_block_pages)]
        pages = jnp.where(slot < pages_needed, pages, 0)  # past the needed pages: garbage
        key_parts, v = read_block(pages)
        key_pos = block * block_tokens + jnp.arange(block_tokens)
        return attend_keys(carry, key_parts, v, key_pos, key_pos <= last_pos)

    m_start = jnp.full((rows,), MASK_VALUE, jnp.float32)
    l_start = jnp.zeros((rows,), jnp.float32)
    if sinks_ref is not None:  # the sink joins one split's softmax (the merge adds up the rest)
        m_start = jnp.where(split == 0, sinks_ref[...], m_start)
        l_start = jnp.where(split == 0, 1.0, l_start)
    carry = (m_start, l_start, jnp.zeros((rows, value_dim or head_dim), jnp.float32))
    m, l, acc = lax.fori_loop(start_block, end_block, attend_block, carry)
    if writes_new_kv:
        m, l, acc = _attend_and_write_new_kv(
            new_kv_refs, cache_out_ref, attend_keys, (m, l, acc), item=item, live=live,
            first_new=kv_lens_ref[seq] - q_len, row0=item_row0_ref[item],
            first_token=cu_q_lens_ref[seq], cache_dtype=cache_refs[0].dtype,
            first_split=split == 0, value_dim=value_dim, row_dim=head_dim)
    if num_kv_splits == 1:
        # l >= 1 on real rows (their own key or sink scores exp(0)); 0 only where nothing was
        # attended and there is no sink.
        o_ref = out_refs[0]
        o_ref[q_rows] = (acc / jnp.where(l == 0, 1.0, l)[:, None]).astype(o_ref.dtype)
        if prefix_only:
            out_refs[1][...] = lse_of(m, l)
    else:
        acc_ref, m_ref, l_ref = out_refs
        acc_ref[...], m_ref[...], l_ref[...] = acc, m, l


NEW_KEYS_BLOCK = 16  # the step's own keys attended at a time from k and v (Triton's dot: >= 16)


def _attend_and_write_new_kv(new_kv_refs, cache_out_ref, attend_keys, carry, *, item, live,
                             first_new, row0, first_token, cache_dtype, first_split, value_dim,
                             row_dim):
    """For a one-token item (its token is `item`): the first split attends the keys of its
    sequence's new tokens up to its own (row0 + 1 of them, from `first_token` on) from the new
    rows, as the cache will hold them, and writes its token's rows into the cache (MHA: K and V
    of the program's kv head; MLA, `value_dim` given: the latent row, by the first head program);
    returns the carry. Other programs read only keys from before the step out of the cache, so no
    program reads a slot another writes."""
    rows_ref, page_ref, slot_ref = new_kv_refs
    num_kv_heads = pl.num_programs(1)
    head = pl.program_id(1)
    num_new = jnp.where(live & first_split, row0 + 1, 0)
    if value_dim is None:  # [T * Hkv * 2, D]: token t's K of head h at (t * Hkv + h) * 2, V next
        num_tokens = rows_ref.shape[0] // (2 * num_kv_heads)
        parts = lambda token: [rows_ref[(token * num_kv_heads + head) * 2],  # noqa: E731
                               rows_ref[(token * num_kv_heads + head) * 2 + 1]]
        cache_parts = lambda page, slot: [cache_out_ref.at[page, slot, 0],  # noqa: E731
                                          cache_out_ref.at[page, slot, 1]]
    else:  # [T, row_dim]: the latent part (also the values) and the RoPE'd part
        num_tokens = rows_ref.shape[0]
        widths = (pl.ds(0, value_dim), pl.ds(value_dim, row_dim - value_dim))
        parts = lambda token: [rows_ref[token, w] for w in widths]  # noqa: E731
        cache_parts = lambda page, slot: [cache_out_ref.at[page, slot, w]  # noqa: E731
                                          for w in widths]

    def attend_new(block, carry):
        index = block * NEW_KEYS_BLOCK + jnp.arange(NEW_KEYS_BLOCK)
        token = jnp.minimum(first_token + index, num_tokens - 1)
        key_parts = [x.astype(cache_dtype) for x in parts(token)]
        values = key_parts[1] if value_dim is None else key_parts[0]
        key_parts = key_parts[:1] if value_dim is None else key_parts
        return attend_keys(carry, key_parts, values, first_new + index, index < num_new)

    carry = lax.fori_loop(0, (num_new + NEW_KEYS_BLOCK - 1) // NEW_KEYS_BLOCK, attend_new, carry)
    page = page_ref[item]
    writer = live & first_split & (page >= 0)
    if value_dim is not None:  # every head program reads the row; one writes it
        writer &= head == 0

    @pl.when(writer)
    def _write():
        for target, part in zip(cache_parts(page, slot_ref[item]), parts(item), strict=True):
            target[...] = part.astype(cache_dtype)

    return carry
