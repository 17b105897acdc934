"""The CPU latent-attention kernel (kernel_cpu.mla_ragged_paged_attention: C++ through XLA's FFI,
attend_latent.h) against its specification, the reference's `mla_ragged_paged_attention`, on
NaN-poisoned cases (cases.make_mla_case: unused pages, page-table slots past a sequence's pages,
cache slots past kv_len and padding tokens hold NaN, metadata rows past num_seqs garbage, so a
stray read fails). Output rows (padding rows included: 0) within the tolerances of
test_cpu_kernel.py, and the whole written cache exactly.

Widths: DeepSeek-V3's per-device layer (16 query heads, 512 latent + 64 RoPE'd entries), and
small ones that exercise the kernel's edges: 4 heads of 32 + 16, head counts that leave lanes of
a 16-head block empty or take several blocks, and value dims that are not a multiple of 16
(or of 32, which the bfloat16 pairs path needs: it widens to float32 there).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.kernels.test_cpu_kernel import BF16_PATHS
from tests.kernels.test_reference_attention import (BATCHES, DECODE_SHAPES, LONG_AND_SHORT,
                                                    RAGGED_SHAPES)
from xlaserve.pallas_kernels.ragged_paged_attention import cases, kernel_cpu
from xlaserve.pallas_kernels.ragged_paged_attention.reference import mla_ragged_paged_attention

kernel = jax.jit(kernel_cpu.mla_ragged_paged_attention,
                 static_argnames=("sm_scale", "value_dim", "bf16_pairs", "prefix_only"))
reference = jax.jit(mla_ragged_paged_attention,
                    static_argnames=("sm_scale", "value_dim", "prefix_only"))

HEADS, VALUE_DIM, ROPE_DIM = 4, 32, 16
BF16_TOL = 2e-2
# A prompt's later chunks over a long history, chunks straddling page boundaries, beside decodes.
CHUNKED_PREFILL = (dict(RAGGED_SHAPES, pages_per_seq=16, num_pages=96),
                   [(16, 100), (9, 57), (1, 200), (5, 37)])
# DeepSeek-V3 per device (128 query heads over 8 devices) beside two prompts; 40-page pool.
V3_SHAPES = dict(max_seqs=6, num_tokens=24, page_size=16, pages_per_seq=8, num_pages=40)
V3_SEQS = [(1, 120), (1, 17), (8, 40), (1, 1), (10, 10)]


def make_case(seqs, *, seed=0, heads=HEADS, row_dim=VALUE_DIM + ROPE_DIM, dtype=np.float32,
              **shapes):
    return cases.make_mla_case(np.random.default_rng(seed), seqs, num_q_heads=heads,
                               row_dim=row_dim, dtype=dtype, **{**RAGGED_SHAPES, **shapes})


def check(case, *, value_dim=VALUE_DIM, tol=1e-5, bf16_pairs=None, prefix_only=False):
    """The kernel's output and written cache against the reference's; with `prefix_only` (the
    expanded form's prefix part) its log-sum-exp too (-inf where a row has no key before this
    step), which it returns instead of the cache."""
    args = {k: jnp.asarray(v) for k, v in case.items()}
    options = dict(sm_scale=case["q"].shape[-1] ** -0.5, value_dim=value_dim)
    if prefix_only:
        options["prefix_only"] = True
    (out, *lse, cache) = kernel(**args, **options, bf16_pairs=bf16_pairs)
    assert out.shape == case["q"].shape[:2] + (value_dim,) and out.dtype == case["q"].dtype
    assert cache.shape == case["kv_cache"].shape and cache.dtype == case["kv_cache"].dtype
    (want_out, *want_lse, want_cache) = reference(**args, **options)
    as_f32 = lambda x: np.asarray(x.astype(jnp.float32))
    np.testing.assert_array_equal(as_f32(cache), as_f32(want_cache))  # NaN where NaN
    np.testing.assert_allclose(as_f32(out), as_f32(want_out), rtol=tol, atol=tol)
    if not prefix_only:
        return cache
    assert lse[0].shape == case["q"].shape[:2] and lse[0].dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(lse[0]), np.asarray(want_lse[0]), rtol=tol, atol=tol)
    return np.asarray(lse[0])


@pytest.mark.parametrize("batch", ["decode", "prefill", "mixed", "chunked_prefill",
                                   "long_and_short"])
def test_equals_the_reference_for_batch_kind(batch):
    shapes, seqs = {**BATCHES, "chunked_prefill": CHUNKED_PREFILL,
                    "long_and_short": (RAGGED_SHAPES, LONG_AND_SHORT)}[batch]
    check(make_case(seqs, **shapes))


def test_a_live_sequence_without_new_tokens_and_a_batch_without_live_sequences():
    check(make_case([(3, 10), (0, 20), (16, 16), (0, 7), (2, 9)], seed=1))
    check(make_case([], seed=2))


@pytest.mark.parametrize("bf16_pairs", BF16_PATHS)
@pytest.mark.parametrize("batch", ["decode", "mixed"])
def test_bfloat16_equals_the_reference(batch, bf16_pairs):
    shapes, seqs = BATCHES[batch]
    check(make_case(seqs, seed=3, dtype=jnp.bfloat16, **shapes), tol=BF16_TOL,
          bf16_pairs=bf16_pairs)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_writes_each_new_tokens_latent_row_and_nothing_else(dtype):
    seqs = BATCHES["mixed"][1]
    case = make_case(seqs, seed=4, dtype=dtype)
    cache = check(case, tol=1e-5 if dtype == np.float32 else BF16_TOL)
    cache = np.asarray(cache.astype(jnp.float32))
    want = case["kv_cache"].astype(np.float32)
    page_size, row = want.shape[1], 0
    for s, (q_len, kv_len) in enumerate(seqs):
        for pos in range(kv_len - q_len, kv_len):
            page, slot = case["page_indices"][s, pos // page_size], pos % page_size
            want[page, slot] = case["latent"][row].astype(np.float32)
            row += 1
    np.testing.assert_array_equal(cache, want)  # the other rows unchanged, NaN where NaN


# The kernel's three kinds of arithmetic: (dtype, bf16_pairs).
PATHS = [pytest.param(np.float32, False, id="float32"),
         pytest.param(jnp.bfloat16, True, id="bfloat16_pairs", marks=BF16_PATHS[0].marks),
         pytest.param(jnp.bfloat16, False, id="bfloat16_widened")]


@pytest.mark.parametrize("dtype, bf16_pairs", PATHS)
def test_deepseek_v3_per_device_shapes(dtype, bf16_pairs):
    case = make_case(V3_SEQS, seed=5, heads=16, row_dim=512 + 64, dtype=dtype, **V3_SHAPES)
    check(case, value_dim=512, tol=1e-5 if dtype == np.float32 else BF16_TOL,
          bf16_pairs=bf16_pairs)


@pytest.mark.parametrize("dtype, bf16_pairs", PATHS)
@pytest.mark.parametrize("heads, row_dim, value_dim", [
    (5, 48, 32),    # 11 empty lanes of the head block
    (40, 64, 64),   # three head blocks, the last half full
    (4, 48, 40),    # value dim not a multiple of 16 (pairs path: widened instead)
    (3, 45, 45),    # odd key dim, values the whole row (pairs path: widened instead)
    (2, 96, 16)])   # values a third of the row (pairs path: widened instead)
def test_small_and_odd_widths(heads, row_dim, value_dim, dtype, bf16_pairs):
    shapes, seqs = BATCHES["mixed"]
    check(make_case(seqs, seed=6, heads=heads, row_dim=row_dim, dtype=dtype, **shapes),
          value_dim=value_dim, tol=1e-5 if dtype == np.float32 else BF16_TOL,
          bf16_pairs=bf16_pairs)


@pytest.mark.parametrize("batch", ["decode", "mixed", "chunked_prefill", "long_and_short",
                                   "no_history"])
def test_prefix_only_equals_the_reference_for_batch_kind(batch):
    shapes, seqs = {**BATCHES, "chunked_prefill": CHUNKED_PREFILL,
                    "long_and_short": (RAGGED_SHAPES, LONG_AND_SHORT),
                    "no_history": (RAGGED_SHAPES, [(4, 4), (16, 16), (1, 1)])}[batch]
    lse = check(make_case(seqs, seed=9, **shapes), prefix_only=True)
    live = sum(q_len for q_len, _ in seqs)
    fresh = np.repeat([q_len == kv_len for q_len, kv_len in seqs], [q for q, _ in seqs])
    assert np.all(np.isneginf(lse[:live][fresh])) and np.all(np.isfinite(lse[:live][~fresh]))
    assert np.all(np.isneginf(lse[live:]))  # padding rows


@pytest.mark.parametrize("dtype, bf16_pairs", PATHS)
def test_prefix_only_at_deepseek_v3_per_device_shapes(dtype, bf16_pairs):
    case = make_case(V3_SEQS, seed=10, heads=16, row_dim=512 + 64, dtype=dtype, **V3_SHAPES)
    check(case, value_dim=512, tol=1e-5 if dtype == np.float32 else BF16_TOL,
          bf16_pairs=bf16_pairs, prefix_only=True)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_takes_a_cache_of_rows_padded_to_lane_tiles(dtype):
    # A TPU cache pads its rows (transformer.kv_cache_shape): new rows are written with zeros
    # there, and the NaN in the padding is never read.
    case = make_case(BATCHES["mixed"][1], seed=7, dtype=dtype)
    cache = case["kv_cache"]
    case["kv_cache"] = np.concatenate(
        [cache, np.full(cache.shape[:2] + (128 - cache.shape[2],), np.nan, cache.dtype)], -1)
    check(case, tol=1e-5 if dtype == np.float32 else BF16_TOL)


def test_the_cache_is_updated_in_place_when_donated():
    case = make_case(BATCHES["decode"][1], seed=8, **DECODE_SHAPES)
    donating = jax.jit(kernel_cpu.mla_ragged_paged_attention,
                       static_argnames=("sm_scale", "value_dim"), donate_argnums=(2,))
    args = {k: jnp.asarray(v) for k, v in case.items()}
    pointer = args["kv_cache"].unsafe_buffer_pointer()
    _, cache = donating(**args, sm_scale=0.1, value_dim=VALUE_DIM)
    assert cache.unsafe_buffer_pointer() == pointer


def test_shapes_and_dtypes_it_cannot_take_are_refused(monkeypatch):
    q, latent = jnp.zeros((8, 2, 48)), jnp.zeros((8, 48))
    meta = (jnp.zeros(1, jnp.int32), jnp.zeros((1, 4), jnp.int32), jnp.zeros(2, jnp.int32),
            jnp.zeros(1, jnp.int32))
    call = lambda q, latent, cache, value_dim=32, **kw: kernel_cpu.mla_ragged_paged_attention(
        q, latent, cache, *meta, sm_scale=1.0, value_dim=value_dim, **kw)
    with pytest.raises(ValueError, match="MLA shapes"):
        call(q, latent, jnp.zeros((4, 16, 40)))  # rows narrower than the keys
    with pytest.raises(ValueError, match="MLA shapes"):
        call(q, latent, jnp.zeros((4, 16, 48)), value_dim=49)
    with pytest.raises(ValueError, match="MLA shapes"):
        call(q, latent[:, :40], jnp.zeros((4, 16, 48)))
    with pytest.raises(ValueError, match="a KV cache in q's dtype or FP8"):
        call(q, latent, jnp.zeros((4, 16, 48), jnp.bfloat16))
    with pytest.raises(ValueError, match="q in float32 or bfloat16"):
        call(q.astype(jnp.float16), latent, jnp.zeros((4, 16, 48), jnp.float16))
    monkeypatch.setattr(kernel_cpu, "bf16_pairs_supported", lambda: False)
    with pytest.raises(ValueError, match="AVX512_BF16"):
        call(q.astype(jnp.bfloat16), latent, jnp.zeros((4, 16, 48), jnp.bfloat16), bf16_pairs=True)
