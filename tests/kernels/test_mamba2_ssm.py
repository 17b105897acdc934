"""Mamba-2's selective scan over ragged batches and a state pool (pallas_kernels/mamba2/
reference.py, Nemotron-H's linear layers; issue 76) against a plain float64 NumPy recurrence on
random inputs: prefill and decode rows of several sequences in one step, each from its slot's
state (or zeros at a prompt's start) to its slot's new state; a prompt split over steps
continues from its slot; padding rows and other slots are left alone, and so is the slot of a
sequence that does not write (`writes` 0: a speculative verified row's)."""
import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.pallas_kernels.mamba2.reference import mamba2_ssm

H, P, N, G = 4, 3, 5, 2


def _inputs(length: int, seed: int):
    """x [L, H, P], dt > 0 [L, H], B, C [L, G, N] in float64."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((length, H, P))
    dt = np.log1p(np.exp(rng.standard_normal((length, H))))  # softplus
    b, c = (rng.standard_normal((length, G, N)) for _ in range(2))
    return x, dt, b, c


def _numpy_recurrence(x, dt, A, B, C, D, state):
    """Token by token, head by head: S <- exp(dt A) S + dt x B^T, y = S C + D x."""
    state, out = state.copy(), np.zeros_like(x)
    for t in range(len(x)):
        for h in range(H):
            g = h // (H // G)
            state[h] = np.exp(dt[t, h] * A[h]) * state[h] + dt[t, h] * np.outer(x[t, h], B[t, g])
            out[t, h] = state[h] @ C[t, g] + D[h] * x[t, h]
    return out, state


def test_prefill_and_decode_rows_match_the_float64_recurrence_state_in_and_out():
    rng = np.random.default_rng(7)
    A, D = -np.exp(rng.standard_normal(H)), rng.standard_normal(H)
    lengths, prefixes = (6, 1, 1, 9), (0, 12, 3, 4)  # a prompt, two decodes, a later chunk
    slots = np.array([2, 5, 1, 3], np.int32)
    sequences = [_inputs(n, seed) for seed, n in enumerate(lengths)]
    rows = 20
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    x, dt, b, c = (np.concatenate([s[i] for s in sequences]
                                  + [np.zeros((rows - cu[-1],) + sequences[0][i].shape[1:])])
                   for i in range(4))
    pool = rng.standard_normal((7, H, P, N))
    kv_lens = np.array([n + p for n, p in zip(lengths, prefixes)], np.int32)
    with jax.enable_x64(True):
        out, new_pool = mamba2_ssm(x, dt, A, b, c, D, jnp.asarray(pool), slots, kv_lens, cu,
                                   np.array([4], np.int32), np.array([1, 0, 1, 1], np.int32))
        out, new_pool = np.asarray(out), np.asarray(new_pool)
    assert out.dtype == np.float64
    for i, (sequence, prefix) in enumerate(zip(sequences, prefixes)):
        start = pool[slots[i]] if prefix else np.zeros((H, P, N))
        expected, final = _numpy_recurrence(*sequence[:2], A, *sequence[2:], D, start)
        np.testing.assert_allclose(out[cu[i]:cu[i + 1]], expected, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(new_pool[slots[i]], pool[slots[i]] if i == 1 else final,
                                   rtol=1e-12, atol=1e-12)
    assert not out[cu[-1]:].any()  # padding rows
    untouched = [s for s in range(7) if s not in slots]
    np.testing.assert_array_equal(new_pool[untouched], pool[untouched])


def test_a_prompt_split_over_steps_continues_from_its_slot_in_float32():
    rng = np.random.default_rng(3)
    A, D = -np.exp(rng.standard_normal(H)), rng.standard_normal(H)
    prompt = [a.astype(np.float32) for a in _inputs(11, 4)]
    pool = jnp.zeros((2, H, P, N), jnp.float32)

    def step(rows, pool, kv_len):
        x, dt, b, c = rows
        return mamba2_ssm(x, dt, A, b, c, D, pool, np.array([1], np.int32),
                          np.array([kv_len], np.int32), np.array([0, len(x)], np.int32),
                          np.array([1], np.int32))

    whole, whole_pool = step(prompt, pool, 11)
    first, pool = step([a[:4] for a in prompt], pool, 4)
    second, pool = step([a[4:] for a in prompt], pool, 11)
    np.testing.assert_allclose(np.concatenate([first, second]), whole, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(pool, whole_pool, rtol=1e-5, atol=1e-5)
    assert whole.dtype == np.float32 and whole_pool.dtype == np.float32
