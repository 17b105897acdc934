"""A Gated DeltaNet layer's checkpoint tensors -> its parameters (model/linear_attention.py, laid
out by key head): Qwen3.5's names (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`), or
Qwen3-Next's grouped ones (`in_proj_qkvz`, `in_proj_ba`) reordered into them first; q | k | v
rows and the depthwise convolution's [conv_dim, 1, W] weight regrouped by key head; PyTorch's
[out, in] matrices as [in, out...].

Nemotron-H's whole checkpoint (model/config/mamba2_config.py, `nemotron_h_weights`): its
`backbone.embeddings`, `backbone.norm_f` and `lm_head`; per decoder layer, its mixer block
(`backbone.layers.{m}.norm` the input norm; `mixer.*` Mamba-2's, model/mamba2.py, or attention's
q, k, v and o projections) and the MLP block after it (`backbone.layers.{f}.norm` the
post-attention norm; `mixer.up_proj`, `mixer.down_proj`), as ModelConfig.nemotron_blocks pairs
them."""
from __future__ import annotations

import numpy as np

from xlaserve.model.linear_attention import by_key_head, from_grouped_projections
from xlaserve.model.mamba2 import by_group, conv_channels_by_group

# Checkpoints whose linear layers group q, k, v and z by key head (from_grouped_projections).
GROUPED_PROJECTIONS = ("Qwen3NextForCausalLM",)
NEMOTRON_H_PREFIX = "backbone."


def gated_delta_net_weights(fetch, config, prefix: str, path: tuple):
    """(param path, array) of one linear layer of ModelConfig `config`: `fetch(name, shape)`
    reads a float tensor of that shape (or raises naming it), `prefix` its names' start
    ("model.layers.0.linear_attn."), `path` the module's."""
    c = config.linear_attention
    hidden, heads = c.hidden_size, c.num_value_heads
    if config.architecture in GROUPED_PROJECTIONS:
        qkvz = fetch(prefix + "in_proj_qkvz.weight", (c.conv_dim + c.value_dim, hidden))
        ba = fetch(prefix + "in_proj_ba.weight", (2 * heads, hidden))
        rows = from_grouped_projections(qkvz, ba, c)
    else:
        rows = {"in_proj_qkv": fetch(prefix + "in_proj_qkv.weight", (c.conv_dim, hidden)),
                "in_proj_z": fetch(prefix + "in_proj_z.weight", (c.value_dim, hidden)),
                "in_proj_b": fetch(prefix + "in_proj_b.weight", (heads, hidden)),
                "in_proj_a": fetch(prefix + "in_proj_a.weight", (heads, hidden))}
    qkv = by_key_head(rows["in_proj_qkv"], c)  # [Hk, channels, hidden]
    yield path + ("in_proj_qkv",), np.ascontiguousarray(np.moveaxis(qkv, -1, 0))
    yield path + ("in_proj_z",), np.ascontiguousarray(
        rows["in_proj_z"].T.reshape(hidden, heads, c.value_head_dim))
    yield path + ("in_proj_ba",), np.stack([rows["in_proj_b"].T, rows["in_proj_a"].T], axis=1)
    conv = fetch(prefix + "conv1d.weight", (c.conv_dim, 1, c.conv_width))[:, 0]
    yield path + ("conv_weight",), by_key_head(conv, c)
    yield path + ("A_log",), fetch(prefix + "A_log", (heads,))
    yield path + ("dt_bias",), fetch(prefix + "dt_bias", (heads,))
    yield path + ("gated_norm",), fetch(prefix + "norm.weight", (c.value_head_dim,))
    yield path + ("out_proj",), np.ascontiguousarray(
        fetch(prefix + "out_proj.weight", (hidden, c.value_dim)).T).reshape(
        heads, c.value_head_dim, hidden)


def nemotron_h_weights(fetch, config, attention, skip: frozenset = frozenset()):
    """(param path, array) of every parameter of ModelConfig `config`: `fetch(name, shape)` reads
    a float tensor of that shape (or raises naming it); `attention(prefix, i, path)` yields
    attention's parameters of layer `i` from the tensors under `prefix` (param_layout's reader,
    whose names are transformers' q_proj, k_proj, v_proj, o_proj). `skip`: what the caller has
    (a GGUF's kept weights; never here but for the embedding and LM head)."""
    c, hidden = config, config.hidden_size
    if ("embedding",) not in skip:
        yield ("embedding",), fetch(NEMOTRON_H_PREFIX + "embeddings.weight", (c.vocab_size, hidden))
    for i, (mixer, mlp) in enumerate(c.nemotron_blocks):
        layer, block = ("layers", i), f"{NEMOTRON_H_PREFIX}layers.{mixer}."
        yield layer + ("input_norm", "scale"), fetch(block + "norm.weight", (hidden,))
        if c.linear_layers[i]:
            yield from mamba2_weights(fetch, c.mamba2, block + "mixer.", layer + ("attn",))
        else:
            yield from attention(block + "mixer.", i, layer)
        if mlp >= 0:
            block, width = f"{NEMOTRON_H_PREFIX}layers.{mlp}.", c.layer(i).intermediate_size
            yield layer + ("post_attention_norm", "scale"), fetch(block + "norm.weight",
                                                                  (hidden,))
            if c.moe_layers[i]:
                yield from _ungated_experts(fetch, c, block + "mixer.", layer + ("mlp",))
            else:
                yield from _relu_squared_mlp(fetch, block + "mixer.", width, hidden,
                                             layer + ("mlp",))
    yield ("final_norm", "scale"), fetch(NEMOTRON_H_PREFIX + "norm_f.weight", (hidden,))
    if not c.tie_word_embeddings and c.lm_head and ("lm_head",) not in skip:
        yield ("lm_head",), fetch("lm_head.weight", (c.vocab_size, hidden)).T


def _relu_squared_mlp(fetch, prefix: str, width: int, hidden: int, path: tuple):
    yield path + ("up",), fetch(prefix + "up_proj.weight", (width, hidden)).T
    yield path + ("down",), fetch(prefix + "down_proj.weight", (hidden, width)).T


def _ungated_experts(fetch, c, prefix: str, path: tuple):
    """An E block (model/moe.py): the router and its correction bias, each expert's up
    [I, hidden] and down [hidden, I] stacked (up as [E, hidden, 1, I]: no gate), the shared
    expert's up and down."""
    hidden, inter, experts = c.hidden_size, c.moe_intermediate_size, c.num_experts
    yield path + ("router",), fetch(prefix + "gate.weight", (experts, hidden)).T
    yield path + ("router_correction_bias",), fetch(prefix + "gate.e_score_correction_bias",
                                                    (experts,))
    up = np.stack([fetch(f"{prefix}experts.{e}.up_proj.weight", (inter, hidden)).T
                   for e in range(experts)])
    yield path + ("experts_gate_up",), up[:, :, None, :]
    yield path + ("experts_down",), np.stack([
        fetch(f"{prefix}experts.{e}.down_proj.weight", (hidden, inter)).T
        for e in range(experts)])
    yield from _relu_squared_mlp(fetch, prefix + "shared_experts.",
                                 c.shared_expert_intermediate_size, hidden,
                                 path + ("shared_expert",))


def mamba2_weights(fetch, c, prefix: str, path: tuple):
    """One Mamba-2 mixer's parameters (Mamba2Config `c`) from the tensors under `prefix`."""
    heads = c.num_heads
    rows = 2 * c.inner_size + 2 * c.num_groups * c.state_size + heads
    for name, array in by_group(fetch(prefix + "in_proj.weight", (rows, c.hidden_size)),
                                c).items():
        yield path + (name,), array
    conv = fetch(prefix + "conv1d.weight", (c.conv_dim, 1, c.conv_width))[:, 0]
    yield path + ("conv_weight",), conv_channels_by_group(conv, c)
    if c.conv_bias:
        yield path + ("conv_bias",), conv_channels_by_group(
            fetch(prefix + "conv1d.bias", (c.conv_dim,)), c)
    for name in ("A_log", "dt_bias", "D"):
        yield path + (name,), fetch(prefix + name, (heads,))
    yield path + ("group_norm",), fetch(prefix + "norm.weight", (c.inner_size,)).reshape(
        c.num_groups, -1)
    yield path + ("out_proj",), np.ascontiguousarray(
        fetch(prefix + "out_proj.weight", (c.hidden_size, c.inner_size)).T).reshape(
        heads, c.head_dim, c.hidden_size)
