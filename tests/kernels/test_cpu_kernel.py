"""The CPU kernel (C++ through XLA's FFI) against its specification, the jnp reference, and the
float64 dense attention of test_reference_attention; same NaN-poisoned cases (unused pages, page
table slots past a sequence's pages, slots past kv_len, padding tokens all hold NaN or garbage).
"""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.kernels.test_reference_attention import (BATCHES, CHUNKED, DECODE_SHAPES, NUM_Q_HEADS,
                                                    RAGGED_SHAPES, SM_SCALE, attention,
                                                    expected_result, make_case,
                                                    poisoned_before_chunks, random_kernel_case)
from xlaserve.pallas_kernels.ragged_paged_attention import api, cases, kernel_cpu
from xlaserve.pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention

kernel = jax.jit(kernel_cpu.ragged_paged_attention,
                 static_argnames=("sm_scale", "sliding_window", "soft_cap", "bf16_pairs",
                                  "attention_chunk"))
# The two bfloat16 paths: VDPBF16PS on bfloat16 pairs (CPUs with AVX512_BF16), and float32
# arithmetic on the widened cache (every CPU).
BF16_PATHS = [pytest.param(True, id="bf16_pairs", marks=pytest.mark.skipif(
                  not kernel_cpu.bf16_pairs_supported(), reason="no AVX512_BF16 on this CPU")),
              pytest.param(False, id="widened")]


def check(case, tol=1e-5, bf16_pairs=None, sinks=None, **static):
    """Kernel output rows (padding rows included: 0) and the whole written cache against the
    reference; live rows also against dense float64 attention."""
    args = {k: jnp.asarray(v) for k, v in case.items()}
    out, cache = kernel(**args, sm_scale=SM_SCALE, bf16_pairs=bf16_pairs, sinks=sinks, **static)
    assert out.dtype == case["q"].dtype and cache.dtype == case["kv_cache"].dtype
    want_out, want_cache = attention(**args, sm_scale=SM_SCALE, sinks=sinks, **static)
    as_f32 = lambda x: np.asarray(x.astype(jnp.float32))
    np.testing.assert_allclose(as_f32(out), as_f32(want_out), rtol=tol, atol=tol)
    np.testing.assert_array_equal(as_f32(cache), as_f32(want_cache))  # NaN where NaN
    dense, _ = expected_result(case, static.get("sliding_window"), static.get("soft_cap"), sinks,
                               static.get("attention_chunk"))
    total = int(case["cu_q_lens"][case["num_seqs"][0]])
    np.testing.assert_allclose(as_f32(out)[:total], dense[:total], rtol=tol, atol=tol)


@pytest.mark.parametrize("num_kv_heads", [8, 4, 2, 1], ids=lambda h: f"gqa{NUM_Q_HEADS // h}")
@pytest.mark.parametrize("batch", list(BATCHES))
def test_equals_the_reference_for_batch_kind(batch, num_kv_heads):
    shapes, seqs = BATCHES[batch]
    check(make_case(np.random.default_rng(0), seqs, num_kv_heads=num_kv_heads, **shapes))


@pytest.mark.parametrize("head_dim", [64, 128, 40], ids=["d64", "d128", "d40_scalar_path"])
def test_head_dims(head_dim):
    shapes, seqs = BATCHES["mixed"]
    check(make_case(np.random.default_rng(1), seqs, num_kv_heads=2, head_dim=head_dim, **shapes))


@pytest.mark.parametrize("page_size,pages_per_seq,num_pages", [(16, 8, 48), (32, 4, 24), (64, 2, 12)])
def test_page_sizes_with_lengths_on_and_one_past_page_boundaries(page_size, pages_per_seq,
                                                                 num_pages):
    ps, full = page_size, page_size * pages_per_seq
    lengths = [(1, ps), (3, ps + 1), (2, 2 * ps), (5, min(2 * ps + 1, full)), (4, 4), (1, full)]
    seqs = [(min(q_len, kv_len), kv_len) for q_len, kv_len in lengths]
    check(make_case(np.random.default_rng(2), seqs, max_seqs=8, num_tokens=32, page_size=ps,
                    pages_per_seq=pages_per_seq, num_pages=num_pages, num_kv_heads=2))


@pytest.mark.parametrize("static", [dict(sliding_window=5), dict(sliding_window=40),
                                    dict(soft_cap=2.0), dict(sliding_window=7, soft_cap=3.0)],
                         ids=["window5", "window40", "softcap", "window_and_softcap"])
def test_sliding_window_and_soft_cap(static):
    shapes, seqs = BATCHES["mixed"]
    check(make_case(np.random.default_rng(3), seqs, num_kv_heads=4, **shapes), **static)


@pytest.mark.parametrize("dtype,head_dim,bf16_pairs,static", [
    pytest.param(np.float32, 32, None, dict(attention_chunk=16), id="float32_one_row_items"),
    pytest.param(np.float32, 40, None, dict(attention_chunk=12, soft_cap=5.0),
                 id="float32_d40_blocks_softcap"),
    pytest.param(jnp.bfloat16, 64, True, dict(attention_chunk=12), id="bfloat16_pairs",
                 marks=BF16_PATHS[0].marks),
    pytest.param(jnp.bfloat16, 64, False, dict(attention_chunk=16), id="bfloat16_widened")])
def test_attention_chunks_on_every_item_kind(dtype, head_dim, bf16_pairs, static):
    """Llama 4's chunked attention: decodes far past the first chunk, prefill chunks across a
    chunk boundary (test_reference_attention.CHUNKED), on each of the kernel's item kinds."""
    case = make_case(np.random.default_rng(14), CHUNKED, num_kv_heads=2, head_dim=head_dim,
                     dtype=dtype, **RAGGED_SHAPES)
    check(case, tol=2e-2 if dtype == jnp.bfloat16 else 1e-5, bf16_pairs=bf16_pairs, **static)


@pytest.mark.parametrize("head_dim", [32, 40], ids=["one_row_items", "blocks"])
def test_a_decode_in_a_later_chunk_reads_from_its_chunk_start_alone(head_dim):
    """Every page before each decode's chunk is NaN: the kernel skips them (and a window's
    earlier pages likewise), giving the reference's output on the clean cache."""
    seqs = [(1, 101), (1, 128), (1, 33), (1, 70), (1, 16)]
    clean = make_case(np.random.default_rng(15), seqs, num_kv_heads=2, head_dim=head_dim,
                      **DECODE_SHAPES)
    out, _ = kernel(**{k: jnp.asarray(v) for k, v in poisoned_before_chunks(clean, 16).items()},
                    sm_scale=SM_SCALE, attention_chunk=16)
    want, _ = attention(**{k: jnp.asarray(v) for k, v in clean.items()}, sm_scale=SM_SCALE,
                        attention_chunk=16)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_long_prefill_and_long_decodes():
    # A 300-token chunk over 2048 keys (many key tiles, query blocks of 16), with decodes beside
    # it, one exactly on a page boundary.
    seqs = [(300, 2048), (1, 2000), (1, 1024), (1, 1), (5, 777)]
    check(make_case(np.random.default_rng(4), seqs, max_seqs=8, num_tokens=320, page_size=64,
                    pages_per_seq=32, num_pages=160, num_kv_heads=2, head_dim=64))


def test_sixteen_decoding_sequences():
    rng = np.random.default_rng(5)
    seqs = [(1, int(kv)) for kv in rng.integers(1, 512, 16)]
    check(make_case(rng, seqs, max_seqs=16, num_tokens=16, page_size=32, pages_per_seq=16,
                    num_pages=300, num_kv_heads=1, head_dim=128))


@pytest.mark.parametrize("bf16_pairs", BF16_PATHS)
@pytest.mark.parametrize("batch", ["decode", "mixed"])
def test_bfloat16_inputs_and_cache(batch, bf16_pairs):
    shapes, seqs = BATCHES[batch]
    check(make_case(np.random.default_rng(6), seqs, num_kv_heads=2, dtype=jnp.bfloat16, **shapes),
          tol=2e-2, bf16_pairs=bf16_pairs)


@pytest.mark.parametrize("bf16_pairs", BF16_PATHS)
@pytest.mark.parametrize("num_kv_heads", [8, 2, 1], ids=lambda h: f"gqa{NUM_Q_HEADS // h}")
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 40])
def test_bfloat16_head_dims_and_gqa_groups(head_dim, num_kv_heads, bf16_pairs):
    # Groups of 1, 4 and 8 query heads (the pairs path scores them 3 at a time: 1, 3+1, 3+3+2);
    # head dim 40 is not a multiple of 32 and takes the widened path either way.
    shapes, seqs = BATCHES["mixed"]
    check(make_case(np.random.default_rng(10), seqs, num_kv_heads=num_kv_heads, head_dim=head_dim,
                    dtype=jnp.bfloat16, **shapes), tol=2e-2, bf16_pairs=bf16_pairs)


@pytest.mark.parametrize("bf16_pairs", BF16_PATHS)
@pytest.mark.parametrize("static", [dict(sliding_window=5), dict(sliding_window=7, soft_cap=3.0)],
                         ids=["window5", "window_and_softcap"])
def test_bfloat16_sliding_window_and_soft_cap(static, bf16_pairs):
    shapes, seqs = BATCHES["mixed"]
    check(make_case(np.random.default_rng(11), seqs, num_kv_heads=4, dtype=jnp.bfloat16,
                    **shapes), tol=2e-2, bf16_pairs=bf16_pairs, **static)


@pytest.mark.parametrize("dtype,head_dim,bf16_pairs,static", [
    pytest.param(np.float32, 64, None, {}, id="float32_one_row_items"),
    pytest.param(np.float32, 40, None, dict(sliding_window=5), id="float32_d40_blocks_window"),
    pytest.param(jnp.bfloat16, 64, True, dict(sliding_window=7), id="bfloat16_pairs_window",
                 marks=BF16_PATHS[0].marks),
    pytest.param(jnp.bfloat16, 64, False, {}, id="bfloat16_widened")])
def test_attention_sinks_on_every_item_kind(dtype, head_dim, bf16_pairs, static):
    # Each of the kernel's three item kinds starts its online softmax at the sinks: one-row items
    # (float32, or bfloat16 widened), blocks of rows (head dims not a multiple of 8), and
    # bfloat16 pairs; GQA 4, decodes beside prefills.
    shapes, seqs = BATCHES["mixed"]
    rng = np.random.default_rng(13)
    case = make_case(rng, seqs, num_kv_heads=2, head_dim=head_dim, dtype=dtype, **shapes)
    check(case, tol=2e-2 if dtype == jnp.bfloat16 else 1e-5, bf16_pairs=bf16_pairs,
          sinks=jnp.asarray(cases.make_sinks(rng, NUM_Q_HEADS)), **static)


def test_every_cpu_backend_takes_sinks_as_a_keyword():
    # What the model calls: api's attention function, with sinks=None (none) or one per head.
    shapes, seqs = BATCHES["decode"]
    rng = np.random.default_rng(14)
    args = {k: jnp.asarray(v) for k, v in make_case(rng, seqs, num_kv_heads=2, **shapes).items()}
    sinks = jnp.asarray(cases.make_sinks(rng, NUM_Q_HEADS))
    for backend in ("auto", "reference", "cpu"):
        fn = jax.jit(api.get_attention_fn(backend), static_argnames=("sm_scale",))
        for s in (None, sinks):
            out, _ = fn(**args, sm_scale=SM_SCALE, sinks=s)
            want, _ = attention(**args, sm_scale=SM_SCALE, sinks=s)
            np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_bfloat16_pairs_refused_where_the_cpu_lacks_them(monkeypatch):
    monkeypatch.setattr(kernel_cpu, "bf16_pairs_supported", lambda: False)
    case = make_case(np.random.default_rng(12), [(1, 5)], num_kv_heads=2, dtype=jnp.bfloat16,
                     **DECODE_SHAPES)
    with pytest.raises(ValueError, match="AVX512_BF16"):
        kernel_cpu.ragged_paged_attention(**case, sm_scale=SM_SCALE, bf16_pairs=True)


def test_live_sequence_without_new_tokens_and_no_live_sequences():
    shapes, _ = BATCHES["mixed"]
    check(make_case(np.random.default_rng(7), [(3, 10), (0, 20), (16, 16), (0, 7), (2, 9)],
                    num_kv_heads=2, **shapes))
    check(make_case(np.random.default_rng(8), [], num_kv_heads=2, **shapes))


def test_the_cache_is_updated_in_place_when_donated():
    shapes, seqs = BATCHES["decode"]
    case = make_case(np.random.default_rng(9), seqs, num_kv_heads=2, **shapes)
    donating = jax.jit(kernel_cpu.ragged_paged_attention, static_argnames=("sm_scale",),
                       donate_argnums=(3,))
    args = {k: jnp.asarray(v) for k, v in case.items()}
    pointer = args["kv_cache"].unsafe_buffer_pointer()
    _, cache = donating(**args, sm_scale=SM_SCALE)
    assert cache.unsafe_buffer_pointer() == pointer


def test_auto_picks_the_cpu_kernel_and_backends_are_checked():
    assert api.get_attention_fn() is kernel_cpu.ragged_paged_attention
    assert api.get_attention_fn("cpu") is kernel_cpu.ragged_paged_attention
    assert api.get_attention_fn("reference") is ragged_paged_attention
    with pytest.raises(ValueError, match="reference"):
        api.get_attention_fn("pallas")
    with pytest.raises(ValueError, match="unknown"):
        api.get_attention_fn("cuda")


def test_without_a_compiler_auto_falls_back_to_the_reference(tmp_path):
    script = ("import logging; logging.basicConfig()\n"
              "from xlaserve.pallas_kernels.ragged_paged_attention import api, reference\n"
              "assert api.get_attention_fn() is reference.ragged_paged_attention\n"
              "try:\n    api.get_attention_fn('cpu')\nexcept api.kernel_cpu.KernelUnavailable:\n"
              "    print('refused')\n")
    env = {**os.environ, "CXX": "/bin/false", "XLASERVE_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "refused"
    assert "CPU attention kernel is unavailable" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(40))
def test_random_batches_equal_the_reference(seed):
    case, static, tol = random_kernel_case(np.random.default_rng(200 + seed))
    check(case, tol=tol, **static)
