"""Latent attention split in two, as its expanded form serves prefills: each token against its
sequence's cached prefix (`prefix_only`, with the log-sum-exp) and the step's new tokens among
themselves (new_tokens.py), merged by `merge_by_lse`. The merge of the two equals the whole
attention; the TPU and GPU kernels' prefix part and the Pallas new-token attentions (interpret
mode) equal the reference's, on NaN-poisoned cases (cases.make_mla_case)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.kernels.test_mla_kernels import HEADS, SM_SCALE, VALUE_DIM, make_case
from tests.kernels.test_reference_attention import BATCHES, LONG_AND_SHORT
from jax.experimental.pallas import tpu as pltpu

from xlaserve.pallas_kernels.ragged_paged_attention import (kernel_gpu, kernel_tpu, new_tokens,
                                                            reference)

STATIC = ("sm_scale", "value_dim", "prefix_only", "kv_block_pages", "q_block")
whole = jax.jit(reference.mla_ragged_paged_attention, static_argnames=STATIC)
PREFIX_KERNELS = {
    "gpu": jax.jit(functools.partial(kernel_gpu.mla_ragged_paged_attention, interpret=True),
                   static_argnames=STATIC + ("num_kv_splits",)),
    "tpu": jax.jit(functools.partial(kernel_tpu.mla_ragged_paged_attention,
                                     interpret=pltpu.InterpretParams()), static_argnames=STATIC)}
CASES = {"decode": BATCHES["decode"], "prefill": BATCHES["prefill"],
         "mixed": BATCHES["mixed"], "long_and_short": (BATCHES["mixed"][0], LONG_AND_SHORT),
         "no_history": (BATCHES["prefill"][0], [(4, 4), (16, 16), (1, 1)])}


def as_args(case):
    return {k: jnp.asarray(v) for k, v in case.items()}


def new_token_part(args):
    """The new tokens among themselves in the latent space: every head's key is the row, its
    value the row's first VALUE_DIM entries (the absorbed form's keys and values)."""
    rows = jnp.nan_to_num(args["latent"])[:, None]
    heads = args["q"].shape[1]
    return new_tokens.reference_new_token_attention(
        args["q"], jnp.repeat(rows, heads, 1), jnp.repeat(rows[..., :VALUE_DIM], heads, 1),
        args["cu_q_lens"], args["num_seqs"], sm_scale=SM_SCALE)


def live_tokens(case):
    return int(case["cu_q_lens"][int(case["num_seqs"][0])])


@pytest.mark.parametrize("name", list(CASES))
def test_prefix_part_merged_with_the_new_tokens_part_is_the_whole_attention(name):
    shapes, seqs = CASES[name]
    case = make_case(seqs, seed=5, **shapes)
    args = as_args(case)
    want, want_cache = whole(**args, sm_scale=SM_SCALE, value_dim=VALUE_DIM)
    out, lse, cache = whole(**args, sm_scale=SM_SCALE, value_dim=VALUE_DIM, prefix_only=True,
                            kv_block_pages=1)
    np.testing.assert_array_equal(np.asarray(cache), np.asarray(want_cache))  # NaN where NaN
    new_out, new_lse = new_token_part(args)
    merged = reference.merge_by_lse(out, lse, new_out, new_lse)
    live = live_tokens(case)
    np.testing.assert_allclose(np.asarray(merged[:live]), np.asarray(want[:live]), rtol=2e-5,
                               atol=2e-5)
    # A token with no history before this step sees no prefix: lse -inf, output 0.
    q_lens = np.diff(case["cu_q_lens"])[:int(case["num_seqs"][0])]
    fresh = np.repeat(case["kv_lens"][:len(q_lens)] == q_lens, q_lens)
    assert np.all(np.isneginf(np.asarray(lse[:live])[fresh]))
    assert np.all(np.asarray(out[:live])[fresh] == 0)
    assert np.all(np.isfinite(np.asarray(lse[:live])[~fresh]))


@pytest.mark.parametrize("name", ["decode", "mixed", "long_and_short", "no_history"])
@pytest.mark.parametrize("kernel,options", [("gpu", {"num_kv_splits": 1}),
                                            ("gpu", {"num_kv_splits": 3}), ("tpu", {})],
                         ids=["gpu", "gpu-3-splits", "tpu"])
def test_kernel_prefix_part_equals_the_reference(name, kernel, options):
    shapes, seqs = CASES[name]
    case = make_case(seqs, seed=6, **shapes)
    if kernel == "tpu":  # its cache rows are whole 128-lane tiles (transformer.kv_cache_shape)
        case["kv_cache"] = np.pad(case["kv_cache"], ((0, 0), (0, 0), (0, 128 - 48)))
    args = as_args(case)
    want, want_lse, want_cache = whole(**args, sm_scale=SM_SCALE, value_dim=VALUE_DIM,
                                       prefix_only=True)
    try:
        out, lse, cache = PREFIX_KERNELS[kernel](**args, sm_scale=SM_SCALE, value_dim=VALUE_DIM,
                                                 prefix_only=True, kv_block_pages=1, **options)
        # Done before the reset: interpret mode's callbacks run asynchronously.
        jax.block_until_ready((out, lse, cache))
    finally:
        pltpu.reset_tpu_interpret_mode_state()
    live = live_tokens(case)
    np.testing.assert_array_equal(np.asarray(cache), np.asarray(want_cache))
    np.testing.assert_allclose(np.asarray(out[:live]), np.asarray(want[:live]), rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse[:live]), np.asarray(want_lse[:live]), rtol=1e-5,
                               atol=1e-5)  # -inf where -inf


@pytest.mark.parametrize("seqs,tokens", [([(40, 40), (8, 8), (16, 30)], 128),
                                         ([(1, 5)] * 6 + [(20, 20)], 128),
                                         ([(30, 30), (9, 9)], 48)])  # 48: padded to 64 inside
@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_pallas_new_token_attention_equals_the_reference(seqs, tokens, platform):
    rng = np.random.default_rng(7)
    key_dim, value_dim = 48, 32
    q, k = (jnp.asarray(rng.normal(size=(tokens, HEADS, key_dim)), jnp.float32) for _ in "qk")
    v = jnp.asarray(rng.normal(size=(tokens, HEADS, value_dim)), jnp.float32)
    cu_q_lens = jnp.asarray(np.pad(np.cumsum([0] + [n for n, _ in seqs]), (0, 1), mode="edge"),
                            jnp.int32)  # one slot past the live sequences
    num_seqs = jnp.asarray([len(seqs)], jnp.int32)
    want, want_lse = new_tokens.reference_new_token_attention(q, k, v, cu_q_lens, num_seqs,
                                                              sm_scale=0.2)
    if platform == "gpu":
        out, lse = new_tokens.gpu_new_token_attention(q, k, v, cu_q_lens, num_seqs, sm_scale=0.2,
                                                      interpret=True, block_q=32, block_k=32)
    else:  # blocks of 128: the 48-token case is padded to one
        out, lse = new_tokens.tpu_new_token_attention(q, k, v, cu_q_lens, num_seqs, sm_scale=0.2,
                                                      interpret=True, block=128)
    live = int(cu_q_lens[len(seqs)])
    np.testing.assert_allclose(np.asarray(out[:live]), np.asarray(want[:live]), rtol=1e-4,
                               atol=1e-4)
    np.testing.assert_allclose(np.asarray(lse[:live]), np.asarray(want_lse[:live]), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("seqs,tokens", [([(40, 40), (8, 8), (16, 30)], 128),
                                         ([(1, 5)] * 6 + [(20, 20)], 128),
                                         ([(30, 30), (9, 9)], 48),  # 48: padded to 64 inside
                                         ([(100, 100), (3, 3), (1, 1)], 112)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cpu_blocked_new_token_attention_equals_the_reference(seqs, tokens, dtype):
    """Blocks of 16 rows: sequences that start, end and span several blocks, and decodes."""
    rng = np.random.default_rng(8)
    q, k, v = (jnp.asarray(rng.normal(size=(tokens, HEADS, width)), dtype)
               for width in (48, 48, 32))
    cu_q_lens = jnp.asarray(np.pad(np.cumsum([0] + [n for n, _ in seqs]), (0, 1), mode="edge"),
                            jnp.int32)
    num_seqs = jnp.asarray([len(seqs)], jnp.int32)
    want, want_lse = new_tokens.reference_new_token_attention(q, k, v, cu_q_lens, num_seqs,
                                                              sm_scale=0.2)
    blocked = jax.jit(functools.partial(new_tokens.blocked_new_token_attention, block=16),
                      static_argnames="sm_scale")
    out, lse = blocked(q, k, v, cu_q_lens, num_seqs, sm_scale=0.2)
    live = int(cu_q_lens[len(seqs)])
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(out[:live]), np.asarray(want[:live]), rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(lse[:live]), np.asarray(want_lse[:live]), rtol=1e-5,
                               atol=1e-5 if dtype == jnp.float32 else 1e-2)
    assert np.all(np.isfinite(np.asarray(out))) and np.all(np.isfinite(np.asarray(lse)))
