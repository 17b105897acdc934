"""Nemotron-H's checkpoint tensors -> our parameters (model/config/mamba2_config.py): its
`backbone.embeddings`, `backbone.norm_f` and `lm_head`; per decoder layer, its mixer block
(`backbone.layers.{m}.norm` the input norm; `mixer.*` Mamba-2's, model/mamba2.py, or attention's
q, k, v and o projections) and the MLP block after it (`backbone.layers.{f}.norm` the
post-attention norm; `mixer.up_proj`, `mixer.down_proj`), as ModelConfig.nemotron_blocks pairs
them. PyTorch's [out, in] matrices as [in, out...]."""
from __future__ import annotations

import numpy as np

from xlaserve.model.mamba2 import by_group, conv_channels_by_group

PREFIX = "backbone."


def nemotron_h_weights(fetch, config, attention, skip: frozenset = frozenset()):
    """(param path, array) of every parameter of ModelConfig `config`: `fetch(name, shape)` reads
    a float tensor of that shape (or raises naming it); `attention(prefix, i, path)` yields
    attention's parameters of layer `i` from the tensors under `prefix` (param_layout's reader,
    whose names are transformers' q_proj, k_proj, v_proj, o_proj). `skip`: what the caller has
    (a GGUF's kept weights; never here but for the embedding and LM head)."""
    c, hidden = config, config.hidden_size
    if ("embedding",) not in skip:
        yield ("embedding",), fetch(PREFIX + "embeddings.weight", (c.vocab_size, hidden))
    for i, (mixer, mlp) in enumerate(c.nemotron_blocks):
        layer, block = ("layers", i), f"{PREFIX}layers.{mixer}."
        yield layer + ("input_norm", "scale"), fetch(block + "norm.weight", (hidden,))
        if c.linear_layers[i]:
            yield from mamba2_weights(fetch, c.mamba2, block + "mixer.", layer + ("attn",))
        else:
            yield from attention(block + "mixer.", i, layer)
        if mlp >= 0:
            block, width = f"{PREFIX}layers.{mlp}.", c.layer(i).intermediate_size
            yield layer + ("post_attention_norm", "scale"), fetch(block + "norm.weight",
                                                                  (hidden,))
            yield layer + ("mlp", "up"), fetch(block + "mixer.up_proj.weight", (width, hidden)).T
            yield layer + ("mlp", "down"), fetch(block + "mixer.down_proj.weight",
                                                 (hidden, width)).T
    yield ("final_norm", "scale"), fetch(PREFIX + "norm_f.weight", (hidden,))
    if not c.tie_word_embeddings and c.lm_head and ("lm_head",) not in skip:
        yield ("lm_head",), fetch("lm_head.weight", (c.vocab_size, hidden)).T


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
