"""Bookkeeping shared by the Pallas kernels, in jnp around the `pallas_call`s.

A ragged batch is cut into *work items*: one item is up to `q_block` consecutive new tokens of one
sequence. The kernels run one grid step per item (times kv heads on the GPU), so decode-only,
prefill-only and mixed batches are the same grid: a decode sequence is one item of one row, a
300-token prefill is ceil(300 / q_block) items. Items start at sequence starts rather than at
q_block-aligned tokens, so an item never straddles two sequences and the kernel never needs to
know about more than one sequence per step.

Each item's queries are gathered into a dense, padded block `[W, Hkv, rows, D]` whose row
`r * G + g` is token `r` of the item and query head `g` of the kv head's group (GQA: the G query
heads that share a kv head are one matmul against that head's keys). The output comes back in
the same layout and is scattered to the token order. That is a copy of q and out (small next to
the KV a step reads) bought for block-aligned, lane-dense kernel operands.

Padding rows of the metadata may hold garbage, so everything here first flattens it: rows past
`num_seqs` get no tokens and kv_len 0, and nothing indexes with them.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from xlaserve.pallas_kernels.ragged_paged_attention import reference
# The reference's: masked scores are finite, exp(MASK_VALUE - m) == 0. Re-exported for the kernels.
from xlaserve.pallas_kernels.ragged_paged_attention.reference import MASK_VALUE


def query_group(q, k) -> int:
    """Query heads per kv head (GQA: query head h reads kv head h // group)."""
    num_q_heads, num_kv_heads = q.shape[1], k.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads do not split into {num_kv_heads} kv heads")
    return num_q_heads // num_kv_heads


def sanitize_metadata(kv_lens, page_indices, cu_q_lens, num_seqs, num_tokens):
    """(kv_lens i32[S], page_indices i32[S, P], cu_q_lens i32[S+1], num_seqs i32[1]) with rows
    past num_seqs emptied: kv_len 0 and cu_q_lens flat at the live total, so that q_len is 0."""
    max_seqs = kv_lens.shape[0]
    n_live = jnp.clip(num_seqs.reshape(-1)[0].astype(jnp.int32), 0, max_seqs)
    cu_q_lens = jnp.clip(cu_q_lens.astype(jnp.int32), 0, num_tokens)
    cu_q_lens = jnp.where(jnp.arange(max_seqs + 1) <= n_live, cu_q_lens, cu_q_lens[n_live])
    kv_lens = jnp.where(jnp.arange(max_seqs) < n_live, kv_lens.astype(jnp.int32), 0)
    return kv_lens, page_indices.astype(jnp.int32), cu_q_lens, n_live.reshape(1)


def new_token_slots(kv_lens, page_indices, cu_q_lens, num_tokens, page_size):
    """Where each new token's K/V goes: (page i32[T], slot i32[T]); page -1 for padding tokens.
    Takes sanitized metadata. Token r of sequence s sits at position kv_len - q_len + r."""
    max_seqs, pages_per_seq = page_indices.shape
    token = jnp.arange(num_tokens)
    seq = jnp.minimum(reference.searchsorted_right(cu_q_lens[1:], token), max_seqs - 1)
    live = token < cu_q_lens[max_seqs]
    pos = kv_lens[seq] - (cu_q_lens[seq + 1] - cu_q_lens[seq]) + token - cu_q_lens[seq]
    page = page_indices[seq, jnp.clip(pos // page_size, 0, pages_per_seq - 1)]
    return jnp.where(live, page, -1).astype(jnp.int32), (pos % page_size).astype(jnp.int32)


def write_new_kv_with_xla(kv_cache, k, v, token_page, token_slot):
    """The cache with the new K/V scattered in (in place when the cache is donated). XLA's
    scatter is already a coalesced in-place kernel on GPU; padding tokens are dropped."""
    new_kv = jnp.stack([k, v], axis=2)  # K of kv head h at 2h, V at 2h + 1
    return write_new_rows_with_xla(kv_cache, new_kv, token_page, token_slot)


def write_new_rows_with_xla(kv_cache, new_rows, token_page, token_slot):
    """`write_new_kv_with_xla` of each new token's whole cache row (MLA's latent rows)."""
    num_pages = kv_cache.shape[0]
    new_rows = new_rows.reshape((new_rows.shape[0],) + kv_cache.shape[2:])
    page = jnp.where(token_page >= 0, token_page, num_pages)  # -1 would wrap to the last page
    return kv_cache.at[page, token_slot].set(new_rows.astype(kv_cache.dtype), mode="drop")



def max_work_items(num_tokens: int, max_seqs: int, q_block: int) -> int:
    """A static bound on the item count: sum_s ceil(q_len_s / q_block) <= (T + S*(q_block-1)) /
    q_block, and never more items than tokens."""
    return max(1, min(num_tokens, (num_tokens + max_seqs * (q_block - 1)) // q_block))


def make_work_items(cu_q_lens, num_tokens: int, q_block: int):
    """(item_seq i32[W], item_row0 i32[W]): each item's sequence and its first row within the
    sequence's new tokens. Unused item slots get sequence S, which no kernel attends."""
    max_seqs = cu_q_lens.shape[0] - 1
    num_items = max_work_items(num_tokens, max_seqs, q_block)
    first_item, items_end = _item_ranges(cu_q_lens, q_block)
    item = jnp.arange(num_items)
    item_seq = reference.searchsorted_right(items_end, item).astype(jnp.int32)
    items_start = jnp.append(first_item, items_end[-1])
    item_row0 = ((item - items_start[item_seq]) * q_block).astype(jnp.int32)
    return item_seq, item_row0


def _item_ranges(cu_q_lens, q_block):
    """(first item, one past the last item) of each sequence, in make_work_items' numbering."""
    per_seq = (cu_q_lens[1:] - cu_q_lens[:-1] + q_block - 1) // q_block
    items_end = jnp.cumsum(per_seq)
    return items_end - per_seq, items_end


def _item_tokens(cu_q_lens, item_seq, item_row0, q_block):
    """Token index of each item row [W, q_block] and whether the row is a real token."""
    max_seqs = cu_q_lens.shape[0] - 1
    seq = jnp.minimum(item_seq, max_seqs - 1)
    row = item_row0[:, None] + jnp.arange(q_block)
    q_len = (cu_q_lens[seq + 1] - cu_q_lens[seq])[:, None]
    valid = (item_seq[:, None] < max_seqs) & (row < q_len)
    return cu_q_lens[seq][:, None] + row, valid


def gather_queries(q, cu_q_lens, item_seq, item_row0, q_block, num_kv_heads, rows):
    """q [T, Hq, D] -> [W, Hkv, rows, D], row r * G + g = (item token r, group head g); rows
    past q_block * G and rows of padding tokens are 0 (padding tokens of q may hold NaN)."""
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    token, valid = _item_tokens(cu_q_lens, item_seq, item_row0, q_block)
    x = jnp.where(valid[..., None, None], q[jnp.clip(token, 0, num_tokens - 1)], 0)
    x = x.reshape(-1, q_block, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    x = x.reshape(-1, num_kv_heads, q_block * group, head_dim)
    return jnp.pad(x, ((0, 0), (0, 0), (0, rows - q_block * group), (0, 0)))


def scatter_outputs(out_items, cu_q_lens, item_seq, item_row0, q_block, num_tokens, num_q_heads):
    """The inverse of gather_queries: [W, Hkv, rows, D] -> [T, Hq, D], padding tokens 0."""
    _, num_kv_heads, _, head_dim = out_items.shape
    group = num_q_heads // num_kv_heads
    token, valid = _item_tokens(cu_q_lens, item_seq, item_row0, q_block)
    x = out_items[:, :, :q_block * group].reshape(-1, num_kv_heads, q_block, group, head_dim)
    x = x.transpose(0, 2, 1, 3, 4).reshape(-1, q_block, num_q_heads, head_dim)
    dest = jnp.where(valid, token, num_tokens)
    out = jnp.zeros((num_tokens, num_q_heads, head_dim), out_items.dtype)
    return out.at[dest].set(x, mode="drop")


def gather_outputs(out_items, cu_q_lens, q_block, num_tokens, num_q_heads):
    """`scatter_outputs` as a gather: each live token reads its row of its item, padding tokens
    get 0, and every output is written once. The scatter wrote zeros first and then the rows:
    3 + 12 us a layer of a 256-row Llama-3.1-8B decode on an H200 (ncu), two kernels where XLA
    fuses this one into a single one. Takes sanitized metadata (rows past num_seqs empty)."""
    num_items, num_kv_heads, _, head_dim = out_items.shape
    group = num_q_heads // num_kv_heads
    max_seqs = cu_q_lens.shape[0] - 1
    token = jnp.arange(num_tokens)
    seq = jnp.minimum(reference.searchsorted_right(cu_q_lens[1:], token), max_seqs - 1)
    first_item, _ = _item_ranges(cu_q_lens, q_block)
    offset = token - cu_q_lens[seq]
    item = jnp.clip(first_item[seq] + offset // q_block, 0, num_items - 1)
    rows = out_items[:, :, :q_block * group].reshape(num_items, num_kv_heads, q_block, group,
                                                     head_dim)
    picked = rows[item, :, offset % q_block]  # [T, Hkv, G, D]: the advanced axes go first
    live = token < cu_q_lens[max_seqs]
    return jnp.where(live[:, None, None], picked.reshape(num_tokens, num_q_heads, head_dim), 0)



def lse_of(m, l):
    """log(sum exp(score)) of rows whose online softmax ended at running max m and denominator l
    (exp(score - m) summed), inside a kernel or after it: -inf where no key was attended (m still
    MASK_VALUE, or l 0)."""
    return jnp.where((m == MASK_VALUE) | (l == 0), -jnp.inf, m + jnp.log(jnp.maximum(l, 1e-30)))

class ItemSpan(NamedTuple):
    """What one grid step attends, as scalars computed inside a kernel."""
    first_pos: jax.Array  # absolute position of the item's first query
    num_rows: jax.Array  # real tokens in the item (<= q_block)
    last_pos: jax.Array  # causal: no key after this one is attended
    pages_needed: jax.Array  # the sequence's pages up to last_pos; later slots may be garbage
    start_block: jax.Array  # first KV block with a key inside some row's window or chunk
    end_block: jax.Array  # one past the KV block holding last_pos


def item_span(kv_len, q_len, row0, *, q_block, page_size, block_tokens, sliding_window,
              attention_chunk=None):
    first_pos = kv_len - q_len + row0
    num_rows = jnp.minimum(q_block, q_len - row0)
    last_pos = first_pos + num_rows - 1
    start_block = 0
    if sliding_window is not None:  # blocks every row's window has passed are not read
        start_block = jnp.maximum(first_pos - sliding_window + 1, 0) // block_tokens
    elif attention_chunk is not None:  # nor those before the first row's chunk
        start_block = (first_pos - lax.rem(first_pos, attention_chunk)) // block_tokens
    return ItemSpan(first_pos, num_rows, last_pos, last_pos // page_size + 1, start_block,
                    last_pos // block_tokens + 1)


def chunk_starts(first_pos, offsets, attention_chunk: int):
    """The attention chunk's start (the first key seen) of the rows at `first_pos + offsets`
    (first_pos a scalar, offsets a small non-negative int32 vector): the first row's chunk start,
    a scalar, plus the whole chunks the others are past it, a float floor as _token_of_row's
    (vector integer division is not a TPU instruction), exact below 2^22 positions apart."""
    start = first_pos - lax.rem(first_pos, attention_chunk)
    past = (first_pos - start + offsets).astype(jnp.float32)
    chunks = jnp.floor((past + 0.5) * (1.0 / attention_chunk)).astype(jnp.int32)
    return start + chunks * attention_chunk


def default_q_block(num_tokens: int, max_seqs: int, group: int, max_rows: int = 256) -> int:
    """Tokens per item: a power of two near the mean new tokens per sequence (1 for decode
    batches, so no query row is wasted), capped so that an item's rows (q_block * G) stay within
    one MXU/tensor-core friendly tile of `max_rows`."""
    return max(1, min(reference.default_q_block(num_tokens, max_seqs), max_rows // group))


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple
