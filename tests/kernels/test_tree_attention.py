"""Speculative tree rows' attention (tree_tokens.py): each token attends to its sequence's prefix
and to the new tokens its mask names (its ancestors and itself), never to a cousin. Every
platform's kernel with `prefix_only` (the CPU's, the TPU and GPU kernels in interpret mode)
merged with the masked new-token part equals a dense float64 attention over exactly those keys,
on NaN-poisoned cases (cases.make_case); the new K/V land where the plain kernel writes them."""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from xlaserve.pallas_kernels.ragged_paged_attention import (cases, kernel_cpu, kernel_gpu,
                                                            kernel_tpu, reference)
from xlaserve.pallas_kernels.ragged_paged_attention.tree_tokens import (tree_attention,
                                                                        tree_token_attention)

HEAD_DIM, NUM_Q_HEADS, NUM_KV_HEADS = 32, 8, 2
SM_SCALE = 1.0 / math.sqrt(HEAD_DIM)
WIDTH = 8
SHAPES = dict(max_seqs=6, num_tokens=24, page_size=16, pages_per_seq=8, num_pages=40,
              num_kv_heads=NUM_KV_HEADS, num_q_heads=NUM_Q_HEADS, head_dim=HEAD_DIM)
# Each live sequence: (its tree's parents, root first (-1); prefix length before the step).
TREES = [
    ([-1, 0, 0, 1, 2, 1, 3], 37),  # two branches under the root, the first split again
    ([-1], 20),  # a plain decoding row
    ([-1, 0, 1, 2], 15),  # a chain
    ([-1, 0, 0, 0], 0),  # no prefix: the tree's own tokens alone
    ([-1, 0, 1, 0, 3], 50),  # past a page boundary
]


def tree_masks_of(parents):
    masks = []
    for i, parent in enumerate(parents):
        masks.append((masks[parent] if parent >= 0 else 0) | (1 << i))
    return masks


def make_tree_case(seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    seqs = [(len(parents), prefix + len(parents)) for parents, prefix in TREES]
    case = cases.make_case(rng, seqs, dtype=dtype, **SHAPES)
    masks = np.zeros(SHAPES["num_tokens"], np.int32)  # padding tokens see nothing
    masks[:sum(len(p) for p, _ in TREES)] = np.concatenate(
        [tree_masks_of(parents) for parents, _ in TREES])
    case["tree_masks"] = masks
    return case


def expected(case):
    """Dense float64 attention of each token over its prefix and the new tokens its mask names;
    the cache after the writes."""

    def seen(row, prefix, positions):
        mask = case["tree_masks"][row]
        return (positions < prefix) | ((mask >> np.maximum(positions - prefix, 0)) & 1).astype(bool)

    return dense_attention(case, seen, SHAPES["page_size"], SM_SCALE)


def dense_attention(case, seen, page_size: int, sm_scale: float):
    """Dense float64 attention of each live token row over the keys `seen(row, prefix,
    key positions)` names, its sequence's new K/V written first; (out, the cache after the
    writes)."""
    q = case["q"].astype(np.float64)
    num_kv_heads = case["k"].shape[1]
    group = q.shape[1] // num_kv_heads
    cache = case["kv_cache"].astype(np.float32)
    new_kv = np.stack([case["k"], case["v"]], axis=2).reshape(len(q), 2 * num_kv_heads, -1)
    new_kv = new_kv.astype(case["kv_cache"].dtype).astype(np.float32)
    out = np.zeros_like(q)
    cu, pages = case["cu_q_lens"], case["page_indices"]
    for s in range(int(case["num_seqs"][0])):
        q_len, kv_len = int(cu[s + 1] - cu[s]), int(case["kv_lens"][s])
        prefix = kv_len - q_len
        for r in range(q_len):
            pos = prefix + r
            cache[pages[s, pos // page_size], pos % page_size] = new_kv[cu[s] + r]
        positions = np.arange(kv_len)
        kv = cache[pages[s, positions // page_size], positions % page_size].astype(np.float64)
        keys, values = np.repeat(kv[:, 0::2], group, 1), np.repeat(kv[:, 1::2], group, 1)
        for r in range(q_len):
            scores = np.einsum("hd,khd->hk", q[cu[s] + r], keys) * sm_scale
            scores = np.where(seen(cu[s] + r, prefix, positions)[None], scores, -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            out[cu[s] + r] = np.einsum("hk,khd->hd", probs, values)
    return out, cache


PREFIX_KERNELS = {
    "reference": reference.ragged_paged_attention,
    "cpu": kernel_cpu.ragged_paged_attention,
    "gpu-interpret": functools.partial(kernel_gpu.ragged_paged_attention, interpret=True),
    "tpu-interpret": functools.partial(kernel_tpu.ragged_paged_attention,
                                       interpret=pltpu.InterpretParams()),
}


def run_tree(kernel_name, case):
    args = {k: jnp.asarray(v) for k, v in case.items() if k != "tree_masks"}
    fn = jax.jit(functools.partial(tree_attention, PREFIX_KERNELS[kernel_name],
                                   sm_scale=SM_SCALE, width=WIDTH))
    return fn(args["q"], args["k"], args["v"], args["kv_cache"], args["kv_lens"],
              args["page_indices"], args["cu_q_lens"], args["num_seqs"],
              jnp.asarray(case["tree_masks"]))


@pytest.mark.parametrize("kernel_name", list(PREFIX_KERNELS))
def test_a_tree_token_sees_its_prefix_its_ancestors_and_itself_alone(kernel_name):
    if kernel_name == "cpu":
        try:
            kernel_cpu.load()
        except kernel_cpu.KernelUnavailable:
            pytest.skip("no C++ compiler")
    case = make_tree_case()
    want, want_cache = expected(case)
    out, cache = run_tree(kernel_name, case)
    live = int(case["cu_q_lens"][int(case["num_seqs"][0])])
    np.testing.assert_allclose(np.asarray(out[:live]), want[:live], rtol=2e-5, atol=2e-5)
    cache = np.asarray(cache).reshape(want_cache.shape)
    written = ~np.isnan(want_cache)
    np.testing.assert_array_equal(cache[written], want_cache[written])


def test_the_cpu_kernels_prefix_part_equals_the_references_in_bfloat16():
    try:
        kernel_cpu.load()
    except kernel_cpu.KernelUnavailable:
        pytest.skip("no C++ compiler")
    case = make_tree_case(seed=3, dtype=jnp.bfloat16)
    args = [jnp.asarray(case[k]) for k in ("q", "k", "v", "kv_cache", "kv_lens", "page_indices",
                                           "cu_q_lens", "num_seqs")]
    live = int(case["cu_q_lens"][int(case["num_seqs"][0])])
    want_out, want_lse, _ = reference.ragged_paged_attention(*args, sm_scale=SM_SCALE,
                                                             prefix_only=True)
    for pairs in {False, kernel_cpu.bf16_pairs_supported()}:
        out, lse, _ = kernel_cpu.ragged_paged_attention(*args, sm_scale=SM_SCALE,
                                                        prefix_only=True, bf16_pairs=pairs)
        np.testing.assert_allclose(np.asarray(lse[:live]), np.asarray(want_lse[:live]),
                                   rtol=2e-2, atol=2e-2)
        np.testing.assert_allclose(np.asarray(out[:live], np.float32),
                                   np.asarray(want_out[:live], np.float32), rtol=3e-2, atol=3e-2)


def test_a_chain_and_a_plain_row_under_tree_masks_equal_causal_attention():
    """Masks 2^(j+1) - 1 are the causal rule: the tree step serves chains and plain rows too."""
    rng = np.random.default_rng(1)
    seqs = [(4, 30), (1, 9), (3, 3)]
    case = cases.make_case(rng, seqs, **SHAPES)
    case["tree_masks"] = np.zeros(SHAPES["num_tokens"], np.int32)
    case["tree_masks"][:8] = [1, 3, 7, 15, 1, 1, 3, 7]
    args = {k: jnp.asarray(v) for k, v in case.items() if k != "tree_masks"}
    want, _ = reference.ragged_paged_attention(**args, sm_scale=SM_SCALE)
    out, _ = run_tree("reference", case)
    np.testing.assert_allclose(np.asarray(out[:8]), np.asarray(want[:8]), rtol=2e-5, atol=2e-5)


def test_padding_tokens_see_nothing_and_a_width_over_32_is_refused():
    case = make_tree_case()
    args = {k: jnp.asarray(case[k]) for k in ("q", "k", "v", "cu_q_lens", "num_seqs")}
    out, lse = tree_token_attention(args["q"], args["k"], args["v"],
                                    jnp.asarray(case["tree_masks"]), args["cu_q_lens"],
                                    args["num_seqs"], sm_scale=SM_SCALE, width=WIDTH)
    live = int(case["cu_q_lens"][int(case["num_seqs"][0])])
    assert np.all(np.isneginf(np.asarray(lse[live:]))) and np.all(np.asarray(out[live:]) == 0)
    assert np.all(np.isfinite(np.asarray(lse[:live])))
    with pytest.raises(ValueError, match="1..32"):
        tree_token_attention(args["q"], args["k"], args["v"], jnp.asarray(case["tree_masks"]),
                             args["cu_q_lens"], args["num_seqs"], sm_scale=SM_SCALE, width=33)
