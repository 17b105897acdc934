"""Attention of a step's new tokens to one another alone, causal within each sequence, returning
each row's log-sum-exp: the second half of multi-head latent attention's expanded form (model/
mla.py). The first half, each token against its sequence's cached prefix, is the absorbed kernel
with `prefix_only`; `reference.merge_by_lse` joins the two into the softmax over every key.
With `causal=False` each token sees its whole sequence: an encoder's attention
(model/encoders/encoder.py), whose sequences run whole in one step and keep no cache; `window` w > 0
(not causal only) limits it to the keys at most w positions away on either side (ModernBERT's local
layers, model/encoders/modernbert.py).

q [T, H, Dk], k [T, H, Dk], v [T, H, Dv]: the new tokens in the batch's order (cu_q_lens), keys
and values already expanded per head; padding tokens (past cu_q_lens[num_seqs]) attend to one
another only and their rows are garbage-free but meaningless. Returns (out [T, H, Dv] float32,
lse [T, H] float32).

- `reference_new_token_attention`: jnp, the whole [H, T, T] score matrix (the specification).
- `blocked_new_token_attention`: the CPU's, the same a block of query rows at a time against
  the key blocks of its sequences alone.
- `gpu_new_token_attention`: JAX's Pallas GPU flash attention (`jax.experimental.pallas.ops.gpu.
  attention.mha`) over the batch as one packed sequence, the sequences kept apart by segment ids.
  It wants one head width for q, k and v (padded to a power of two inside), so v is padded to
  Dk with zeros. Its causal mask is over the packed positions, which within a segment is each
  sequence's own, so it visits the whole T x T triangle: cross-sequence blocks are computed and
  masked (for 8 prompts of 512 in a 4096 bucket, 8x the pairs that count).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from xlaserve.pallas_kernels.ragged_paged_attention.reference import MASK_VALUE, searchsorted_right


def segment_ids(cu_q_lens, num_seqs, num_tokens: int):
    """int32 [T]: each token's sequence, padding tokens (and sequences past num_seqs) all
    max_seqs, one segment of their own."""
    max_seqs = cu_q_lens.shape[0] - 1
    end = cu_q_lens[jnp.clip(num_seqs[0], 0, max_seqs)]
    token = jnp.arange(num_tokens)
    seq = searchsorted_right(cu_q_lens[1:], token)
    return jnp.where(token < end, seq, max_seqs).astype(jnp.int32)


def reference_new_token_attention(q, k, v, cu_q_lens, num_seqs, *, sm_scale, causal=True,
                                  window=0):
    num_tokens = q.shape[0]
    segment = segment_ids(cu_q_lens, num_seqs, num_tokens)
    position = jnp.arange(num_tokens)
    mask = segment[:, None] == segment[None, :]
    if causal:
        mask &= position[None, :] <= position[:, None]
    if window:  # within a segment, packed positions differ as the sequence's own
        mask &= jnp.abs(position[None, :] - position[:, None]) <= window
    scores = jnp.einsum("qhd,khd->hqk", q, k, preferred_element_type=jnp.float32) * sm_scale
    scores = jnp.where(mask[None], scores, -jnp.inf)  # every row has its own key
    lse = jax.nn.logsumexp(scores, axis=-1)
    probs = jnp.exp(scores - lse[..., None])
    out = jnp.einsum("hqk,khd->qhd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out, lse.T


def blocked_new_token_attention(q, k, v, cu_q_lens, num_seqs, *, sm_scale, causal=True,
                                window=0, block=128):
    """The CPU's: the reference's arithmetic a block of `block` query rows at a time, with an
    online softmax over the key blocks from its first row's sequence start to itself (not
    causal: to its last row's sequence end) alone (a dynamic loop bound), so a bucket's cost
    follows its sequences' lengths (in whole blocks), not the bucket's square. The expanded form as served with it against the reference's whole [H, T, T]
    scores (bench_mla_forms.py, DeepSeek-V3's 16 heads, float32, 2 Zen 3 cores): 4 prompts of
    256 tokens 173 against 312 ms, one of 1024 238 against 286."""
    num_tokens, heads, _ = q.shape
    block = min(block, num_tokens)
    padded = -(-num_tokens // block) * block
    pad = lambda x: jnp.pad(x, ((0, padded - num_tokens), (0, 0), (0, 0)))
    q, k, v = pad(q), pad(k), pad(v)
    segment = segment_ids(cu_q_lens, num_seqs, padded)  # block padding: the padding segment
    bounds = jnp.clip(cu_q_lens.astype(jnp.int32), 0, num_tokens)
    starts = jnp.append(bounds[:-1], num_tokens)
    first_key_block = jnp.minimum(starts[segment[::block]] // block, jnp.arange(padded // block))
    blocks = jnp.arange(padded // block)
    if causal:
        end_key_block = blocks + 1
    else:  # through the block holding the end of the block's last row's sequence; a block
        # that ends in padding holds its sequences' ends, and padding rows need only
        # themselves (they would otherwise attend to every padding row after them)
        last = segment[block - 1::block]
        end_key_block = jnp.where(last == cu_q_lens.shape[0] - 1, blocks + 1,
                                  -(-jnp.append(bounds[1:], padded)[last] // block))
    if window:  # the key blocks within `window` of the block's rows
        first_key_block = jnp.maximum(first_key_block, (blocks * block - window) // block)
        end_key_block = jnp.minimum(end_key_block,
                                    ((blocks + 1) * block - 1 + window) // block + 1)

    def query_block(i):
        rows = i * block
        q_i = jax.lax.dynamic_slice_in_dim(q, rows, block)
        seg_i = jax.lax.dynamic_slice_in_dim(segment, rows, block)
        pos_i = rows + jnp.arange(block)

        def key_block(j, carry):
            m, l, acc = carry
            keys = j * block
            k_j, v_j = (jax.lax.dynamic_slice_in_dim(x, keys, block) for x in (k, v))
            seg_j = jax.lax.dynamic_slice_in_dim(segment, keys, block)
            mask = seg_i[:, None] == seg_j[None, :]
            if causal:
                mask &= keys + jnp.arange(block) <= pos_i[:, None]
            if window:
                mask &= jnp.abs(keys + jnp.arange(block) - pos_i[:, None]) <= window
            scores = jnp.einsum("qhd,khd->hqk", q_i, k_j, preferred_element_type=jnp.float32)
            # A row whose keys are all masked here gets junk weighed exp(MASK_VALUE - m) = 0 by
            # its own key's block, as in reference.attend_paged.
            scores = jnp.where(mask[None], scores * sm_scale, MASK_VALUE)
            m_new = jnp.maximum(m, scores.max(-1))
            probs = jnp.exp(scores - m_new[..., None])
            alpha = jnp.exp(m - m_new)
            acc = acc * alpha[..., None] + jnp.einsum(
                "hqk,khd->hqd", probs.astype(v.dtype), v_j, preferred_element_type=jnp.float32)
            return m_new, l * alpha + probs.sum(-1), acc

        start = (jnp.full((heads, block), MASK_VALUE), jnp.zeros((heads, block)),
                 jnp.zeros((heads, block, v.shape[-1])))
        m, l, acc = jax.lax.fori_loop(first_key_block[i], end_key_block[i], key_block, start)
        return acc / l[..., None], m + jnp.log(l)  # every row is its own key: l > 0

    out, lse = jax.lax.map(query_block, jnp.arange(padded // block))  # [blocks, H, block, ...]
    out = out.transpose(0, 2, 1, 3).reshape(padded, heads, -1)[:num_tokens]
    return out, lse.transpose(0, 2, 1).reshape(padded, heads)[:num_tokens]


def gpu_new_token_attention(q, k, v, cu_q_lens, num_seqs, *, sm_scale, causal=True, window=0,
                            interpret=False, block_q=64, block_k=64):
    from jax.experimental.pallas.ops.gpu import attention

    if window:  # JAX's GPU flash attention has no local mask: the blocked form's dots
        return blocked_new_token_attention(q, k, v, cu_q_lens, num_seqs, sm_scale=sm_scale,
                                           causal=causal, window=window)
    num_tokens, _, key_dim = q.shape
    value_dim = v.shape[-1]
    if value_dim > key_dim:
        raise ValueError(f"values wider than keys ({value_dim} > {key_dim})")
    # Whole blocks: a bucket that is not a multiple of one is padded with padding tokens.
    block_q, block_k = min(block_q, num_tokens), min(block_k, num_tokens)
    padded = -(-num_tokens // math.lcm(block_q, block_k)) * math.lcm(block_q, block_k)
    pad = lambda x, width: jnp.pad(x, ((0, padded - num_tokens), (0, 0),
                                       (0, width - x.shape[-1])))
    q, k, v = pad(q, key_dim), pad(k, key_dim), pad(v, key_dim)
    segment = segment_ids(cu_q_lens, num_seqs, padded)[None]
    sizes = attention.BlockSizes(block_q=block_q, block_k=block_k)
    out, lse = attention.mha(q[None], k[None], v[None], segment, sm_scale=sm_scale, causal=causal,
                             block_sizes=sizes, interpret=interpret, return_residuals=True)
    # The kernel's softmax runs in base 2: its lse is log2 of the denominator.
    out, lse = out[0, :num_tokens, :, :value_dim], lse[0, :, :num_tokens].T
    return out.astype(jnp.float32), lse * math.log(2.0)


def tpu_new_token_attention(q, k, v, cu_q_lens, num_seqs, *, sm_scale, causal=True, window=0,
                            interpret=False, block=512):
    """JAX's splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`) over the batch
    as one packed sequence: a causal mask, the sequences kept apart by segment ids, its
    log-sum-exp saved. Splash skips the blocks its static causal mask rules out, not the ones
    segments do. Heads first ([H, T, D]); the queries are scaled here (splash does not)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    num_tokens, num_heads, _ = q.shape
    block = min(block, max(128, 1 << (num_tokens - 1).bit_length()))
    padded = -(-num_tokens // block) * block
    pad = lambda x: jnp.pad(x, ((0, padded - num_tokens), (0, 0), (0, 0))).transpose(1, 0, 2)
    segment = segment_ids(cu_q_lens, num_seqs, padded)
    shape = (padded, padded)
    if window:
        one = masks.LocalMask(shape, (window, 0 if causal else window), offset=0)
    else:
        one = masks.CausalMask(shape) if causal else masks.FullMask(shape)
    mask = masks.MultiHeadMask([one] * num_heads)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block)
    kernel = splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                    save_residuals=True, interpret=interpret)
    out, (lse,) = kernel((pad(q) * sm_scale).astype(q.dtype), pad(k), pad(v),
                         segment_ids=splash.SegmentIds(q=segment, kv=segment))
    return out[:, :num_tokens].transpose(1, 0, 2).astype(jnp.float32), lse[:, :num_tokens].T
