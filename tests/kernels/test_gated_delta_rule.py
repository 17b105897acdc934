"""The gated delta rule and its causal convolution over ragged batches and a state pool
(pallas_kernels/linear_attention/reference.py, issue 76): per sequence, transformers' recurrent and
chunked forms (models/qwen3_next) with and without an initial state; a prompt split over steps
continues from its slot; the chunked form equals the recurrent one in float64 across chunk edges;
padding rows and other slots are left alone."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from xlaserve.pallas_kernels.linear_attention import reference

HK, HV, DK, DV, CONV, WIDTH = 2, 4, 8, 16, 12, 4


def _inputs(length: int, seed: int, dtype=np.float32):
    """q, k [L, Hk, Dk], v [L, Hv, Dv], g <= 0 and beta in (0, 1) [L, Hv]."""
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal((length, HK, DK)).astype(dtype) for _ in range(2))
    v = rng.standard_normal((length, HV, DV)).astype(dtype)
    g = -np.log1p(np.exp(rng.standard_normal((length, HV)))).astype(dtype)  # -softplus
    beta = (1 / (1 + np.exp(-rng.standard_normal((length, HV))))).astype(dtype)
    return q, k, v, g, beta


def _state(seed: int, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal((HV, DK, DV)).astype(dtype) * 0.3


def _ragged(sequences, rows: int):
    """Concatenated rows of `sequences` (each a tuple of per-token arrays), padded to `rows`,
    and cu_q_lens."""
    parts = list(zip(*sequences))
    cu = np.concatenate([[0], np.cumsum([len(s[0]) for s in sequences])]).astype(np.int32)
    padded = [np.concatenate(p + (np.zeros((rows - cu[-1],) + p[0].shape[1:], p[0].dtype),))
              for p in parts]
    return padded, cu


def _hf_recurrent(q, k, v, g, beta, state):
    t = lambda x: torch.from_numpy(np.asarray(x))[None]
    out, final = hf.torch_recurrent_gated_delta_rule(
        t(q), t(k), t(v), g=t(g), beta=t(beta),
        initial_state=None if state is None else t(state), output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    return out[0].numpy(), final[0].numpy()


def test_the_ragged_recurrent_form_is_transformers_per_sequence():
    lengths, slots = (5, 1, 9), np.array([3, 0, 5], np.int32)
    prefixes = (0, 7, 0)  # the second sequence decodes its 8th token from its slot's state
    sequences = [_inputs(n, seed) for seed, n in enumerate(lengths)]
    (q, k, v, g, beta), cu = _ragged(sequences, 20)
    pool = np.random.default_rng(9).standard_normal((6, HV, DK, DV)).astype(np.float32)
    pool[0] = _state(1)
    kv_lens = np.array([n + p for n, p in zip(lengths, prefixes)], np.int32)
    out, new_pool = reference.gated_delta_rule(
        q, k, v, g, beta, jnp.asarray(pool), slots, kv_lens, cu, jnp.array([3], jnp.int32))
    out, new_pool = np.asarray(out), np.asarray(new_pool)
    for i, (sequence, prefix) in enumerate(zip(sequences, prefixes)):
        expected, final = _hf_recurrent(*sequence, pool[slots[i]] if prefix else None)
        np.testing.assert_allclose(out[cu[i]:cu[i + 1]], expected, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(new_pool[slots[i]], final, rtol=1e-5, atol=1e-5)
    assert not out[cu[-1]:].any()  # padding rows
    untouched = [s for s in range(6) if s not in slots]
    np.testing.assert_array_equal(new_pool[untouched], pool[untouched])


def test_a_prompt_split_over_steps_continues_from_its_slot():
    prompt = _inputs(11, 4)
    pool = jnp.zeros((2, HV, DK, DV), jnp.float32)
    one = lambda rows, pool, kv_len: reference.gated_delta_rule(
        *rows, pool, jnp.array([1], jnp.int32), jnp.array([kv_len], jnp.int32),
        jnp.array([0, len(rows[0])], jnp.int32), jnp.array([1], jnp.int32))
    whole, whole_pool = one(prompt, pool, 11)
    first, pool = one([x[:4] for x in prompt], pool, 4)
    second, pool = one([x[4:] for x in prompt], pool, 11)
    np.testing.assert_allclose(np.concatenate([first, second]), whole, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(pool, whole_pool, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("length", [1, 15, 16, 17, 40])
def test_the_chunked_form_is_the_recurrent_form_in_float64(length):
    """Chunks of 16 tokens, the lengths on either side of a chunk's edge, from a state."""
    with jax.enable_x64(True):
        rows = [jnp.asarray(x) for x in _inputs(length, length, np.float64)]
        state = jnp.asarray(_state(2, np.float64))
        out, final = reference.chunked_gated_delta_rule(*rows, state, chunk_size=16)
        recurrent, pool = reference.gated_delta_rule(
            *rows, state[None], jnp.array([0], jnp.int32), jnp.array([length + 3], jnp.int32),
            jnp.array([0, length], jnp.int32), jnp.array([1], jnp.int32))
        assert out.dtype == jnp.float64
        np.testing.assert_allclose(out, recurrent, rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(final, pool[0], rtol=1e-10, atol=1e-10)


def test_the_chunked_form_is_transformers_chunked_form():
    rows, state = _inputs(70, 5), _state(3)
    out, final = reference.chunked_gated_delta_rule(*map(jnp.asarray, rows), jnp.asarray(state))
    t = lambda x: torch.from_numpy(np.asarray(x))[None]
    expected, expected_final = hf.torch_chunk_gated_delta_rule(
        *map(t, rows[:3]), g=t(rows[3]), beta=t(rows[4]), initial_state=t(state),
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    np.testing.assert_allclose(out, expected[0].numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(final, expected_final[0].numpy(), rtol=1e-4, atol=1e-4)


def test_the_ragged_convolution_is_transformers_with_its_window():
    """Two sequences: one whole prompt, one whose prompt comes in two steps (its window carried
    in its slot); each equals transformers' convolution of the whole sequence."""
    rng = np.random.default_rng(6)
    weight = rng.standard_normal((CONV, WIDTH)).astype(np.float32)
    bias = rng.standard_normal(CONV).astype(np.float32)
    a, b = (rng.standard_normal((n, CONV)).astype(np.float32) for n in (7, 10))
    pool = jnp.zeros((3, WIDTH - 1, CONV), jnp.float32)
    slots, seqs = jnp.array([2, 0], jnp.int32), jnp.array([2], jnp.int32)
    (x,), cu = _ragged([(a,), (b[:3],)], 12)
    first, pool = reference.causal_conv1d(x, weight, bias, pool, slots, jnp.array([7, 3]), cu,
                                          seqs)
    second, pool = reference.causal_conv1d(np.pad(b[3:], ((0, 5), (0, 0))), weight, bias, pool,
                                           slots[1:], jnp.array([10]), jnp.array([0, 7]),
                                           jnp.array([1], jnp.int32))
    expected = lambda x: hf.causal_conv1d_fn(torch.from_numpy(x.T[None]),
                                             torch.from_numpy(weight), torch.from_numpy(bias),
                                             activation="silu")[0].numpy().T
    np.testing.assert_allclose(first[:7], expected(a), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.concatenate([first[7:10], second[:7]]), expected(b),
                               rtol=1e-5, atol=1e-5)
    assert not np.asarray(second[7:]).any()
    np.testing.assert_array_equal(pool[0], b[-(WIDTH - 1):])  # its last inputs, oldest first
    np.testing.assert_array_equal(pool[2], a[-(WIDTH - 1):])


def test_a_sequence_that_does_not_write_leaves_its_slot_in_the_float32_reference():
    check_a_ragged_step(reference.gated_delta_rule, 32)


def test_the_cpu_kernel_is_the_reference_over_a_ragged_step():
    """kernel_cpu.py's native rule, jitted, against the float64 reference: a fresh prompt, a
    decode row that leaves its slot and a prompt's later chunk (both from their slots), padding
    rows and sequences; the other slots untouched."""
    from xlaserve.native.build import KernelUnavailable
    from xlaserve.pallas_kernels.linear_attention import kernel_cpu

    try:
        kernel_cpu.load()
    except KernelUnavailable as error:
        pytest.skip(f"the native kernel does not build here: {error}")
    check_a_ragged_step(kernel_cpu.gated_delta_rule, 32)


def check_a_ragged_step(rule, rows: int):
    """`rule` (reference.gated_delta_rule's contract), jitted, against the float64 reference over
    a step of `rows` rows: a fresh prompt, a decode row and a prompt's later chunk (both from
    their slots), padding rows and two padding sequences; the other slots untouched. The decode
    row does not write its slot (`writes` 0: a speculative verified row's), which keeps its
    state."""
    lengths = (9, 1, 17)
    sequences = [_inputs(n, seed + 20) for seed, n in enumerate(lengths)]
    (q, k, v, g, beta), cu = _ragged(sequences, rows)
    cu = np.concatenate([cu, [cu[-1]] * 2]).astype(np.int32)  # two padding sequences
    slots = np.array([3, 1, 5, 0, 0], np.int32)
    kv_lens = np.array([9, 14, 30, 0, 0], np.int32)
    pool = np.random.default_rng(8).standard_normal((6, HV, DK, DV)).astype(np.float32) * 0.3
    seqs = np.array([3], np.int32)
    writes = np.array([1, 0, 1, 1, 1], np.int32)
    out, new_pool = jax.jit(rule)(q, k, v, g, beta, jnp.asarray(pool), slots, kv_lens, cu, seqs,
                                  writes)
    with jax.enable_x64(True):
        want, want_pool = reference.gated_delta_rule(
            *(x.astype(np.float64) for x in (q, k, v, g, beta)), jnp.asarray(pool, jnp.float64),
            slots, kv_lens, cu, seqs)
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(new_pool)[[3, 5]], np.asarray(want_pool)[[3, 5]], rtol=2e-5,
                               atol=2e-5)
    assert not np.asarray(out)[cu[3]:].any()
    np.testing.assert_array_equal(np.asarray(new_pool)[[0, 1, 2, 4]], pool[[0, 1, 2, 4]])
