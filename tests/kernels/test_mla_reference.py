"""Multi-head latent attention in the reference (ragged_paged_attention/reference.py,
`mla_ragged_paged_attention`): the absorbed form over a latent paged cache equals DeepSeek's
expanded attention (per-head keys [W_UK c, k_rope] and values W_UV c) computed directly in
float64, on a ragged batch of a chunked prefill, a new prompt and a decode, with every unused
page, and the padding tokens' rows, NaN."""
import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.pallas_kernels.ragged_paged_attention.reference import mla_ragged_paged_attention

HEADS, NOPE, ROPE, RANK, V_DIM, PAGE = 4, 16, 8, 32, 12, 4
# (tokens already cached, new tokens) per sequence
SEQS = [(5, 3), (0, 6), (9, 1)]


@pytest.mark.parametrize("q_block, kv_block_pages", [(None, None), (1, 1), (4, 2)])
def test_absorbed_latent_attention_equals_the_expanded_heads(q_block, kv_block_pages):
    rng = np.random.default_rng(0)
    w_uk = rng.normal(0, 0.3, (HEADS, NOPE, RANK))
    w_uv = rng.normal(0, 0.3, (HEADS, V_DIM, RANK))
    lengths = [cached + new for cached, new in SEQS]
    c = [rng.normal(0, 1, (n, RANK)) for n in lengths]  # the normed compressed KV per token
    k_rope = [rng.normal(0, 1, (n, ROPE)) for n in lengths]
    q_nope = [rng.normal(0, 1, (new, HEADS, NOPE)) for _, new in SEQS]
    q_rope = [rng.normal(0, 1, (new, HEADS, ROPE)) for _, new in SEQS]
    scale = (NOPE + ROPE) ** -0.5

    # The cache: every page NaN but the cached tokens' rows; sequence i's pages are shuffled.
    num_pages, pages_per_seq, tokens, seqs = 24, 4, 16, 4
    cache = np.full((num_pages, PAGE, RANK + ROPE), np.nan, np.float32)
    page_ids = rng.permutation(np.arange(1, num_pages))[:len(SEQS) * pages_per_seq]
    page_indices = np.zeros((seqs, pages_per_seq), np.int32)
    page_indices[:len(SEQS)] = page_ids.reshape(len(SEQS), pages_per_seq)
    for i, (cached, _) in enumerate(SEQS):
        for pos in range(cached):
            cache[page_indices[i, pos // PAGE], pos % PAGE] = np.concatenate([c[i][pos], k_rope[i][pos]])
    q = np.full((tokens, HEADS, RANK + ROPE), np.nan, np.float32)
    latent = np.full((tokens, RANK + ROPE), np.nan, np.float32)
    cu_q_lens = np.zeros(seqs + 1, np.int32)
    row = 0
    for i, (cached, new) in enumerate(SEQS):
        q[row:row + new] = np.concatenate([np.einsum("thn,hnr->thr", q_nope[i], w_uk), q_rope[i]], -1)
        latent[row:row + new] = np.concatenate([c[i][cached:], k_rope[i][cached:]], -1)
        row += new
        cu_q_lens[i + 1] = row
    cu_q_lens[len(SEQS) + 1:] = row
    kv_lens = np.array(lengths + [0], np.int32)

    out, new_cache = mla_ragged_paged_attention(
        jnp.asarray(q), jnp.asarray(latent), jnp.asarray(cache), jnp.asarray(kv_lens),
        jnp.asarray(page_indices), jnp.asarray(cu_q_lens), jnp.array([len(SEQS)], jnp.int32),
        sm_scale=scale, value_dim=RANK, q_block=q_block, kv_block_pages=kv_block_pages)
    out = np.einsum("thr,hvr->thv", np.asarray(out, np.float64), w_uv)

    row = 0
    for i, (cached, new) in enumerate(SEQS):
        keys = np.concatenate([np.broadcast_to(np.einsum("hnr,lr->lhn", w_uk, c[i]),
                                               (lengths[i], HEADS, NOPE)),
                               np.broadcast_to(k_rope[i][:, None], (lengths[i], HEADS, ROPE))], -1)
        values = np.einsum("hvr,lr->lhv", w_uv, c[i])
        query = np.concatenate([q_nope[i], q_rope[i]], -1)
        for t in range(new):
            pos = cached + t
            s = np.einsum("hd,lhd->hl", query[t], keys[:pos + 1]) * scale
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            np.testing.assert_allclose(out[row + t], np.einsum("hl,lhv->hv", p, values[:pos + 1]),
                                       rtol=2e-5, atol=2e-5)
            page, slot = page_indices[i, pos // PAGE], pos % PAGE
            np.testing.assert_array_equal(np.asarray(new_cache)[page, slot], latent[row + t])
        row += new
    assert (out[row:] == 0).all()  # padding tokens' rows
    untouched = np.isnan(cache).all(-1) & np.isnan(np.asarray(new_cache)).all(-1)
    written = sum(new for _, new in SEQS)
    assert untouched.sum() == np.isnan(cache).all(-1).sum() - written  # nothing else written


def test_mla_shapes_that_do_not_fit_are_refused():
    q, latent = jnp.zeros((8, 2, 40)), jnp.zeros((8, 40))
    args = (jnp.zeros(1, jnp.int32), jnp.zeros((1, 1), jnp.int32), jnp.zeros(2, jnp.int32),
            jnp.zeros(1, jnp.int32))
    with pytest.raises(ValueError, match="MLA shapes"):
        mla_ragged_paged_attention(q, latent, jnp.zeros((2, 4, 39)), *args, sm_scale=1.0,
                                   value_dim=32)
    with pytest.raises(ValueError, match="MLA shapes"):
        mla_ragged_paged_attention(q, latent, jnp.zeros((2, 4, 40)), *args, sm_scale=1.0,
                                   value_dim=41)
