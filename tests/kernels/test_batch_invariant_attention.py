"""Batch invariance of the ragged paged attention kernels (issue 75, deterministic inference): a
sequence's output rows are the same bits whatever other sequences share the call, whatever the
bucket's padded shape, and wherever its prompt was cut into chunks: the CPU kernel, and the TPU
and GPU Pallas kernels in interpret mode, as --enable-deterministic-inference runs them
(ragged_paged_attention/api.py's fixed_work_items). By default the Pallas kernels' work items
follow the step's mean tokens per sequence, their KV blocks the page table's width, and the GPU
kernel's split-KV count the bucket (`default_num_kv_splits`), each of which changes a row's
sums: fixed, they are invariant; the defaults' differences are asserted too, so that the
property is known to be needed."""
import functools

import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.model.layers import Kernels
from xlaserve.pallas_kernels.ragged_paged_attention import kernel_cpu, kernel_gpu, kernel_tpu
from xlaserve.runtime.executor.kernels import deterministic_kernels

HQ, HKV, D, PAGE, PAGES_PER_SEQ, NUM_PAGES = 4, 2, 64, 16, 8, 64
KERNELS = {
    "cpu": kernel_cpu.ragged_paged_attention,
    # What --enable-deterministic-inference runs (kernels.deterministic_kernels): work items and
    # KV blocks of fixed sizes; on GPU one KV split and one path for every item (no one-token
    # items' own).
    "tpu, fixed": deterministic_kernels(Kernels(attention=functools.partial(
        kernel_tpu.ragged_paged_attention, interpret=True)), "tpu", interpret=True).attention,
    "gpu, fixed": deterministic_kernels(Kernels(attention=functools.partial(
        kernel_gpu.ragged_paged_attention, interpret=True)), "gpu", interpret=True).attention,
}


def _rows(n: int, seed: int):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n, h, D)).astype(np.float32) for h in (HQ, HKV, HKV)]


def _call(kernel, seqs, cache, tokens: int = 64, max_seqs: int = 8, width: int = PAGES_PER_SEQ):
    """`seqs`: (kv_len, (q, k, v) rows, first page); the bucket: `tokens` rows, `max_seqs`
    sequences, a page table `width` pages wide. Returns (each sequence's output rows, the
    cache)."""
    kv_lens = np.zeros(max_seqs, np.int32)
    pages = np.zeros((max_seqs, width), np.int32)
    cu = np.zeros(max_seqs + 1, np.int32)
    for i, (kv_len, rows, first_page) in enumerate(seqs):
        kv_lens[i] = kv_len
        pages[i] = np.arange(first_page, first_page + width)
        cu[i + 1:] = cu[i] + len(rows[0])
    q, k, v = (np.concatenate([rows[j] for _, rows, _ in seqs]) for j in range(3))
    pad = ((0, tokens - len(q)), (0, 0), (0, 0))
    out, cache = kernel(*(jnp.asarray(np.pad(x, pad)) for x in (q, k, v)), cache,
                        jnp.asarray(kv_lens), jnp.asarray(pages), jnp.asarray(cu),
                        jnp.asarray([len(seqs)], jnp.int32), sm_scale=0.125)[:2]
    out = np.asarray(out)
    return [out[cu[i]:cu[i + 1]] for i in range(len(seqs))], cache


@pytest.fixture(scope="module")
def cache():
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.standard_normal((NUM_PAGES, PAGE, 2 * HKV * D)).astype(np.float32))


@pytest.mark.parametrize("name", KERNELS)
def test_a_decode_row_is_the_same_beside_others_and_in_any_bucket(name, cache):
    kernel, row = KERNELS[name], _rows(1, 10)
    alone = _call(kernel, [(100, row, 0)], cache)[0][0]
    others = [(60 + 5 * i, _rows(n, 20 + i), 8 * (i + 1)) for i, n in enumerate((1, 1, 30, 5))]
    for count in range(1, len(others) + 1):
        assert np.array_equal(_call(kernel, [(100, row, 0)] + others[:count], cache)[0][0],
                              alone), count
    for tokens, max_seqs in ((16, 16), (256, 256)):
        assert np.array_equal(_call(kernel, [(100, row, 0)], cache, tokens, max_seqs)[0][0],
                              alone), (tokens, max_seqs)


@pytest.mark.parametrize("name", KERNELS)
def test_a_prompt_cut_into_chunks_gives_the_same_rows(name, cache):
    kernel, prompt = KERNELS[name], _rows(40, 30)
    whole = _call(kernel, [(40, prompt, 0)], cache)[0][0]
    for cut in (1, 16, 25, 39):
        first, filled = _call(kernel, [(cut, [x[:cut] for x in prompt], 0)], cache)
        second = _call(kernel, [(40, [x[cut:] for x in prompt], 0)], filled)[0][0]
        assert np.array_equal(np.concatenate([first[0], second]), whole), cut


@pytest.mark.parametrize("name", KERNELS)
def test_prompt_rows_are_the_same_in_any_bucket_and_page_table_width(name, cache):
    """A prompt's rows in steps of other token counts (the default work item follows the mean
    tokens per sequence) and page tables of other widths (a bucket: the default KV block is
    capped by it)."""
    kernel, prompt = KERNELS[name], _rows(21, 40)
    whole = _call(kernel, [(21, prompt, 0)], cache, 32, 4, width=2)[0][0]
    for tokens, max_seqs, width in ((64, 8, 8), (256, 64, 4)):
        assert np.array_equal(_call(kernel, [(21, prompt, 0)], cache, tokens, max_seqs,
                                    width)[0][0], whole), (tokens, max_seqs, width)
    first, filled = _call(kernel, [(7, [x[:7] for x in prompt], 0)], cache, 8, 4, width=1)
    second = _call(kernel, [(21, [x[7:] for x in prompt], 0)], filled, 16, 4, width=2)[0][0]
    assert np.array_equal(np.concatenate([first[0], second]), whole)


def test_the_tpu_kernels_default_blocks_follow_the_bucket(cache):
    """Interpreted, the TPU kernel's default work items and KV blocks change a prompt's rows
    between buckets: what `fixed_work_items` is for."""
    kernel, prompt = functools.partial(kernel_tpu.ragged_paged_attention, interpret=True), \
        _rows(21, 40)
    whole = _call(kernel, [(21, prompt, 0)], cache, 32, 4, width=2)[0][0]
    first, filled = _call(kernel, [(7, [x[:7] for x in prompt], 0)], cache, 8, 4, width=1)
    second = _call(kernel, [(21, [x[7:] for x in prompt], 0)], filled, 16, 4, width=2)[0][0]
    assert not np.array_equal(np.concatenate([first[0], second]), whole)


def test_the_gpu_kernels_default_splits_follow_the_bucket(cache):
    kernel = functools.partial(kernel_gpu.ragged_paged_attention, interpret=True)
    row = _rows(1, 10)
    small = _call(kernel, [(100, row, 0)], cache, 8, 8)[0][0]
    large = _call(kernel, [(100, row, 0)], cache, 256, 256)[0][0]
    assert kernel_gpu.default_num_kv_splits(1, HKV, PAGES_PER_SEQ) != \
        kernel_gpu.default_num_kv_splits(256, HKV, PAGES_PER_SEQ)
    assert not np.array_equal(small, large)
