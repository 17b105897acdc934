"""A Gated DeltaNet layer's checkpoint tensors -> its parameters (model/linear_attention.py, laid
out by key head): Qwen3.5's names (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`), or
Qwen3-Next's grouped ones (`in_proj_qkvz`, `in_proj_ba`) reordered into them first; q | k | v
rows and the depthwise convolution's [conv_dim, 1, W] weight regrouped by key head; PyTorch's
[out, in] matrices as [in, out...]."""
from __future__ import annotations

import numpy as np

from xlaserve.model.linear_attention import by_key_head, from_grouped_projections

# Checkpoints whose linear layers group q, k, v and z by key head (from_grouped_projections).
GROUPED_PROJECTIONS = ("Qwen3NextForCausalLM",)


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
