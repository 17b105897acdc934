"""The jnp ragged paged attention against a dense numpy attention, one Python loop per sequence.

Every case poisons what the function must not read: pages no live sequence uses are NaN, page-table
slots past a sequence's needed pages point at NaN pages, slots past kv_len inside a used page are
NaN, padding tokens of q/k/v are NaN, and padding rows of kv_lens / page_indices / cu_q_lens hold
garbage. Pages are handed out in shuffled order. Shapes are shared within groups so that the
default run compiles few programs.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.pallas_kernels.ragged_paged_attention import cases
from xlaserve.pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention

STATIC = ("sm_scale", "sliding_window", "soft_cap", "q_block", "kv_block_pages", "attention_chunk")
attention = jax.jit(ragged_paged_attention, static_argnames=STATIC)

HEAD_DIM = 32
NUM_Q_HEADS = 8
SM_SCALE = 1.0 / math.sqrt(HEAD_DIM)


def make_case(rng, seqs, *, num_q_heads=NUM_Q_HEADS, head_dim=HEAD_DIM, **shapes):
    return cases.make_case(rng, seqs, num_q_heads=num_q_heads, head_dim=head_dim, **shapes)


def expected_result(case, sliding_window=None, soft_cap=None, sinks=None, attention_chunk=None):
    """Dense attention in float64 over each sequence's full K/V; the cache after the writes.
    Attention sinks join each head's softmax as one more column, dropped after it (gpt-oss);
    an attention chunk C keeps the keys with key // C == query // C (Llama 4)."""
    q = case["q"].astype(np.float64)
    num_kv_heads = case["k"].shape[1]
    group = q.shape[1] // num_kv_heads
    page_size = case["kv_cache"].shape[1]
    cache = case["kv_cache"].astype(np.float32)
    new_kv = np.stack([case["k"], case["v"]], axis=2).reshape(len(q), 2 * num_kv_heads, -1)
    new_kv = new_kv.astype(case["kv_cache"].dtype).astype(np.float32)  # what the cache can hold
    out = np.zeros_like(q)
    cu, pages = case["cu_q_lens"], case["page_indices"]
    for s in range(int(case["num_seqs"][0])):
        q_len, kv_len = int(cu[s + 1] - cu[s]), int(case["kv_lens"][s])
        for r in range(q_len):
            pos = kv_len - q_len + r
            cache[pages[s, pos // page_size], pos % page_size] = new_kv[cu[s] + r]
        positions = np.arange(kv_len)
        kv = cache[pages[s, positions // page_size], positions % page_size].astype(np.float64)
        keys = np.repeat(kv[:, 0::2], group, axis=1)  # [kv_len, Hq, D]
        values = np.repeat(kv[:, 1::2], group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q[cu[s]:cu[s + 1]], keys) * SM_SCALE
        if soft_cap is not None:
            scores = soft_cap * np.tanh(scores / soft_cap)
        q_pos = kv_len - q_len + np.arange(q_len)
        mask = positions[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            mask &= q_pos[:, None] - positions[None, :] < sliding_window
        if attention_chunk is not None:
            mask &= positions[None, :] // attention_chunk == q_pos[:, None] // attention_chunk
        scores = np.where(mask, scores, -np.inf)
        if sinks is not None:  # [Hq] -> a column [Hq, q_len, 1]
            sink_column = np.broadcast_to(np.asarray(sinks, np.float64)[:, None, None],
                                          scores.shape[:2] + (1,))
            scores = np.concatenate([scores, sink_column], axis=-1)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        probs = probs[..., :kv_len]  # without the sink's column, which has no value
        out[cu[s]:cu[s + 1]] = np.einsum("hqk,khd->qhd", probs, values)
    return out, cache


def check(case, tol=1e-5, sinks=None, **static):
    """Runs the jitted reference and compares output rows and the whole cache."""
    out, new_cache = attention(**{k: jnp.asarray(v) for k, v in case.items()},
                               sm_scale=SM_SCALE, sinks=sinks, **static)
    out, new_cache = np.asarray(out.astype(jnp.float32)), np.asarray(new_cache.astype(jnp.float32))
    assert out.dtype == np.float32 and new_cache.shape == case["kv_cache"].shape
    want_out, want_cache = expected_result(case, static.get("sliding_window"),
                                           static.get("soft_cap"), sinks,
                                           static.get("attention_chunk"))
    total = int(case["cu_q_lens"][case["num_seqs"][0]])
    np.testing.assert_allclose(out[:total], want_out[:total], rtol=tol, atol=tol)
    assert np.all(np.isfinite(out[total:])), "padding rows must be finite"
    np.testing.assert_array_equal(new_cache, want_cache)


def random_sequences(rng, max_seqs, num_tokens, pages_per_seq, page_size, max_q_len=None):
    """Random (q_len, kv_len) pairs within `num_tokens` new tokens, half of them decodes, and a
    page pool a few pages larger than they need. Returns (seqs, num_pages)."""
    seqs, budget = [], num_tokens
    for _ in range(int(rng.integers(1, max_seqs + 1))):
        if budget == 0:
            break
        kv_len = int(rng.integers(1, pages_per_seq * page_size + 1))
        longest = min(kv_len, budget, max_q_len or budget)
        q_len = int(rng.integers(1, longest + 1)) if rng.random() < 0.5 else 1
        seqs.append((q_len, kv_len))
        budget -= q_len
    num_pages = sum(-(-kv // page_size) for _, kv in seqs) + int(rng.integers(1, 8))
    return seqs, num_pages


def random_kernel_case(rng):
    """A random ragged batch at a kernel's production shapes: page sizes 16 to 64, kv lengths up
    to 2048, q lengths up to 300, 1 to 16 sequences, GQA 1 to 8, head dims 64 and 128, a quarter
    bfloat16, some with sliding window, soft cap or sinks. Returns (case, options, tolerance)."""
    page_size = int(rng.choice([16, 32, 64]))
    pages_per_seq = int(rng.integers(1, 2048 // page_size + 1))
    max_seqs = int(rng.choice([1, 4, 16]))
    num_tokens = int(rng.choice([16, 64, 320]))
    num_kv_heads = int(rng.choice([1, 2, 4, 8]))
    head_dim = int(rng.choice([64, 128]))
    seqs, num_pages = random_sequences(rng, max_seqs, num_tokens, pages_per_seq, page_size,
                                       max_q_len=300)
    dtype = jnp.bfloat16 if rng.random() < 0.25 else np.float32
    case = make_case(rng, seqs, max_seqs=max_seqs, num_tokens=num_tokens, page_size=page_size,
                     pages_per_seq=pages_per_seq, num_pages=num_pages, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, dtype=dtype)
    static = dict(sliding_window=int(rng.integers(1, 300)) if rng.random() < 0.3 else None,
                  soft_cap=float(rng.uniform(1, 30)) if rng.random() < 0.3 else None)
    static["sinks"] = random_sinks(rng, NUM_Q_HEADS)
    static["attention_chunk"] = random_chunk(rng, static["sliding_window"])
    return case, static, 2e-2 if dtype == jnp.bfloat16 else 2e-5


def random_chunk(rng, sliding_window):
    """An attention chunk of 1 to 600 for a third of the random cases without a window, else None
    (drawn last, so that the cases without one are those the seeds gave before chunks)."""
    return int(rng.integers(1, 600)) if sliding_window is None and rng.random() < 0.3 else None


def random_sinks(rng, num_q_heads):
    """Attention sinks for a third of the random cases, else None (drawn after everything else,
    so that the cases without them are those the seeds gave before sinks)."""
    return jnp.asarray(cases.make_sinks(rng, num_q_heads)) if rng.random() < 0.3 else None


# Batch kinds, each with its own fixed shapes so that every GQA ratio compiles once per kind.
DECODE_SHAPES = dict(max_seqs=8, num_tokens=8, page_size=16, pages_per_seq=8, num_pages=64)
RAGGED_SHAPES = dict(max_seqs=8, num_tokens=32, page_size=16, pages_per_seq=8, num_pages=64)
BATCHES = {
    # kv_len 16 / 32 / 128 are exact multiples of the page size, 17 / 33 one past.
    "decode": (DECODE_SHAPES, [(1, 17), (1, 16), (1, 128), (1, 1), (1, 33), (1, 100)]),
    "prefill": (RAGGED_SHAPES, [(10, 10), (5, 5), (1, 1), (16, 16)]),
    "mixed": (RAGGED_SHAPES, [(1, 17), (8, 40), (1, 128), (12, 12), (3, 16), (1, 33), (1, 2)]),
    "zero_history_chunk_of_1": (RAGGED_SHAPES, [(1, 1)] * 7),
    "one_sequence": (RAGGED_SHAPES, [(30, 100)]),
    "no_padding": (RAGGED_SHAPES, [(4, kv) for kv in (20, 4, 64, 9, 4, 50, 4, 7)]),
}


@pytest.mark.parametrize("num_kv_heads", [8, 4, 2, 1], ids=lambda h: f"gqa{NUM_Q_HEADS // h}")
@pytest.mark.parametrize("batch", list(BATCHES))
def test_matches_dense_attention_and_writes_cache_for_batch_kind(batch, num_kv_heads):
    shapes, seqs = BATCHES[batch]
    check(make_case(np.random.default_rng(0), seqs, num_kv_heads=num_kv_heads, **shapes))


@pytest.mark.parametrize("page_size,pages_per_seq,num_pages",
                         [(1, 128, 160), (16, 8, 48), (64, 2, 12)])
def test_page_sizes_with_lengths_on_and_one_past_page_boundaries(page_size, pages_per_seq,
                                                                 num_pages):
    ps, full = page_size, page_size * pages_per_seq
    lengths = [(1, ps), (3, ps + 1), (2, 2 * ps), (5, min(2 * ps + 1, full)), (4, 4), (1, full)]
    seqs = [(min(q_len, kv_len), kv_len) for q_len, kv_len in lengths]
    case = make_case(np.random.default_rng(1), seqs, max_seqs=8, num_tokens=32, page_size=ps,
                     pages_per_seq=pages_per_seq, num_pages=num_pages, num_kv_heads=2)
    check(case)


@pytest.mark.parametrize("static", [dict(sliding_window=5), dict(sliding_window=20),
                                    dict(soft_cap=2.0), dict(sliding_window=7, soft_cap=3.0)],
                         ids=["window5", "window20", "softcap", "window_and_softcap"])
def test_sliding_window_and_soft_cap(static):
    shapes, seqs = BATCHES["mixed"]
    check(make_case(np.random.default_rng(2), seqs, num_kv_heads=4, **shapes), **static)


LONG_AND_SHORT = [(1, 128), (6, 9), (1, 20), (12, 40), (1, 3)]
SHORT_ONLY = [(1, 30), (6, 9), (1, 20), (12, 40), (1, 3)]  # 3 chunks of 1 page out of 8 needed


@pytest.mark.parametrize("seqs", [LONG_AND_SHORT, SHORT_ONLY], ids=["long_and_short", "short_only"])
@pytest.mark.parametrize("kv_block_pages", [1, 3])
def test_several_kv_chunks_with_online_softmax(seqs, kv_block_pages):
    case = make_case(np.random.default_rng(3), seqs, num_kv_heads=2, **RAGGED_SHAPES)
    check(case, kv_block_pages=kv_block_pages)


@pytest.mark.parametrize("seqs", [LONG_AND_SHORT, [(1, 128), (4, 100), (1, 60), (9, 70)]],
                         ids=["from_first_chunk", "all_windows_past_three_chunks"])
def test_several_kv_chunks_with_sliding_window_skipping_whole_chunks(seqs):
    case = make_case(np.random.default_rng(4), seqs, num_kv_heads=2, **RAGGED_SHAPES)
    check(case, kv_block_pages=1, sliding_window=10, soft_cap=5.0)


# Llama 4's chunked attention: decodes far past the first chunk (positions 100 and 127), one at
# a chunk's first position (32: itself alone), prefill chunks across a chunk boundary (positions
# 28..39 across 32, 12..19 across 16; across 24 and 36 for a chunk of 12).
CHUNKED = [(1, 101), (12, 40), (1, 128), (1, 33), (8, 20), (1, 2)]
CHUNK_STATICS = [dict(attention_chunk=16), dict(attention_chunk=12, kv_block_pages=1),
                 dict(attention_chunk=12, q_block=4, soft_cap=5.0)]
CHUNK_IDS = ["chunk16", "chunk12_skipping_kv_blocks", "chunk12_q_block4_softcap"]


@pytest.mark.parametrize("static", CHUNK_STATICS, ids=CHUNK_IDS)
def test_attention_chunks_see_their_own_chunk_alone(static):
    check(make_case(np.random.default_rng(13), CHUNKED, num_kv_heads=2, **RAGGED_SHAPES), **static)


def test_a_window_and_a_chunk_on_one_layer_are_refused():
    shapes, seqs = BATCHES["decode"]
    case = make_case(np.random.default_rng(12), seqs, num_kv_heads=2, **shapes)
    with pytest.raises(ValueError, match="sliding window .4. and an attention chunk .8."):
        attention(**{k: jnp.asarray(v) for k, v in case.items()}, sm_scale=SM_SCALE,
                  sliding_window=4, attention_chunk=8)


def poisoned_before_chunks(case, chunk):
    """`case` with every page before each live sequence's last chunk NaN (`chunk` a multiple of
    the page size): a kernel that reads only from the chunk start of a decode sees none of it."""
    case = {k: np.array(v) for k, v in case.items()}
    page_size = case["kv_cache"].shape[1]
    for s in range(int(case["num_seqs"][0])):
        pos = int(case["kv_lens"][s]) - 1
        for page in case["page_indices"][s, :(pos - pos % chunk) // page_size]:
            case["kv_cache"][page] = np.nan
    return case


@pytest.mark.parametrize("q_block", [1, 3, 4, 16, 32, None])
def test_query_block_sizes_including_ones_that_straddle_sequences(q_block):
    shapes, seqs = BATCHES["mixed"]
    check(make_case(np.random.default_rng(5), seqs, num_kv_heads=2, **shapes), q_block=q_block)


@pytest.mark.parametrize("batch", ["decode", "mixed"])
def test_bfloat16_inputs_and_cache(batch):
    shapes, seqs = BATCHES[batch]
    case = make_case(np.random.default_rng(6), seqs, num_kv_heads=2, dtype=jnp.bfloat16, **shapes)
    out, new_cache = attention(**{k: jnp.asarray(v) for k, v in case.items()}, sm_scale=SM_SCALE)
    assert out.dtype == jnp.bfloat16 and new_cache.dtype == jnp.bfloat16
    check(case, tol=2e-2)


@pytest.mark.parametrize("q_block,q_lens", [(16, [3, 4, 4, 4, 4, 4, 4, 5]),
                                             (4, [1, 4, 4, 4, 4, 4, 4, 7]),
                                             (1, [4] * 8)])
def test_work_item_count_reaching_its_static_bound(q_block, q_lens):
    # Every sequence boundary falls inside a block, so the items fill all
    # min(num_blocks * q_block, num_blocks + S - 1) slots.
    seqs = [(q_len, q_len + 3 * s) for s, q_len in enumerate(q_lens)]
    case = make_case(np.random.default_rng(10), seqs, num_kv_heads=2, **RAGGED_SHAPES)
    check(case, q_block=q_block)


@pytest.mark.parametrize("dtype,static", [
    (np.float32, {}), (np.float32, dict(sliding_window=7)),
    (np.float32, dict(sliding_window=10, kv_block_pages=1, q_block=4)),
    (jnp.bfloat16, dict(sliding_window=7))],
    ids=["float32", "float32_window", "float32_window_skipping_chunks", "bfloat16_window"])
def test_attention_sinks_join_each_heads_softmax_denominator(dtype, static):
    # GQA 4, decodes beside prefills; with one-page chunks a window skips whole chunks, and
    # every live row's first chunk is then one it attends after the sink.
    seqs = LONG_AND_SHORT + [(1, 100), (9, 70)]
    rng = np.random.default_rng(11)
    case = make_case(rng, seqs, num_kv_heads=2, dtype=dtype, **RAGGED_SHAPES)
    check(case, tol=2e-2 if dtype == jnp.bfloat16 else 1e-5,
          sinks=cases.make_sinks(rng, NUM_Q_HEADS), **static)


def test_sinks_not_floats_one_per_query_head_are_refused():
    shapes, seqs = BATCHES["decode"]
    case = make_case(np.random.default_rng(12), seqs, num_kv_heads=2, **shapes)
    with pytest.raises(ValueError, match=r"one per query head, \[8\]; got float32\[2\]"):
        attention(**{k: jnp.asarray(v) for k, v in case.items()}, sm_scale=SM_SCALE,
                  sinks=jnp.zeros(2, jnp.float32))
    with pytest.raises(ValueError, match=r"must be floats.*; got int32\[8\]"):
        attention(**{k: jnp.asarray(v) for k, v in case.items()}, sm_scale=SM_SCALE,
                  sinks=jnp.zeros(8, jnp.int32))


def test_live_sequence_without_new_tokens_is_skipped():
    shapes, _ = BATCHES["mixed"]
    seqs = [(3, 10), (0, 20), (0, 5), (16, 16), (0, 7), (2, 9)]
    for q_block in (4, 16):  # 16: few item slots, which empty sequences must not use up
        check(make_case(np.random.default_rng(7), seqs, num_kv_heads=2, **shapes), q_block=q_block)


def test_no_live_sequences_leaves_cache_unchanged():
    shapes, _ = BATCHES["mixed"]
    case = make_case(np.random.default_rng(8), [], num_kv_heads=2, **shapes)
    check(case)


def test_traced_program_does_not_loop_over_sequences():
    def num_equations(max_seqs, num_tokens):
        case = make_case(np.random.default_rng(9), [(1, 5)], max_seqs=max_seqs,
                         num_tokens=num_tokens, page_size=16, pages_per_seq=4, num_pages=8,
                         num_kv_heads=2)
        fn = lambda *a: ragged_paged_attention(*a, sm_scale=1.0, q_block=2, kv_block_pages=1)
        return len(jax.make_jaxpr(fn)(*case.values()).eqns)

    assert num_equations(2, 4) == num_equations(64, 128)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(40))
def test_random_batches_match_dense_attention(seed):
    rng = np.random.default_rng(100 + seed)
    page_size = int(rng.choice([1, 4, 16, 64]))
    pages_per_seq = int(rng.integers(1, 513 // page_size + 1))
    max_seqs = int(rng.choice([1, 4, 16]))
    num_tokens = int(rng.choice([16, 64, 256]))
    num_kv_heads = int(rng.choice([1, 2, 4, 8]))
    seqs, num_pages = random_sequences(rng, max_seqs, num_tokens, pages_per_seq, page_size)
    dtype = jnp.bfloat16 if rng.random() < 0.25 else np.float32
    case = make_case(rng, seqs, max_seqs=max_seqs, num_tokens=num_tokens, page_size=page_size,
                     pages_per_seq=pages_per_seq, num_pages=num_pages, num_kv_heads=num_kv_heads,
                     dtype=dtype)
    static = dict(
        sliding_window=int(rng.integers(1, 300)) if rng.random() < 0.3 else None,
        soft_cap=float(rng.uniform(1, 30)) if rng.random() < 0.3 else None,
        q_block=int(rng.choice([1, 2, 8, 32])) if rng.random() < 0.5 else None,
        kv_block_pages=int(rng.integers(1, pages_per_seq + 1)) if rng.random() < 0.5 else None)
    sinks = random_sinks(rng, NUM_Q_HEADS)
    check(case, tol=2e-2 if dtype == jnp.bfloat16 else 2e-5, sinks=sinks,
          attention_chunk=random_chunk(rng, static["sliding_window"]), **static)
