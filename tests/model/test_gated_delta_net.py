"""Gated DeltaNet (model/linear_attention.py, issue 76), the linear layer of Qwen3-Next and
Qwen3.5, against transformers' `Qwen3NextGatedDeltaNet` on random weights: its output for whole
prompts, for two prompts in one ragged step, for a prompt over two steps and a decoded token
after it (the state carried in the request's slots); a speculative verified row, its slot kept and
then advanced by its accepted tokens alone (commit_accepted), as running those tokens; its
checkpoint tensors (Qwen3-Next's grouped
projections) read into the module's layout by weights/linear_attention_layout.py."""
import types

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from xlaserve.model.config.linear_attention_config import LinearAttentionConfig
from xlaserve.model.layers import Kernels
from xlaserve.model.linear_attention import (GatedDeltaNet, VerifiedRows, commit_accepted,
                                             empty_state)
from xlaserve.weights.linear_attention_layout import gated_delta_net_weights
from xlaserve.model.transformer import AttentionMetadata

SHAPES = dict(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=8, linear_value_head_dim=16, linear_conv_kernel_dim=4)


@pytest.fixture(scope="module")
def layers():
    """(transformers' layer, ours with its weights)."""
    torch.manual_seed(0)
    hf_config = Qwen3NextConfig(num_hidden_layers=1, layer_types=["linear_attention"],
                                rms_norm_eps=1e-6, **SHAPES)
    theirs = Qwen3NextGatedDeltaNet(hf_config, layer_idx=0).eval()
    with torch.no_grad():
        for parameter in theirs.parameters():
            parameter.normal_(0, 0.3)
        theirs.A_log.uniform_(-1, 1)
    config = LinearAttentionConfig(
        hidden_size=32, num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=16,
        conv_width=4, rms_norm_eps=1e-6)
    ours = GatedDeltaNet(config, jnp.float32, nnx.Rngs(0))
    tensors = {name: tensor.detach().numpy() for name, tensor in theirs.state_dict().items()}

    def fetch(name, shape):
        assert tensors[name].shape == shape, name
        return tensors[name]

    model = types.SimpleNamespace(architecture="Qwen3NextForCausalLM", linear_attention=config)
    for (name,), value in gated_delta_net_weights(fetch, model, "", ()):
        assert getattr(ours, name)[...].shape == value.shape, name
        setattr(ours, name, nnx.Param(jnp.asarray(value)))
    return theirs, ours


def _theirs(layer, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return layer(torch.from_numpy(x)[None])[0].numpy()


def _step(ours, state, rows, slots, kv_lens, total_rows: int = 32, verified=None):
    """One ragged step over `rows` (a list of [n, hidden] arrays, one per sequence); `verified`:
    its VerifiedRows (a speculative step's), or None."""
    cu = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int32)
    x = np.zeros((total_rows, SHAPES["hidden_size"]), np.float32)
    x[:cu[-1]] = np.concatenate(rows)
    metadata = AttentionMetadata(
        kv_lens=jnp.asarray(kv_lens, jnp.int32), page_indices=jnp.zeros((len(rows), 1), jnp.int32),
        cu_q_lens=jnp.asarray(cu), num_seqs=jnp.asarray([len(rows)], jnp.int32),
        state_slots=jnp.asarray(slots, jnp.int32), verified_rows=verified)
    y, state = ours(jnp.asarray(x), None, None, state, metadata, Kernels(attention=None))
    return [np.asarray(y)[cu[i]:cu[i + 1]] for i in range(len(rows))], state


def test_prompts_in_one_ragged_step_give_transformers_outputs(layers):
    theirs, ours = layers
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal((n, 32)).astype(np.float32) for n in (9, 20))
    state = empty_state(ours.config, 4)
    (ya, yb), _ = _step(ours, state, [a, b], [1, 3], [9, 20])
    np.testing.assert_allclose(ya, _theirs(theirs, a), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(yb, _theirs(theirs, b), rtol=1e-4, atol=1e-4)


def test_a_prompt_over_two_steps_then_a_decoded_token_carry_the_state(layers):
    theirs, ours = layers
    prompt = np.random.default_rng(2).standard_normal((14, 32)).astype(np.float32)
    state = empty_state(ours.config, 2)
    (first,), state = _step(ours, state, [prompt[:6]], [1], [6])
    (second,), state = _step(ours, state, [prompt[6:13]], [1], [13])
    (decoded,), state = _step(ours, state, [prompt[13:]], [1], [14])
    expected = _theirs(theirs, prompt)
    np.testing.assert_allclose(np.concatenate([first, second, decoded]), expected, rtol=1e-4,
                               atol=1e-4)
    assert not np.asarray(state.delta[0]).any() and not np.asarray(state.conv[0]).any()


@pytest.mark.parametrize("accepted", [0, 2, 3])
def test_a_verified_row_keeps_its_slot_and_commits_its_accepted_tokens_alone(layers, accepted):
    """A prompt's later row `[t, d1, d2, d3]` beside a plain prompt chunk, as a speculative step
    runs it: its outputs are the plain run's, its slot keeps the state before it (the chunk's
    is written), and commit_accepted of its first 1 + `accepted` tokens gives the state (window
    and rule) of running those tokens alone."""
    _, ours = layers
    rng = np.random.default_rng(3)
    prompt, other = (rng.standard_normal((n, 32)).astype(np.float32) for n in (10, 5))
    state = empty_state(ours.config, 4)
    _, state = _step(ours, state, [prompt[:6], other[:2]], [1, 2], [6, 2])
    row = prompt[6:]
    verified = VerifiedRows(writes=jnp.asarray([0, 1], jnp.int32),
                            rows=jnp.asarray([[0, 1, 2, 3], [4, 5, 6, 7]], jnp.int32))
    (spec_out, _), pending = _step(ours, state, [row, other[2:]], [1, 2], [10, 5],
                                   verified=verified)
    (plain_out, _), plain = _step(ours, state, [row, other[2:]], [1, 2], [10, 5])
    np.testing.assert_allclose(spec_out, plain_out, rtol=1e-5, atol=1e-5)
    for pool in ("conv", "delta"):
        np.testing.assert_array_equal(getattr(pending, pool)[1], getattr(state, pool)[1])
        np.testing.assert_array_equal(getattr(pending, pool)[2], getattr(plain, pool)[2])
    kept = 1 + accepted
    committed = commit_accepted(pending, jnp.asarray([kept, 3], jnp.int32),
                                jnp.asarray([1, 2], jnp.int32), jnp.asarray([True, False]))
    assert committed.pending is None
    _, alone = _step(ours, state, [row[:kept]], [1], [6 + kept])
    for pool in ("conv", "delta"):
        np.testing.assert_allclose(getattr(committed, pool)[1], getattr(alone, pool)[1],
                                   rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(getattr(committed, pool)[2], getattr(plain, pool)[2])
