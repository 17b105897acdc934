"""Batch invariance of the ragged paged attention kernels (issue 75, deterministic inference): a
sequence's output rows are the same bits whatever other sequences share the call, whatever the
bucket's padded shape, and wherever its prompt was cut into chunks: the CPU kernel, and the TPU
and GPU Pallas kernels in interpret mode. The GPU kernel's split-KV count follows the bucket by
default (`default_num_kv_splits`), which changes a row's sums: fixed, it is invariant; the
default's difference is asserted too, so that the property is known to be needed."""
import functools

import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.pallas_kernels.ragged_paged_attention import kernel_cpu, kernel_gpu, kernel_tpu

HQ, HKV, D, PAGE, PAGES_PER_SEQ, NUM_PAGES = 4, 2, 64, 16, 8, 64
KERNELS = {
    "cpu": kernel_cpu.ragged_paged_attention,
    "tpu": functools.partial(kernel_tpu.ragged_paged_attention, interpret=True),
    # One KV split and one path for every item (no one-token items' own): what the GPU kernel
    # takes for rows independent of the bucket.
    "gpu, fixed": functools.partial(kernel_gpu.ragged_paged_attention, interpret=True,
                                    num_kv_splits=1, decode_io_in_kernel=False),
}


def _rows(n: int, seed: int):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n, h, D)).astype(np.float32) for h in (HQ, HKV, HKV)]


def _call(kernel, seqs, cache, tokens: int = 64, max_seqs: int = 8):
    """`seqs`: (kv_len, (q, k, v) rows, first page); the bucket: `tokens` rows, `max_seqs`
    sequences. Returns (each sequence's output rows, the cache)."""
    kv_lens = np.zeros(max_seqs, np.int32)
    pages = np.zeros((max_seqs, PAGES_PER_SEQ), np.int32)
    cu = np.zeros(max_seqs + 1, np.int32)
    for i, (kv_len, rows, first_page) in enumerate(seqs):
        kv_lens[i] = kv_len
        pages[i] = np.arange(first_page, first_page + PAGES_PER_SEQ)
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


def test_the_gpu_kernels_default_splits_follow_the_bucket(cache):
    kernel = functools.partial(kernel_gpu.ragged_paged_attention, interpret=True)
    row = _rows(1, 10)
    small = _call(kernel, [(100, row, 0)], cache, 8, 8)[0][0]
    large = _call(kernel, [(100, row, 0)], cache, 256, 256)[0][0]
    assert kernel_gpu.default_num_kv_splits(1, HKV, PAGES_PER_SEQ) != \
        kernel_gpu.default_num_kv_splits(256, HKV, PAGES_PER_SEQ)
    assert not np.array_equal(small, large)
