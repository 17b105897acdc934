"""An encoder's attention (issue 54): the new-token attentions with `causal=False`
(new_tokens.py), each token against its whole sequence, equal softmax attention computed per
sequence in numpy; the CPU's blocked form and the Pallas kernels (interpret mode) equal the
reference, on sequences that start, end and span blocks, beside padding."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.pallas_kernels.ragged_paged_attention import new_tokens

HEADS, KEY_DIM, VALUE_DIM, SCALE = 4, 48, 32, 0.2
CASES = [([40, 8, 16], 128), ([1] * 6 + [20], 128), ([30, 9], 48), ([100, 3, 1], 112)]


def make(lengths, tokens, seed=3, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q, k = (rng.normal(size=(tokens, HEADS, KEY_DIM)) for _ in "qk")
    v = rng.normal(size=(tokens, HEADS, VALUE_DIM))
    cu_q_lens = np.pad(np.cumsum([0] + lengths), (0, 1), mode="edge")  # a slot past the live
    return ([jnp.asarray(x, dtype) for x in (q, k, v)] +
            [jnp.asarray(cu_q_lens, jnp.int32), jnp.asarray([len(lengths)], jnp.int32)])


def numpy_attention(q, k, v, cu_q_lens, lengths):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    out = []
    for s in range(len(lengths)):
        rows = slice(int(cu_q_lens[s]), int(cu_q_lens[s + 1]))
        scores = np.einsum("qhd,khd->hqk", q[rows], k[rows]) * SCALE
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out.append(np.einsum("hqk,khd->qhd", probs, v[rows]))
    return np.concatenate(out)


@pytest.mark.parametrize("lengths,tokens", CASES)
def test_reference_sees_each_whole_sequence(lengths, tokens):
    q, k, v, cu_q_lens, num_seqs = make(lengths, tokens)
    out, _ = new_tokens.reference_new_token_attention(q, k, v, cu_q_lens, num_seqs,
                                                      sm_scale=SCALE, causal=False)
    live = sum(lengths)
    want = numpy_attention(q, k, v, np.asarray(cu_q_lens), lengths)
    np.testing.assert_allclose(np.asarray(out[:live]), want, rtol=1e-5, atol=1e-5)
    causal, _ = new_tokens.reference_new_token_attention(q, k, v, cu_q_lens, num_seqs,
                                                         sm_scale=SCALE)
    assert not np.allclose(np.asarray(causal[:live]), want, atol=1e-3)  # the mask is off


@pytest.mark.parametrize("lengths,tokens", CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cpu_blocked_equals_the_reference(lengths, tokens, dtype):
    q, k, v, cu_q_lens, num_seqs = make(lengths, tokens, dtype=dtype)
    want, want_lse = new_tokens.reference_new_token_attention(q, k, v, cu_q_lens, num_seqs,
                                                              sm_scale=SCALE, causal=False)
    blocked = jax.jit(functools.partial(new_tokens.blocked_new_token_attention, block=16,
                                        causal=False), static_argnames="sm_scale")
    out, lse = blocked(q, k, v, cu_q_lens, num_seqs, sm_scale=SCALE)
    live = sum(lengths)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(out[:live]), np.asarray(want[:live]), rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(lse[:live]), np.asarray(want_lse[:live]), rtol=1e-5,
                               atol=1e-5 if dtype == jnp.float32 else 1e-2)
    assert np.all(np.isfinite(np.asarray(out)))


@pytest.mark.parametrize("lengths,tokens", CASES[:3])
@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_pallas_kernels_equal_the_reference(lengths, tokens, platform):
    q, k, v, cu_q_lens, num_seqs = make(lengths, tokens)
    want, _ = new_tokens.reference_new_token_attention(q, k, v, cu_q_lens, num_seqs,
                                                       sm_scale=SCALE, causal=False)
    if platform == "gpu":
        out, _ = new_tokens.gpu_new_token_attention(q, k, v, cu_q_lens, num_seqs, sm_scale=SCALE,
                                                    causal=False, interpret=True, block_q=32,
                                                    block_k=32)
    else:
        out, _ = new_tokens.tpu_new_token_attention(q, k, v, cu_q_lens, num_seqs, sm_scale=SCALE,
                                                    causal=False, interpret=True, block=128)
    live = sum(lengths)
    np.testing.assert_allclose(np.asarray(out[:live]), np.asarray(want[:live]), rtol=1e-4,
                               atol=1e-4)


def numpy_window_attention(q, k, v, cu_q_lens, lengths, window):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    out = []
    for s in range(len(lengths)):
        rows = slice(int(cu_q_lens[s]), int(cu_q_lens[s + 1]))
        scores = np.einsum("qhd,khd->hqk", q[rows], k[rows]) * SCALE
        distance = np.abs(np.arange(lengths[s])[:, None] - np.arange(lengths[s])[None, :])
        scores = np.where(distance <= window, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out.append(np.einsum("hqk,khd->qhd", probs, v[rows]))
    return np.concatenate(out)


@pytest.mark.parametrize("lengths,tokens", CASES)
@pytest.mark.parametrize("window", [3, 20])
def test_a_window_limits_each_token_to_its_neighbours(lengths, tokens, window):
    """ModernBERT's local layers: keys at most `window` away on either side, in every form."""
    q, k, v, cu_q_lens, num_seqs = make(lengths, tokens)
    want = numpy_window_attention(q, k, v, np.asarray(cu_q_lens), lengths, window)
    live = sum(lengths)
    forms = {"reference": new_tokens.reference_new_token_attention,
             "blocked": functools.partial(new_tokens.blocked_new_token_attention, block=16),
             "gpu": new_tokens.gpu_new_token_attention}  # the blocked form's, with a window
    for name, form in forms.items():
        out, _ = jax.jit(functools.partial(form, causal=False, window=window),
                         static_argnames="sm_scale")(q, k, v, cu_q_lens, num_seqs, sm_scale=SCALE)
        np.testing.assert_allclose(np.asarray(out[:live]), want, rtol=1e-5, atol=1e-5,
                                   err_msg=name)
    tpu, _ = new_tokens.tpu_new_token_attention(q, k, v, cu_q_lens, num_seqs, sm_scale=SCALE,
                                                causal=False, window=window, interpret=True,
                                                block=128)
    np.testing.assert_allclose(np.asarray(tpu[:live]), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("lengths,tokens", CASES)
@pytest.mark.parametrize("window", [0, 3, 20])
def test_the_cpu_kernel_equals_numpy(lengths, tokens, window):
    """bidirectional_cpu.cc: whole sequences and windows, sequences of 1 to 100 tokens beside
    padding rows (left 0)."""
    from xlaserve.native.build import KernelUnavailable
    from xlaserve.pallas_kernels.ragged_paged_attention import bidirectional_cpu

    try:
        bidirectional_cpu.load()
    except KernelUnavailable as error:  # no compiler here
        pytest.skip(str(error))
    q, k, v, cu_q_lens, num_seqs = make(lengths, tokens)
    v = k * 0.5 + 1.0  # one width for q, k and v, as an encoder's heads have
    live = sum(lengths)
    want = (numpy_window_attention(q, k, v, np.asarray(cu_q_lens), lengths, window) if window
            else numpy_attention(q, k, v, np.asarray(cu_q_lens), lengths))
    out, _ = jax.jit(functools.partial(bidirectional_cpu.bidirectional_attention, window=window),
                     static_argnames="sm_scale")(q, k, v, cu_q_lens, num_seqs, sm_scale=SCALE)
    np.testing.assert_allclose(np.asarray(out[:live]), want, rtol=1e-5, atol=1e-5)
    assert not np.asarray(out[live:]).any()
