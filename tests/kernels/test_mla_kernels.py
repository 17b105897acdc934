"""The Pallas latent-attention kernels (kernel_tpu / kernel_gpu `mla_ragged_paged_attention`)
against their specification, the reference's `mla_ragged_paged_attention`, in interpret mode on
CPU, on NaN-poisoned cases (cases.make_mla_case: unused pages, page-table slots past a sequence's
pages, cache slots past kv_len and padding tokens hold NaN or garbage, so a stray read fails).

Widths: a 32-lane latent (the values) and a 16-lane RoPE'd part, the smallest the GPU kernel's
power-of-two dots take (DeepSeek-V3: 512 + 64, compiled in test_compile_kernels.py)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from tests.kernels.test_reference_attention import BATCHES, LONG_AND_SHORT, RAGGED_SHAPES
from xlaserve.pallas_kernels.ragged_paged_attention import cases, kernel_gpu, kernel_tpu
from xlaserve.pallas_kernels.ragged_paged_attention.reference import mla_ragged_paged_attention

VALUE_DIM, ROPE_DIM, HEADS = 32, 16, 4
SM_SCALE = (VALUE_DIM + ROPE_DIM) ** -0.5
STATIC = ("sm_scale", "value_dim", "interpret", "q_block", "kv_block_pages")
KERNELS = {
    "tpu": (jax.jit(kernel_tpu.mla_ragged_paged_attention, static_argnames=STATIC),
            pltpu.InterpretParams()),
    "gpu": (jax.jit(kernel_gpu.mla_ragged_paged_attention,
                    static_argnames=STATIC + ("num_kv_splits", "heads_per_program",
                                              "decode_io_in_kernel")), True),
}
reference = jax.jit(mla_ragged_paged_attention, static_argnames=("sm_scale", "value_dim"))


def make_case(seqs, seed=0, heads=HEADS, dtype=np.float32, **shapes):
    return cases.make_mla_case(np.random.default_rng(seed), seqs, num_q_heads=heads,
                               row_dim=VALUE_DIM + ROPE_DIM, dtype=dtype,
                               **{**RAGGED_SHAPES, **shapes})


def check_kernel(name, case, tol=1e-5, **static):
    fn, interpret = KERNELS[name]
    args = {k: jnp.asarray(v) for k, v in case.items()}
    try:
        out, cache = fn(**args, sm_scale=SM_SCALE, value_dim=VALUE_DIM, interpret=interpret,
                        **static)
        jax.block_until_ready((out, cache))  # before the reset: callbacks are async
    finally:
        pltpu.reset_tpu_interpret_mode_state()
    assert out.shape == case["q"].shape[:2] + (VALUE_DIM,) and out.dtype == case["q"].dtype
    want_out, want_cache = reference(**args, sm_scale=SM_SCALE, value_dim=VALUE_DIM)
    as_f32 = lambda x: np.asarray(x.astype(jnp.float32))
    np.testing.assert_array_equal(as_f32(cache), as_f32(want_cache))  # NaN where NaN
    np.testing.assert_allclose(as_f32(out), as_f32(want_out), rtol=tol, atol=tol)  # pad rows: 0


@pytest.fixture(params=list(KERNELS))
def kernel(request):
    return functools.partial(check_kernel, request.param)


@pytest.mark.parametrize("batch", ["decode", "prefill", "mixed"])
def test_latent_kernel_equals_the_reference_for_each_batch_kind(kernel, batch):
    shapes, seqs = BATCHES[batch]
    kernel(make_case(seqs, **shapes))


def test_latent_kernel_over_several_kv_blocks_and_query_blocks(kernel):
    kernel(make_case(LONG_AND_SHORT, seed=1), q_block=4, kv_block_pages=1)


def test_latent_kernel_in_bfloat16(kernel):
    kernel(make_case(BATCHES["mixed"][1], seed=2, dtype=jnp.bfloat16), tol=2e-2)


def test_latent_kernel_with_a_live_sequence_without_new_tokens(kernel):
    kernel(make_case([(1, 20), (0, 9), (3, 3)], seed=3))


@pytest.mark.parametrize("num_kv_splits, heads_per_program", [(1, 2), (3, 4), (4, 1)])
def test_gpu_latent_kernel_heads_per_program_and_kv_splits(num_kv_splits, heads_per_program):
    case = make_case([(1, 200), (1, 17), (5, 40), (1, 1)], seed=4, pages_per_seq=16,
                     num_pages=96)
    check_kernel("gpu", case, num_kv_splits=num_kv_splits, heads_per_program=heads_per_program)


@pytest.mark.parametrize("num_kv_splits, heads_per_program, in_kernel",
                         [(1, 2, True), (3, 4, True), (1, 2, False)])
def test_gpu_one_token_items_write_their_latent_rows_and_attend_the_steps_new_ones(
        num_kv_splits, heads_per_program, in_kernel):
    # q_block 1: each new token an item that writes its latent row into the cache itself (the
    # first head program) and reads its sequence's new rows, not the cache's: sequences of 5
    # and 18 new tokens (two 16-row blocks), one with no prefix, one of one token. in_kernel
    # False: the same items through XLA's gathers and write (the form a GPU run times beside it).
    case = make_case([(1, 200), (18, 40), (5, 5), (1, 1)], seed=5, pages_per_seq=16,
                     num_pages=96, num_tokens=32)
    check_kernel("gpu", case, q_block=1, num_kv_splits=num_kv_splits,
                 heads_per_program=heads_per_program, decode_io_in_kernel=in_kernel)


def test_latent_kernels_refuse_shapes_they_cannot_take():
    q, latent = jnp.zeros((8, 2, 48)), jnp.zeros((8, 48))
    meta = (jnp.zeros(1, jnp.int32), jnp.zeros((1, 4), jnp.int32), jnp.zeros(2, jnp.int32),
            jnp.zeros(1, jnp.int32))
    for fn in (kernel_tpu.mla_ragged_paged_attention, kernel_gpu.mla_ragged_paged_attention):
        with pytest.raises(ValueError, match="MLA shapes"):
            fn(q, latent, jnp.zeros((4, 16, 40)), *meta, sm_scale=1.0, value_dim=32)
    with pytest.raises(ValueError, match="power-of-two latent and RoPE widths"):  # 40 + 8
        kernel_gpu.mla_ragged_paged_attention(q, latent, jnp.zeros((4, 16, 48)), *meta,
                                              sm_scale=1.0, value_dim=40)


def test_latent_kernels_take_a_cache_of_rows_padded_to_lane_tiles(kernel):
    # A TPU cache pads 48-wide rows to 128 lanes (transformer.kv_cache_shape): new rows are
    # written with zeros there, and the NaN in the padding of unused pages is never read.
    case = make_case(BATCHES["mixed"][1], seed=5)
    cache = case["kv_cache"]
    case["kv_cache"] = np.concatenate(
        [cache, np.full(cache.shape[:2] + (128 - cache.shape[2],), np.nan, cache.dtype)], -1)
    kernel(case)


def test_a_server_refuses_latent_widths_the_gpu_kernel_cannot_take_at_start_up():
    from xlaserve.pallas_kernels.ragged_paged_attention import api
    shapes = dict(page_size=16, head_dim=64, dtype=jnp.bfloat16, max_seqs=64, pages_per_seq=256)
    api.check_shapes("auto", "gpu", **shapes, latent=(512, 576))  # DeepSeek-V3
    with pytest.raises(ValueError, match="power-of-two latent and RoPE widths"):
        api.check_shapes("auto", "gpu", **shapes, latent=(512, 560))
    api.check_shapes("reference", "gpu", **shapes, latent=(512, 560))  # the reference takes any
