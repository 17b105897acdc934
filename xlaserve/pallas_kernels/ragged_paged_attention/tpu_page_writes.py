"""How the Pallas TPU kernel (kernel_tpu.py) writes the new tokens' rows into their pages: not a
token-sized DMA, which Mosaic refuses at unaligned offsets (a bfloat16 token is half a packed
32-bit sublane), but whole sublane tiles. The page is already in VMEM for attention; the item's
new rows (`gather_new_rows`) are merged into it there (`merge_new_rows`), and the tiles holding
new rows (`written_tiles`) are DMA'd back to HBM."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from xlaserve.pallas_kernels.ragged_paged_attention.work_items import gather_queries, round_up


def sublanes(dtype) -> int:
    """Rows of one VMEM tile: 8 for 32-bit types, 16 for bfloat16 (two rows packed)."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def gather_new_rows(new_rows, dtype, cu_q_lens, item_seq, item_row0, q_block):
    """Each work item's new cache rows, [W, rows, lanes] from new_rows [T, lanes] in the cache's
    token layout (MHA: K of kv head h at lanes [2hD, 2hD+D), V after it; MLA: the latent row):
    row r is the item's token r, rows past its tokens are 0. One row for decode items (a 1-row
    block is the whole dim, so the DMA moves one row), else q_block rounded up to whole sublane
    tiles, which the in-kernel merge slices at tile boundaries."""
    rows = 1 if q_block == 1 else round_up(q_block, sublanes(dtype))
    return gather_queries(new_rows[:, None].astype(dtype), cu_q_lens, item_seq, item_row0,
                          q_block, 1, rows)[:, 0]


def written_tiles(page_pos, first_pos, last_pos, *, page_size: int, tile: int):
    """(first, end): the sublane tiles of `tile` rows of the page holding positions page_pos..
    that receive some of the new tokens first_pos..last_pos (the page must receive one). Only
    they are written back: a decode item's one token is one tile (16 rows of bfloat16), not the
    whole page (up to 256 rows); the rows of a tile around new tokens are written back as read."""
    first = jnp.maximum(first_pos - page_pos, 0) // tile
    end = jnp.minimum(last_pos - page_pos, page_size - 1) // tile + 1
    return first, end


def merge_new_rows(rows, new_kv_ref, *, page_pos, first_pos, last_pos):
    """Overwrites, in the VMEM copy `rows` [page_size, 2*Hkv*D] of the page holding positions
    page_pos.., the item's new tokens (positions first_pos..last_pos) with their rows of
    new_kv_ref [1, n, 2*Hkv*D] (row j: position first_pos + j).

    A bfloat16 row cannot be stored at an odd sublane (two rows share a 32-bit sublane), so the
    rows are lined up with the page by a dynamic sublane roll of a tile-aligned window of the new
    rows, in float32 (exact both ways), and selected by position."""
    page_size, lanes = rows.shape
    new_rows = new_kv_ref.shape[1]
    pos = page_pos + lax.broadcasted_iota(jnp.int32, (page_size, 1), 0)
    is_new = (pos >= first_pos) & (pos <= last_pos)
    if new_rows == 1:  # a decode item: one token
        new = jnp.broadcast_to(new_kv_ref[0, 0:1].astype(jnp.float32), (page_size, lanes))
    else:
        align = sublanes(rows.dtype)
        window = page_size + align  # any page_size rows starting in an aligned tile
        first_row = page_pos - first_pos  # the new row that lands on the page's row 0 (or < 0)
        if new_rows >= window:
            start = jnp.clip(first_row, 0, new_rows - window) // align * align
            x = new_kv_ref[0, pl.ds(pl.multiple_of(start, align), window)].astype(jnp.float32)
        else:
            start = 0
            x = jnp.concatenate([new_kv_ref[0].astype(jnp.float32),
                                 jnp.zeros((window - new_rows, lanes), jnp.float32)])
        lag = first_row - start  # in (-page_size, window): page row r takes x[r + lag]
        x = pltpu.roll(x, jnp.where(lag > 0, window - lag, -lag), 0)  # x'[r] = x[r - shift]
        new = x[:page_size]
    rows[...] = jnp.where(is_new, new.astype(rows.dtype), rows[...])
