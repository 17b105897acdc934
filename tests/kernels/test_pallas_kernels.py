"""The Pallas TPU and GPU kernels against their specification, the jnp reference, on CPU in Pallas
interpret mode (the TPU kernel under `pltpu.InterpretParams()`, which simulates its DMAs and
semaphores and raises on any out-of-bounds read; the GPU kernel with `interpret=True`).

Same NaN-poisoned cases as test_reference_attention: unused pages, page-table slots past a
sequence's pages, cache slots past kv_len and padding tokens hold NaN or garbage, so a stray read
fails. Interpret mode is slow (seconds per call), so the default set is one representative case
per feature; `--slow` adds the full grid and random batches.
"""
import functools
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from tests.kernels.test_reference_attention import (BATCHES, CHUNK_IDS, CHUNK_STATICS, CHUNKED,
                                                    DECODE_SHAPES, LONG_AND_SHORT, RAGGED_SHAPES,
                                                    SM_SCALE, attention, make_case,
                                                    poisoned_before_chunks, random_kernel_case)
from xlaserve.pallas_kernels.ragged_paged_attention import (api, cases, kernel_gpu, kernel_tpu,
                                                         tpu_page_writes)

STATIC = ("sm_scale", "sliding_window", "soft_cap", "interpret", "q_block", "kv_block_pages",
          "attention_chunk")
KERNELS = {
    "tpu": (jax.jit(kernel_tpu.ragged_paged_attention, static_argnames=STATIC),
            pltpu.InterpretParams()),
    "gpu": (jax.jit(kernel_gpu.ragged_paged_attention,
                    static_argnames=STATIC + ("num_kv_splits", "decode_io_in_kernel")), True),
}


def check_kernel(name, case, tol=1e-5, sinks=None, **static):
    """Runs kernel `name` in interpret mode against the reference; static options go through to
    it (the block sizes and splits are only given to the kernel, the reference picks its own)."""
    fn, interpret = KERNELS[name]
    args = {k: jnp.asarray(v) for k, v in case.items()}
    try:
        out, cache = fn(**args, sm_scale=SM_SCALE, interpret=interpret, sinks=sinks, **static)
        jax.block_until_ready((out, cache))  # before the reset: callbacks are async
    finally:
        pltpu.reset_tpu_interpret_mode_state()  # required after an error, harmless otherwise
    assert out.dtype == case["q"].dtype and cache.dtype == case["kv_cache"].dtype
    assert cache.shape == case["kv_cache"].shape  # as it came in, flat or by head
    spec = {k: v for k, v in static.items()
            if k in ("sliding_window", "soft_cap", "attention_chunk")}
    want_out, want_cache = attention(**args, sm_scale=SM_SCALE, sinks=sinks, **spec)
    as_f32 = lambda x: np.asarray(x.astype(jnp.float32))
    np.testing.assert_array_equal(as_f32(cache), as_f32(want_cache))  # NaN where NaN
    np.testing.assert_allclose(as_f32(out), as_f32(want_out), rtol=tol, atol=tol)  # pad rows: 0


@pytest.fixture(params=list(KERNELS))
def kernel(request):
    """`check_kernel` of one kernel."""
    return functools.partial(check_kernel, request.param)


def boundary_case(rng, page_size, head_dim, **shapes):
    """kv lengths on a page boundary and one past it, a full page table, a 4-token prefill."""
    ps, full = page_size, page_size * shapes["pages_per_seq"]
    lengths = [(1, ps), (3, ps + 1), (2, 2 * ps), (5, min(2 * ps + 1, full)), (4, 4), (1, full)]
    seqs = [(min(q_len, kv_len), kv_len) for q_len, kv_len in lengths]
    return make_case(rng, seqs, max_seqs=8, num_tokens=32, page_size=ps, num_kv_heads=2,
                     head_dim=head_dim, **shapes)


@pytest.mark.parametrize("batch,num_kv_heads", [("decode", 1), ("prefill", 8), ("mixed", 4),
                                                ("mixed", 2)],
                         ids=["decode_gqa8", "prefill_gqa1", "mixed_gqa2", "mixed_gqa4"])
def test_equals_the_reference_for_batch_kind_and_gqa_ratio(kernel, batch, num_kv_heads):
    shapes, seqs = BATCHES[batch]
    kernel(make_case(np.random.default_rng(0), seqs, num_kv_heads=num_kv_heads, **shapes))


@pytest.mark.parametrize("page_size,head_dim", [(16, 64), (64, 128)], ids=["ps16_d64", "ps64_d128"])
def test_lengths_on_and_one_past_page_boundaries(kernel, page_size, head_dim):
    pages_per_seq = 128 // page_size
    kernel(boundary_case(np.random.default_rng(1), page_size, head_dim,
                         pages_per_seq=pages_per_seq, num_pages=6 * pages_per_seq))


def test_online_softmax_over_several_kv_blocks_and_query_blocks(kernel):
    # Blocks of 2 pages over up to 8 pages per sequence (the TPU kernel's double buffer turns
    # over several times), prefills split into items of 4 tokens.
    case = make_case(np.random.default_rng(2), LONG_AND_SHORT, num_kv_heads=2, **RAGGED_SHAPES)
    kernel(case, q_block=4, kv_block_pages=2)


@pytest.mark.parametrize("static", [dict(sliding_window=10), dict(sliding_window=7, soft_cap=3.0)],
                         ids=["window", "window_and_softcap"])
def test_sliding_window_and_soft_cap(kernel, static):
    # One-page KV blocks, so windows that have passed whole blocks skip them.
    seqs = [(1, 128), (4, 100), (1, 60), (9, 70), (1, 3)]
    case = make_case(np.random.default_rng(3), seqs, num_kv_heads=2, **RAGGED_SHAPES)
    kernel(case, kv_block_pages=1, **static)


@pytest.mark.parametrize("static", CHUNK_STATICS, ids=CHUNK_IDS)
def test_attention_chunks(kernel, static):
    """Llama 4's chunked attention: decodes far past the first chunk, prefill items across a
    chunk boundary (test_reference_attention.CHUNKED), one-page blocks skipped before a chunk."""
    kernel(make_case(np.random.default_rng(23), CHUNKED, num_kv_heads=2, **RAGGED_SHAPES),
           **static)


@pytest.mark.parametrize("name", list(KERNELS))
def test_a_decode_in_a_later_chunk_reads_from_its_chunk_start_alone(name):
    """One-page KV blocks; every page before each decode's chunk is NaN, which a block read
    there would carry into the output (p * NaN is NaN at p = 0)."""
    fn, interpret = KERNELS[name]
    seqs = [(1, 101), (1, 128), (1, 33), (1, 70), (1, 16)]
    clean = make_case(np.random.default_rng(24), seqs, num_kv_heads=2, **DECODE_SHAPES)
    try:
        out, _ = fn(**{k: jnp.asarray(v) for k, v in poisoned_before_chunks(clean, 16).items()},
                    sm_scale=SM_SCALE, interpret=interpret, attention_chunk=16, kv_block_pages=1)
        jax.block_until_ready(out)
    finally:
        pltpu.reset_tpu_interpret_mode_state()
    want, _ = attention(**{k: jnp.asarray(v) for k, v in clean.items()}, sm_scale=SM_SCALE,
                        attention_chunk=16)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("static", [dict(q_block=4), dict(sliding_window=10, kv_block_pages=1)],
                         ids=["query_blocks", "window_skipping_blocks"])
def test_attention_sinks(kernel, static):
    # GQA 4, so a kv head's rows hold four query heads' sinks; prefills split into several items,
    # or one-page KV blocks that a window skips.
    seqs = [(1, 128), (4, 100), (1, 60), (9, 70), (1, 3)]
    rng = np.random.default_rng(15)
    case = make_case(rng, seqs, num_kv_heads=2, **RAGGED_SHAPES)
    kernel(case, sinks=jnp.asarray(cases.make_sinks(rng, 8)), **static)


def test_soft_cap_alone(kernel):
    shapes, seqs = BATCHES["mixed"]
    kernel(make_case(np.random.default_rng(4), seqs, num_kv_heads=4, **shapes), soft_cap=2.0)


def test_bfloat16_inputs_and_cache(kernel):
    shapes, seqs = BATCHES["mixed"]
    kernel(make_case(np.random.default_rng(5), seqs, num_kv_heads=2, head_dim=128,
                     dtype=jnp.bfloat16, **shapes), tol=2e-2)


def test_live_sequence_without_new_tokens_and_no_live_sequences(kernel):
    shapes, _ = BATCHES["mixed"]
    kernel(make_case(np.random.default_rng(6), [(3, 10), (0, 20), (16, 16), (0, 7), (2, 9)],
                     num_kv_heads=2, **shapes))
    kernel(make_case(np.random.default_rng(7), [], num_kv_heads=2, **shapes))


@pytest.mark.parametrize("dtype,q_block", [("float32", 40), ("bfloat16", 40), ("bfloat16", 6)],
                         ids=["f32_items_of_40", "bf16_items_of_40", "bf16_items_of_6"])
def test_tpu_kernel_writes_pages_that_consecutive_items_share_in_order(dtype, q_block):
    # The TPU kernel writes the new K/V itself, whole pages merged in VMEM: prefills cut into
    # items that start mid-page, so consecutive items of a sequence write the same page and the
    # later one must fetch it after the earlier one's write; items of 40 rows take the merge's
    # sliding window over their rows, items of 6 the zero-padded one. KV blocks of 4 pages: an
    # item reads one or two, and the next item's first block, prefetched during this item's last,
    # may hold pages this one writes there. DMAs run as soon as started (the interpreter's
    # default runs them at the wait), so a fetch started before a write it depends on reads the
    # poisoned slot: fetching the next block of the same sequence before this item's writes are
    # done made this test fail.
    seqs = [(90, 100), (1, 37), (70, 75), (2, 16)]
    case = make_case(np.random.default_rng(16), seqs, max_seqs=8, num_tokens=176, page_size=16,
                     pages_per_seq=8, num_pages=40, num_kv_heads=2, head_dim=64,
                     dtype=jnp.dtype(dtype))
    args = {k: jnp.asarray(v) for k, v in case.items()}
    params = pltpu.InterpretParams(dma_execution_mode="eager")
    try:
        out, cache = KERNELS["tpu"][0](**args, sm_scale=SM_SCALE, interpret=params,
                                       q_block=q_block, kv_block_pages=4)
        jax.block_until_ready((out, cache))  # before the reset: callbacks are async
    finally:
        pltpu.reset_tpu_interpret_mode_state()
    want_out, want_cache = attention(**args, sm_scale=SM_SCALE)
    as_f32 = lambda x: np.asarray(x.astype(jnp.float32))
    np.testing.assert_array_equal(as_f32(cache), as_f32(want_cache))
    tol = 2e-2 if dtype == "bfloat16" else 1e-5
    np.testing.assert_allclose(as_f32(out), as_f32(want_out), rtol=tol, atol=tol)


def cache_writes(fn, args):
    """(primitive, rows, lanes) of each DMA start and wait into the cache (HBM) in the kernel's
    jaxpr, loops and conditionals included: the sizes are static, the counts are not."""
    pages, page_size, *token = args["kv_cache"].shape
    cache_shape = (pages, page_size, int(np.prod(token)))  # the kernel's flat view

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("dma_start", "dma_wait"):
                _, dst, *_ = eqn.params["tree"].unflatten([v.aval for v in eqn.invars])
                if dst.ref.shape == cache_shape:  # not the VMEM double buffer
                    yield (eqn.primitive.name,) + tuple(dst.shape)
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else [param]:
                    if isinstance(sub, (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr)):
                        yield from walk(getattr(sub, "jaxpr", sub))
    return list(walk(jax.make_jaxpr(fn)(args).jaxpr))


@pytest.mark.parametrize("dtype,tile", [("bfloat16", 16), ("float32", 8)])
def test_tpu_kernel_writes_back_only_the_sublane_tiles_holding_new_tokens(dtype, tile):
    # The written rows equal what the reference writes either way (a wider write copies back
    # what it read), so the write-back's width is checked on the kernel itself: every DMA into the
    # cache moves one sublane tile of rows, never a whole 64-token page (256 on v6e at 256
    # requests: 16x the bytes). With whole-page write-back this found (64, lanes).
    seqs = [(1, 40), (1, 70), (30, 100)]
    case = make_case(np.random.default_rng(5), seqs, max_seqs=4, num_tokens=40, page_size=64,
                     pages_per_seq=4, num_pages=12, num_kv_heads=2, head_dim=64,
                     dtype=jnp.dtype(dtype))
    args = {k: jnp.asarray(v) for k, v in case.items()}
    writes = cache_writes(lambda a: kernel_tpu.ragged_paged_attention(
        **a, sm_scale=SM_SCALE, interpret=pltpu.InterpretParams()), args)
    lanes = int(np.prod(case["kv_cache"].shape[2:]))
    assert set(writes) == {("dma_start", tile, lanes), ("dma_wait", tile, lanes)}


def test_tpu_written_tiles_cover_the_new_tokens_of_a_page_and_nothing_more():
    tiles = lambda page_pos, first, last: tuple(int(x) for x in tpu_page_writes.written_tiles(
        page_pos, first, last, page_size=256, tile=16))
    assert tiles(0, 40, 40) == (2, 3)  # a decode token: one tile
    assert tiles(256, 511, 511) == (15, 16)  # the page's last row
    assert tiles(256, 256, 256) == (0, 1)  # its first
    assert tiles(0, 20, 100) == (1, 7)  # partial first and last tiles
    assert tiles(256, 100, 300) == (0, 3)  # a span that starts on an earlier page
    assert tiles(256, 500, 600) == (15, 16)  # and one that goes on to the next
    assert tiles(0, 0, 1000) == (0, 16)  # the whole page
    # Llama-3.1-8B at tp 4 on v6e (2 kv heads of 128 a chip, bfloat16, 256-token pages): a decode
    # item writes 16 token rows a layer, 16 KiB, where a whole page was 256 KiB.
    first, end = tiles(0, 40, 40)
    assert (end - first) * 16 * (2 * 2 * 128) * 2 == 16 << 10


@pytest.mark.parametrize("num_kv_splits", [4, 7])
def test_gpu_split_kv_decode_over_long_contexts_and_empty_splits(num_kv_splits):
    # 16-token KV blocks: the 1000-token context is 63 blocks over the splits, the short ones
    # leave later splits with no pages (cases.SPLIT_KV_DECODE). GQA 4.
    case = make_case(np.random.default_rng(16), cases.SPLIT_KV_DECODE, num_kv_heads=2,
                     **cases.SPLIT_KV_SHAPES)
    check_kernel("gpu", case, kv_block_pages=1, num_kv_splits=num_kv_splits)


@pytest.mark.parametrize("static", [{"q_block": 4}, {"sliding_window": 100, "soft_cap": 3.0},
                                    {"attention_chunk": 96}],
                         ids=["sinks_prefill_items", "sinks_window_soft_cap", "sinks_chunk"])
def test_gpu_split_kv_counts_sinks_once_with_prefill_items_windows_and_soft_cap(static):
    # Prefill items of 4 rows whose early rows see no key in the later splits; a 100-token window
    # that skips most of the 1000-token context's blocks before they are split.
    rng = np.random.default_rng(17)
    case = make_case(rng, cases.SPLIT_KV_MIXED, num_kv_heads=2, **cases.SPLIT_KV_MIXED_SHAPES)
    check_kernel("gpu", case, sinks=jnp.asarray(cases.make_sinks(rng, 8)), kv_block_pages=1,
                 num_kv_splits=5, **static)


def test_gpu_split_kv_in_bfloat16():
    case = make_case(np.random.default_rng(18), cases.SPLIT_KV_DECODE, num_kv_heads=2,
                     head_dim=128, dtype=jnp.bfloat16, **cases.SPLIT_KV_SHAPES)
    check_kernel("gpu", case, tol=2e-2, num_kv_splits=3)  # 64-token blocks: 16 over 3 splits


@pytest.mark.parametrize("q_block", [1, 3, 8])
def test_gathered_outputs_equal_the_scattered_ones_padding_tokens_zero(q_block):
    # Ragged sequences (some empty), metadata rows past num_seqs holding garbage, items in
    # make_work_items' order: each token's row comes back to it, padding tokens get 0.
    from xlaserve.pallas_kernels.ragged_paged_attention import work_items

    rng = np.random.default_rng(q_block)
    q_lens = np.array([5, 0, 1, 9, 2]), 3  # live sequences: the first 3
    num_tokens, max_seqs, num_kv_heads, group, head_dim = 24, 5, 2, 3, 4
    cu = np.concatenate([[0], np.cumsum(q_lens[0])]).astype(np.int32)
    kv_lens = jnp.asarray(rng.integers(20, 40, max_seqs), jnp.int32)
    pages = jnp.zeros((max_seqs, 4), jnp.int32)
    kv_lens, _, cu_q_lens, _ = work_items.sanitize_metadata(
        kv_lens, pages, jnp.asarray(cu), jnp.array([q_lens[1]], jnp.int32), num_tokens)
    item_seq, item_row0 = work_items.make_work_items(cu_q_lens, num_tokens, q_block)
    rows = max(16, q_block * group)
    out_items = jnp.asarray(rng.standard_normal((item_seq.shape[0], num_kv_heads, rows, head_dim)),
                            jnp.float32)
    want = work_items.scatter_outputs(out_items, cu_q_lens, item_seq, item_row0, q_block,
                                      num_tokens, num_kv_heads * group)
    got = work_items.gather_outputs(out_items, cu_q_lens, q_block, num_tokens,
                                    num_kv_heads * group)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert not np.asarray(got)[int(cu_q_lens[-1]):].any() and np.asarray(got)[:6].all()


@pytest.mark.parametrize("num_kv_splits", [1, 3])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_gpu_decode_items_read_queries_and_write_outputs_in_token_order(num_kv_splits,
                                                                        with_sinks):
    # One-token items (q_block 1) read q and, unsplit, write the output in place; 7 query heads a
    # kv head (Qwen2.5-0.5B's group) fill a 16-row block as heads 0-6, 0-6, 0-1, whose repeated
    # rows compute and write the same values. Padding tokens of q are NaN, live ones are not
    # contiguous in kv length, and the last program's rows end at q's last row.
    rng = np.random.default_rng(21)
    seqs = [(1, 40), (1, 1), (1, 17), (1, 64)]
    case = make_case(rng, seqs, max_seqs=6, num_tokens=6, page_size=16, pages_per_seq=4,
                     num_pages=24, num_kv_heads=2, num_q_heads=14, head_dim=32)
    sinks = jnp.asarray(cases.make_sinks(rng, 14)) if with_sinks else None
    check_kernel("gpu", case, sinks=sinks, q_block=1, num_kv_splits=num_kv_splits)


@pytest.mark.parametrize("static", [dict(num_kv_splits=1), dict(num_kv_splits=3),
                                    dict(sliding_window=7, kv_block_pages=1),
                                    dict(attention_chunk=12, num_kv_splits=3),
                                    dict(num_kv_splits=1, decode_io_in_kernel=False)])
def test_gpu_one_token_items_write_their_kv_and_attend_the_steps_new_keys(static):
    # One-token items write their own K/V into the cache and attend their sequence's new keys
    # from k and v, not from the cache: here sequences of 2, 20 (two 16-key blocks of new keys)
    # and 1 new tokens, each new token an item of its own (q_block 1), and one with no prefix.
    # decode_io_in_kernel=False: the same items through XLA's gathers and scatter (the form a
    # GPU run times beside it).
    rng = np.random.default_rng(22)
    seqs = [(2, 40), (20, 37), (1, 1), (1, 16), (3, 3)]
    case = make_case(rng, seqs, max_seqs=6, num_tokens=32, page_size=16, pages_per_seq=4,
                     num_pages=24, num_kv_heads=2, num_q_heads=6, head_dim=32)
    check_kernel("gpu", case, q_block=1, **static)


def test_gpu_default_kv_splits_as_the_h200_sweep_chose():
    # (work items, kv heads, KV blocks of a full page table[, q_block]) -> splits; see the
    # docstring. Llama-3.1-8B decode buckets: 4 splits up to 64 rows (the sweep's fastest at 1,
    # 8 and 64 rows), 2 at 128, none from 256 (fastest unsplit).
    for rows in (1, 8, 16, 32, 64):
        assert kernel_gpu.default_num_kv_splits(rows, 8, 64) == 4
    assert kernel_gpu.default_num_kv_splits(128, 8, 64) == 2
    assert kernel_gpu.default_num_kv_splits(256, 8, 64) == 1
    assert kernel_gpu.default_num_kv_splits(256, 2, 64) == 1  # Qwen2.5-0.5B, Llama at tp 4
    assert kernel_gpu.default_num_kv_splits(64, 2, 64) == 4
    assert kernel_gpu.default_num_kv_splits(8, 2, 64) == kernel_gpu.MAX_KV_SPLITS  # TP4
    assert kernel_gpu.default_num_kv_splits(8, 2, 3) == 3  # no more splits than KV blocks
    # Prefill items (several rows each) split only a small grid.
    assert kernel_gpu.default_num_kv_splits(120, 8, 64, q_block=32) == 1
    assert kernel_gpu.default_num_kv_splits(1, 8, 64, q_block=32) == 4


def test_pallas_backend_is_refused_on_cpu_unless_interpreted():
    with pytest.raises(ValueError, match="TPU and GPU.*interpret"):
        api.get_attention_fn("pallas")
    shapes, seqs = BATCHES["decode"]
    case = make_case(np.random.default_rng(8), seqs, num_kv_heads=2, **shapes)
    args = {k: jnp.asarray(v) for k, v in case.items()}
    out, cache = jax.jit(api.get_attention_fn("pallas", interpret=True),
                         static_argnames=("sm_scale",))(**args, sm_scale=SM_SCALE)
    want_out, want_cache = attention(**args, sm_scale=SM_SCALE)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(cache), np.asarray(want_cache))


TENSOR_PARALLEL_SCRIPT = """
import functools
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh
from tests.kernels.test_reference_attention import BATCHES, SM_SCALE, attention, make_case
from xlaserve.pallas_kernels.ragged_paged_attention import api, cases, kernel_cpu, kernel_gpu
mesh = Mesh(np.array(jax.devices()).reshape(1, 2), ("data", "tensor"))
shapes, seqs = BATCHES["mixed"]
rng = np.random.default_rng(12)
case = make_case(rng, seqs, num_kv_heads=2, **shapes)
args = {k: jnp.asarray(v) for k, v in case.items()}
sinks = jnp.asarray(cases.make_sinks(rng, 8))  # each device gets its 4 query heads' sinks
gpu_kernel = functools.partial(kernel_gpu.ragged_paged_attention, interpret=True)
cpu_kernel = kernel_cpu.ragged_paged_attention
for kernel, s in ((gpu_kernel, None), (gpu_kernel, sinks), (cpu_kernel, sinks)):
    fn = jax.jit(api._split_by_kv_head(kernel, mesh), static_argnames=("sm_scale",))
    out, cache = fn(**args, sm_scale=SM_SCALE, sinks=s)
    want_out, want_cache = attention(**args, sm_scale=SM_SCALE, sinks=s)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(cache), np.asarray(want_cache))
print("ok")
"""


def test_tensor_parallel_mesh_splits_the_kernel_by_kv_head():
    # Two CPU devices, one kv head each: the kernel runs under shard_map on its own heads (and
    # their sinks). The GPU kernel stands for both Pallas ones: the TPU interpreter, simulating
    # every device's memory, hung under shard_map on two CPU devices. The CPU kernel, with sinks.
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(Path(__file__).parents[2])}
    result = subprocess.run([sys.executable, "-c", TENSOR_PARALLEL_SCRIPT], capture_output=True,
                            text=True, env=env, timeout=120)
    assert result.stdout.strip().endswith("ok"), result.stdout[-2000:] + result.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [16, 32, 64])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_page_sizes_and_head_dims_full_grid(kernel, page_size, head_dim):
    pages_per_seq = 256 // page_size
    kernel(boundary_case(np.random.default_rng(9), page_size, head_dim,
                         pages_per_seq=pages_per_seq, num_pages=6 * pages_per_seq))


@pytest.mark.slow
@pytest.mark.parametrize("num_kv_heads", [8, 4, 2, 1], ids=lambda h: f"gqa{8 // h}")
@pytest.mark.parametrize("batch", list(BATCHES))
def test_every_batch_kind_and_gqa_ratio(kernel, batch, num_kv_heads):
    shapes, seqs = BATCHES[batch]
    kernel(make_case(np.random.default_rng(10), seqs, num_kv_heads=num_kv_heads, **shapes))


@pytest.mark.slow
def test_long_prefill_and_long_decodes(kernel):
    # A 300-token chunk over 2048 keys beside decodes, one exactly on a page boundary.
    seqs = [(300, 2048), (1, 2000), (1, 1024), (1, 1), (5, 777)]
    kernel(make_case(np.random.default_rng(11), seqs, max_seqs=8, num_tokens=320, page_size=64,
                     pages_per_seq=32, num_pages=160, num_kv_heads=2, head_dim=64))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(20))
def test_random_batches_equal_the_reference(kernel, seed):
    case, static, tol = random_kernel_case(np.random.default_rng(300 + seed))
    kernel(case, tol=tol, **static)


def test_flat_cache_layout_gives_the_same_result_in_the_same_shape(kernel):
    # The runtime stores each layer's cache as [pages, page_size, 2*Hkv*D] (transformer.
    # kv_cache_shape): every kernel takes it, and returns it in that shape.
    shapes, seqs = BATCHES["mixed"]
    case = make_case(np.random.default_rng(13), seqs, num_kv_heads=2, **shapes)
    pages, page_size = case["kv_cache"].shape[:2]
    flat = dict(case, kv_cache=case["kv_cache"].reshape(pages, page_size, -1))
    kernel(flat)  # compares against the reference, which takes the flat cache too


def test_reference_and_cpu_kernel_take_the_flat_cache():
    shapes, seqs = BATCHES["decode"]
    case = make_case(np.random.default_rng(14), seqs, num_kv_heads=2, **shapes)
    args = {k: jnp.asarray(v) for k, v in case.items()}
    want_out, want_cache = attention(**args, sm_scale=SM_SCALE)
    flat_cache = args["kv_cache"].reshape(args["kv_cache"].shape[:2] + (-1,))
    for backend in ("reference", "cpu"):
        fn = jax.jit(api.get_attention_fn(backend), static_argnames=("sm_scale",))
        out, cache = fn(**dict(args, kv_cache=flat_cache), sm_scale=SM_SCALE)
        assert cache.shape == flat_cache.shape, backend
        np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(cache).reshape(want_cache.shape),
                                      np.asarray(want_cache))
