"""Ragged paged attention in pure jnp: the specification every kernel is tested against, and the
CPU production path.

The batch is cut into *work items*: a work item is one block of `q_block` query rows restricted to
one sequence. Each item gathers its sequence's KV pages once and attends with all of its rows in one
batched matmul. Decode batches (one new token per sequence) get `q_block == 1`, so there is one item
and one KV gather per sequence and no wasted query rows; prefill and mixed batches get big query
blocks, so a long prompt reads its KV once per block of rows instead of once per token. A block
that straddles a sequence boundary becomes several items, which bounds the item count statically by
`min(num_blocks * q_block, num_blocks + S - 1)` and keeps every shape static for jit.

Long contexts are read in chunks of `kv_block_pages` pages with an online softmax; the loop runs
only as many chunks as the longest live sequence needs, so an over-provisioned page table costs
nothing, and it skips chunks that every query's sliding window or attention chunk has left behind.

Local attention, per layer, one kind at most: a sliding window w (a query at position q sees
keys q - w < k <= q; Gemma 3, Mistral) or an attention chunk C (q sees k <= q with k // C ==
q // C, i.e. k >= q - q % C: Llama 4's RoPE layers). Both bound a row's keys from below
(`first_key`), so a decode reads only its window or the start of its chunk on.

Attention sinks (gpt-oss): an optional learned logit per query head, `sinks[h]`, that joins each
row's softmax denominator with no value vector: out = sum_j e^(s_j - m) v_j / (e^(sinks[h] - m) +
sum_j e^(s_j - m)), m = max(sinks[h], max_j s_j). In the online softmax this is the starting
state: running max sinks[h] and running denominator 1 (e^0) instead of "nothing seen yet".

Multi-head latent attention (`mla_ragged_paged_attention`, DeepSeek-V2/V3) is the same
computation over a cache of one latent row per token that every head reads, keys and values
both (`attend_paged` is what the two share).

Unused pages and padding rows may hold anything, NaN included, so masks are applied with
`jnp.where` (NaN * 0 is NaN) and masked scores are a large finite negative, never -inf.
"""
import math

import jax.numpy as jnp
from jax import lax

MASK_VALUE = -1e30
MAX_KV_BLOCK_TOKENS = 1024
KV_BLOCK_BYTES = 4 << 20


def default_q_block(num_tokens: int, num_seqs: int) -> int:
    """The power of two nearest the mean new tokens per sequence, clamped to [1, 512]."""
    mean = max(num_tokens // max(num_seqs, 1), 1)
    return int(min(max(2 ** round(math.log2(mean)), 1), 512))


def default_kv_block_pages(page_size, num_items, q_block, num_q_heads, num_kv_heads, head_dim,
                           itemsize):
    """Pages per KV chunk: the chunk's gathered K, V and f32 scores of all work items should fit
    in a few MiB (CPU cache), up to ~1024 tokens. Decode batches (many items) get short chunks,
    one long prefill gets long ones."""
    kv_bytes = 2 * num_kv_heads * head_dim * itemsize
    score_bytes = 2 * num_q_heads * q_block * 4
    tokens = min(MAX_KV_BLOCK_TOKENS, KV_BLOCK_BYTES // (num_items * (kv_bytes + score_bytes)))
    return max(1, tokens // page_size)


def ragged_paged_attention(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                           sm_scale, sliding_window=None, soft_cap=None, sinks=None,
                           q_block=None, kv_block_pages=None, prefix_only=False,
                           attention_chunk=None):
    """Attends the new tokens `q` of all sequences to their paged KV; returns (out, kv_cache),
    or with `prefix_only` (out, lse, kv_cache) over each sequence's keys from before this step
    (`attend_paged`; speculative tree rows attend to one another apart: tree_tokens.py).

    q [T, Hq, D]; k, v [T, Hkv, D]; kv_cache [num_pages, page_size, 2*Hkv, D] (K of kv head h at
    2h, V at 2h+1), or the same stored flat as [num_pages, page_size, 2*Hkv*D] (the runtime's
    layout; the cache comes back in the shape it came in); kv_lens i32[S]; page_indices
    i32[S, P]; cu_q_lens i32[S+1]; num_seqs i32[1].
    sinks: f32[Hq] attention sinks (see the module docstring), or None for none.
    sliding_window, attention_chunk: the layer's local attention (the module docstring), None
    (or 0) for none; not both.
    An FP8 cache (model/fp8_kv_cache.py) takes k and v in its dtype, already scaled; its rows
    are widened to q's dtype for the dots (`widened`). New K/V are written at positions [kv_len - q_len, kv_len) before attending. Output rows of
    padding tokens are 0. See docs/internals.md, "The kernel contract".
    """
    num_tokens, _, head_dim = q.shape
    num_kv_heads = k.shape[1]
    stored_shape, kv_cache = kv_cache.shape, by_head(kv_cache, head_dim)
    new_rows = jnp.stack([k, v], axis=2).reshape(num_tokens, 2 * num_kv_heads, head_dim)

    def read_chunk(kv_cache, pages):
        # K and V are two gathers, not one split afterwards: each then fuses with the transpose
        # feeding its matmul, where one shared gather would be materialised (slower on CPU).
        kv_by_head = kv_cache.reshape(kv_cache.shape[:2] + (num_kv_heads, 2, head_dim))
        k_chunk = kv_by_head.at[pages, :, :, 0].get(mode="clip")  # [W, C, page_size, Hkv, D]
        v_chunk = kv_by_head.at[pages, :, :, 1].get(mode="clip")
        shape = (pages.shape[0], -1, num_kv_heads, head_dim)
        return k_chunk.reshape(shape), v_chunk.reshape(shape)

    *out, kv_cache = attend_paged(
        q, new_rows, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs,
        num_kv_heads=num_kv_heads, value_dim=head_dim, read_chunk=read_chunk, sm_scale=sm_scale,
        sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks, q_block=q_block,
        kv_block_pages=kv_block_pages, prefix_only=prefix_only, attention_chunk=attention_chunk)
    return (*out, kv_cache.reshape(stored_shape))


def mla_ragged_paged_attention(q, latent, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs,
                               *, sm_scale, value_dim: int, q_block=None, kv_block_pages=None,
                               prefix_only=False):
    """Multi-head latent attention (DeepSeek-V2/V3) in its absorbed form, over a latent cache of
    one row per token; returns (out, kv_cache), or with `prefix_only` (out, lse, kv_cache) over
    each sequence's keys from before this step alone (`attend_paged`).

    latent [T, Dk]: each new token's row, the normed compressed KV (value_dim entries) then its
    RoPE'd key part; kv_cache [num_pages, page_size, Dc], Dc >= Dk (a TPU cache pads its rows to
    whole lane tiles: new rows are written with zeros there, and keys read only the first Dk
    entries); q [T, Hq, Dk]: each head's query with
    its no-RoPE part taken into the latent space (q_nope @ W_UK) then its RoPE'd part. Every head
    attends to the same rows: keys are whole rows, values their first `value_dim` entries, so
    out [T, Hq, value_dim] is in the latent space (times W_UV outside). The other arguments,
    the writes and the masks are ragged_paged_attention's."""
    row_dim = q.shape[-1]

    def read_chunk(kv_cache, pages):
        rows = kv_cache.at[pages].get(mode="clip")  # [W, C, page_size, Dc]
        keys = rows.reshape(pages.shape[0], -1, 1, rows.shape[-1])
        return keys[..., :row_dim], keys[..., :value_dim]

    check_mla_shapes(q, latent, kv_cache, value_dim)
    new_rows = jnp.pad(latent, ((0, 0), (0, kv_cache.shape[-1] - row_dim)))
    return attend_paged(q, new_rows, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs,
                        num_kv_heads=1, value_dim=value_dim, read_chunk=read_chunk,
                        sm_scale=sm_scale, q_block=q_block, kv_block_pages=kv_block_pages,
                        prefix_only=prefix_only)


def merge_by_lse(out_a, lse_a, out_b, lse_b):
    """Attention over two disjoint sets of keys, each normalized over its own (out [T, H, D],
    lse [T, H]), as one softmax over both: weights exp(lse - max) per part, in float32. A part
    with no key (lse -inf) weighs 0; a row with neither comes out 0."""
    top = jnp.maximum(lse_a, lse_b)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w_a, w_b = jnp.exp(lse_a - top), jnp.exp(lse_b - top)
    total = w_a + w_b
    out = w_a[..., None] * out_a.astype(jnp.float32) + w_b[..., None] * out_b.astype(jnp.float32)
    return out / jnp.where(total == 0, 1.0, total)[..., None]


def attend_paged(q, new_rows, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                 num_kv_heads: int, value_dim: int, read_chunk, sm_scale, sliding_window=None,
                 soft_cap=None, sinks=None, q_block=None, kv_block_pages=None,
                 prefix_only=False, attention_chunk=None):
    """The attention both caches share: `new_rows [T, ...]` written at each new token's slot of
    `kv_cache [num_pages, page_size, ...]`, then the work items' online softmax over chunks of
    pages that `read_chunk(kv_cache, pages [W, C]) -> (keys [W, C*page_size, Hkv, Dk], values
    [W, C*page_size, Hkv, value_dim])` reads. Returns (out [T, Hq, value_dim], kv_cache).

    `prefix_only`: each token attends to its sequence's keys from before this step alone (the
    first kv_len - q_len), not to the step's new ones; returns (out, lse, kv_cache), lse [T, Hq]
    float32 the log of each row's softmax denominator (-inf, and out 0, where there is no key),
    which is what merging this part with the new tokens' attention takes (`merge_by_lse`)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, page_size = kv_cache.shape[:2]
    max_seqs, pages_per_seq = page_indices.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads do not split into {num_kv_heads} kv heads")
    group = num_q_heads // num_kv_heads
    if sinks is not None:
        sinks = check_sinks(sinks, num_q_heads)
    sliding_window, attention_chunk = check_local(sliding_window, attention_chunk)

    # Rows >= num_seqs are padding and may hold garbage. Padding tokens and unused work items all
    # map to the sentinel sequence `max_seqs` (no tokens, kv_len 0, page 0), so no padding row of
    # page_indices is ever read; cu_q_lens past num_seqs is flattened so that searchsorted stays
    # monotone, and every gather below is in range without special cases.
    n_live = jnp.clip(num_seqs[0], 0, max_seqs)
    live = jnp.arange(max_seqs) < n_live
    cu_q_lens = jnp.clip(cu_q_lens.astype(jnp.int32), 0, num_tokens)
    total_tokens = cu_q_lens[n_live]
    cu_q_lens = jnp.where(jnp.arange(max_seqs + 1) <= n_live, cu_q_lens, total_tokens)
    q_starts = jnp.append(cu_q_lens[:-1], total_tokens)
    q_lens = jnp.append(cu_q_lens[1:] - cu_q_lens[:-1], 0)
    kv_lens = jnp.append(jnp.where(live, kv_lens, 0), 0)  # garbage would only inflate the loop
    page_indices = jnp.concatenate([page_indices, jnp.zeros((1, pages_per_seq), jnp.int32)])

    # Write the new K/V first, so that attention reads every key from one place: the cache.
    # Padding tokens scatter to page `num_pages` and are dropped (-1 would wrap to the last page).
    token = jnp.arange(num_tokens)
    seq_of_token = searchsorted_right(cu_q_lens[1:], token)  # max_seqs for padding
    token_pos = kv_lens[seq_of_token] - q_lens[seq_of_token] + token - q_starts[seq_of_token]
    token_page = page_indices[seq_of_token, jnp.clip(token_pos // page_size, 0, pages_per_seq - 1)]
    token_page = jnp.where(token < total_tokens, token_page, num_pages)
    kv_cache = kv_cache.at[token_page, token_pos % page_size].set(
        new_rows.astype(kv_cache.dtype), mode="drop")

    # Work items: one per (query block, sequence) pair that shares a token. An item starts at a
    # live token that opens a block or a sequence; counting starts (rather than the sequences
    # between a block's first and last) keeps sequences with no new tokens from taking item slots.
    if q_block is None:
        q_block = default_q_block(num_tokens, max_seqs)
    num_blocks = -(-num_tokens // q_block)
    padded_tokens = num_blocks * q_block
    max_items = min(padded_tokens, num_blocks + max_seqs - 1)
    row = jnp.arange(padded_tokens)
    seq_of_row = searchsorted_right(cu_q_lens[1:], row)
    opens_item = (row % q_block == 0) | (seq_of_row != jnp.roll(seq_of_row, 1))
    opens_item &= row < total_tokens
    (item_start,) = jnp.nonzero(opens_item, size=max_items, fill_value=padded_tokens)
    item_seq = jnp.where(item_start < padded_tokens,
                         seq_of_row[jnp.minimum(item_start, padded_tokens - 1)], max_seqs)
    item_rows = (item_start // q_block)[:, None] * q_block + jnp.arange(q_block)  # [W, q_block]
    item_rows = jnp.minimum(item_rows, padded_tokens - 1)
    row_valid = (seq_of_row[item_rows] == item_seq[:, None]) & (item_seq[:, None] < max_seqs)
    item_kv_len = kv_lens[item_seq]
    row_pos = (item_kv_len - q_lens[item_seq])[:, None] + item_rows - q_starts[item_seq][:, None]

    q_items = q.at[jnp.minimum(item_rows, num_tokens - 1)].get(mode="clip")
    q_items = q_items.reshape(max_items, q_block, num_kv_heads, group, head_dim)
    q_items = q_items.transpose(0, 2, 3, 1, 4)  # [W, Hkv, G, q_block, D]: the matmul's layout
    item_pages = page_indices[item_seq]  # [W, P]

    if kv_block_pages is None:
        kv_block_pages = default_kv_block_pages(page_size, max_items, q_block, num_q_heads,
                                                num_kv_heads, head_dim, kv_cache.dtype.itemsize)
    kv_block_pages = min(kv_block_pages, pages_per_seq)
    num_chunks = -(-pages_per_seq // kv_block_pages)
    if num_chunks * kv_block_pages > pages_per_seq:  # page 0 is in range; its keys get masked
        item_pages = jnp.pad(item_pages, ((0, 0), (0, num_chunks * kv_block_pages - pages_per_seq)))
    chunk_tokens = kv_block_pages * page_size
    # Broadcast shapes against scores [W, Hkv, G, q_block, chunk_tokens].
    row_pos_b = row_pos[:, None, None, :, None]
    row_valid_b = row_valid[:, None, None, :, None]
    # A row's first key: its window's or chunk's start, from its own position (with prefix_only
    # too, where only the last key it sees moves).
    first_key_b = first_key(row_pos_b, sliding_window, attention_chunk)
    kv_len_b = item_kv_len[:, None, None, None]  # against keys [W, chunk_tokens, Hkv, D]
    if prefix_only:  # keys past the prefix are out of reach, as if not yet written
        kv_len_b = kv_len_b - q_lens[item_seq][:, None, None, None]
        row_pos_b = jnp.minimum(row_pos_b, kv_len_b[..., None] - 1)
    # The cache rides through the chunk loop as loop state and comes out of it as the result. Read
    # by the loop from outside instead (closed over), it made XLA copy the whole donated cache
    # several times per layer and step (the updated cache is both a loop operand and the aliased
    # output): 2 s per step of the default model with a 2800-page pool, 40 ms without the copies.
    def attend_chunk(chunk, carry):
        m_prev, l_prev, acc_prev, kv_cache = carry
        pages = lax.dynamic_slice_in_dim(item_pages, chunk * kv_block_pages, kv_block_pages, 1)
        k_chunk, v_chunk = read_chunk(kv_cache, pages)
        k_chunk, v_chunk = widened(k_chunk, q.dtype), widened(v_chunk, q.dtype)
        key_pos = chunk * chunk_tokens + jnp.arange(chunk_tokens)
        # Slots past kv_len hold stale data or NaN: zero V there, since p * NaN is NaN even at p=0.
        v_chunk = jnp.where(key_pos[None, :, None, None] < kv_len_b, v_chunk, 0)
        s = jnp.einsum("whgbd,wlhd->whgbl", q_items, k_chunk,
                       preferred_element_type=jnp.float32) * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        mask = row_valid_b & (key_pos <= row_pos_b) & (key_pos >= first_key_b)
        s = jnp.where(mask, s, MASK_VALUE)
        # A row whose chunk is all masked gets p = 1 junk here; the next real score rescales it by
        # exp(MASK_VALUE - m) = 0, and every valid row has a real score (its own key).
        m = jnp.maximum(m_prev, s.max(axis=-1, keepdims=True))
        p = jnp.exp(s - m)
        alpha = jnp.exp(m_prev - m)
        l = alpha * l_prev + p.sum(axis=-1, keepdims=True)
        pv = jnp.einsum("whgbl,wlhd->whgbd", p.astype(v_chunk.dtype), v_chunk,
                        preferred_element_type=jnp.float32)
        return m, l, alpha * acc_prev + pv, kv_cache

    stat_shape = (max_items, num_kv_heads, group, q_block, 1)
    if sinks is None:
        m_start, l_start = jnp.full(stat_shape, MASK_VALUE, jnp.float32), 0.0
    else:  # query head h = kv head * G + g, as q_items is laid out
        sinks = sinks.reshape(1, num_kv_heads, group, 1, 1)
        m_start, l_start = jnp.broadcast_to(sinks, stat_shape), 1.0
    carry = (m_start, jnp.full(stat_shape, l_start, jnp.float32),
             jnp.zeros(stat_shape[:-1] + (value_dim,), jnp.float32), kv_cache)
    if num_chunks == 1:
        m, l, acc, kv_cache = attend_chunk(0, carry)
    else:
        chunks_needed = jnp.minimum(-(-jnp.max(kv_lens) // chunk_tokens), num_chunks)
        first_chunk = 0
        if sliding_window or attention_chunk:  # chunks every row's window or chunk has passed
            oldest_key = jnp.min(jnp.where(row_valid, row_pos, kv_lens.max()))
            first_chunk = first_key(oldest_key, sliding_window, attention_chunk) // chunk_tokens
        m, l, acc, kv_cache = lax.fori_loop(first_chunk, chunks_needed, attend_chunk, carry)

    # l >= 1 on live rows: the max (a score or the sink) contributes exp(0). With prefix_only a
    # row may have no key at all: its m stayed MASK_VALUE and l, acc hold masked junk.
    empty = m == MASK_VALUE
    out = jnp.where(empty, 0.0, acc / l).astype(q.dtype)
    out = out.transpose(0, 3, 1, 2, 4).reshape(max_items, q_block, num_q_heads, value_dim)
    # Each live row belongs to exactly one item; everything else is dropped, so padding rows stay 0.
    dest = jnp.where(row_valid, item_rows, num_tokens)
    out = jnp.zeros((num_tokens, num_q_heads, value_dim), q.dtype).at[dest].set(out, mode="drop")
    if not prefix_only:
        return out, kv_cache
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(l))[..., 0]  # [W, Hkv, G, q_block]
    lse = lse.transpose(0, 3, 1, 2).reshape(max_items, q_block, num_q_heads)
    lse = jnp.full((num_tokens, num_q_heads), -jnp.inf).at[dest].set(lse, mode="drop")
    return out, lse, kv_cache


def searchsorted_right(sorted_ends, x):
    """jnp.searchsorted(sorted_ends, x, side="right") as a binary search unrolled into
    log2(len(sorted_ends) + 1) compare-and-gather steps, not jnp's default XLA while loop: on a
    GPU each iteration of a while loop reads its predicate back on the host (a sync between
    kernels). Unrolled, XLA fuses it into its consumers: the work items' fusion, computed once
    per step for all layers (CSE: every layer passes the same metadata), and each layer's K/V
    scatter, where 8 steps for 256 sequences cost next to nothing. ("compare_all", len(x) x
    len(sorted_ends) comparisons, is loop-free too, but fused into every layer's K/V scatter
    (the H100 step's HLO) it is len(sorted_ends) compares per lookup there.)"""
    return jnp.searchsorted(sorted_ends, x, side="right", method="scan_unrolled")


def check_local(sliding_window, attention_chunk):
    """(sliding_window, attention_chunk), each a positive int or None (0 and None: none);
    ValueError for both on one layer or a size below 1."""
    sliding_window, attention_chunk = sliding_window or None, attention_chunk or None
    if sliding_window is not None and attention_chunk is not None:
        raise ValueError(f"a sliding window ({sliding_window}) and an attention chunk "
                         f"({attention_chunk}) on one layer are not supported")
    for name, size in (("sliding window", sliding_window), ("attention chunk", attention_chunk)):
        if size is not None and size < 1:
            raise ValueError(f"a {name} of {size} tokens")
    return sliding_window, attention_chunk


def first_key(pos, sliding_window=None, attention_chunk=None):
    """The first key a query at `pos` (ints or an array) sees: max(pos - w + 1, 0) in a sliding
    window w, pos - pos % C in an attention chunk C (the chunk's start), else 0."""
    if sliding_window:
        return jnp.maximum(pos - sliding_window + 1, 0)
    if attention_chunk:
        return pos - pos % attention_chunk
    return jnp.zeros_like(pos)


def check_mla_shapes(q, latent, kv_cache, value_dim: int) -> None:
    """ValueError unless q [T, Hq, Dk], latent [T, Dk], kv_cache [pages, page_size, Dc >= Dk]
    and 0 < value_dim <= Dk (mla_ragged_paged_attention's operands, every kernel's too)."""
    if latent.ndim != 2 or kv_cache.ndim != 3 or q.ndim != 3 or not \
            q.shape[-1] == latent.shape[-1] <= kv_cache.shape[-1] or \
            not 0 < value_dim <= latent.shape[-1]:
        raise ValueError(f"MLA shapes: q {q.shape}, latent {latent.shape}, cache {kv_cache.shape}, "
                         f"value_dim {value_dim}")


def check_sinks(sinks, num_q_heads: int):
    """The sinks as f32[Hq] (float32 holds any float's value); ValueError for any other shape or a
    non-float dtype. (One sink per query head: a tensor-parallel mesh hands each device the sinks
    of its own heads.)"""
    if sinks.shape != (num_q_heads,) or not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise ValueError(f"attention sinks must be floats, one per query head, [{num_q_heads}]; "
                         f"got {sinks.dtype}{list(sinks.shape)}")
    return jnp.asarray(sinks, jnp.float32)


def widened(rows, dtype):
    """`rows` of an FP8 cache (model/fp8_kv_cache.py) in `dtype`, the queries', for the dots;
    any other rows as they are. (The cache's scales are not applied here: the caller folds them
    into sm_scale and the output.)"""
    if rows.dtype.itemsize == 1 and jnp.issubdtype(rows.dtype, jnp.floating):
        return rows.astype(dtype)
    return rows


def by_head(kv_cache, head_dim: int):
    """The cache as [num_pages, page_size, 2*Hkv, D], whether stored so or flat."""
    return kv_cache.reshape(kv_cache.shape[:2] + (-1, head_dim))
