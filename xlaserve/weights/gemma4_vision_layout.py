"""Gemma 4's vision tower and embedder (model/vision/gemma4_vision.py) from a
Gemma4ForConditionalGeneration checkpoint, in the decoder's layouts (qkv [W, heads, 3, D],
o_proj [heads, D, W], gate_up [W, 2, I], matrices [in, out]). The decoder beside it converts as
a Gemma 4's (param_layout.convert).

The names are read as vision_layout.VisionLanguageNames gives them, `vision_tower.*` and
`embed_vision.*`, whichever way the file has them: transformers 5's saves and the published
files (`model.vision_tower.*`, `model.embed_vision.*`) or without the `model.` prefix. With
use_clipped_linears each projection's four bounds are scalars beside its weight
(`q_proj.input_min`, ...).
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from xlaserve.model.config.gemma4_vision_config import Gemma4VisionConfig
from xlaserve.weights.formats.tensor_source import TensorSource
from xlaserve.weights.param_layout import _fetch

_BOUNDS = ("input_min", "input_max", "output_min", "output_max")


def gemma4_vision_weights(config: Gemma4VisionConfig, source: TensorSource
                          ) -> Iterator[tuple[tuple, np.ndarray]]:
    """(parameter path, array) for every parameter of the tower and the embedder."""
    c, width = config, config.hidden_size
    heads, d, inter = c.num_heads, c.head_dim, c.intermediate_size
    tower = "vision_tower."
    yield ("vision", "patch_embed"), _fetch(
        source, tower + "patch_embedder.input_proj.weight", (width, c.patch_dim)).T
    yield ("vision", "pos_embed"), _fetch(
        source, tower + "patch_embedder.position_embedding_table",
        (2, c.position_embedding_size, width))
    for i in range(c.depth):
        prefix, path = f"{tower}encoder.layers.{i}.", ("vision", "blocks", i)
        for name, ours in (("input_layernorm", "input_norm"),
                           ("post_attention_layernorm", "post_attention_norm"),
                           ("pre_feedforward_layernorm", "pre_mlp_norm"),
                           ("post_feedforward_layernorm", "post_mlp_norm"),
                           ("self_attn.q_norm", "q_norm"), ("self_attn.k_norm", "k_norm")):
            size = d if ours in ("q_norm", "k_norm") else width
            yield path + (ours, "scale"), _fetch(source, prefix + name + ".weight", (size,))
        attention = [prefix + f"self_attn.{p}_proj" for p in "qkv"]
        qkv = np.stack([_fetch(source, n + ".linear.weight", (heads * d, width))
                        for n in attention])
        yield path + ("qkv",), qkv.reshape(3, heads, d, width).transpose(3, 1, 0, 2)
        out = prefix + "self_attn.o_proj"
        yield path + ("o_proj",), _fetch(source, out + ".linear.weight",
                                         (width, heads * d)).T.reshape(heads, d, width)
        mlp = [prefix + f"mlp.{p}_proj" for p in ("gate", "up")]
        gate_up = np.stack([_fetch(source, n + ".linear.weight", (inter, width)) for n in mlp])
        yield path + ("gate_up",), gate_up.transpose(2, 0, 1)
        down = prefix + "mlp.down_proj"
        yield path + ("down",), _fetch(source, down + ".linear.weight", (width, inter)).T
        if c.clipped:
            for ours, names in (("qkv_clip", attention), ("o_clip", [out]),
                                ("gate_up_clip", mlp), ("down_clip", [down])):
                yield path + (ours, "bounds"), np.asarray(
                    [[_fetch(source, f"{n}.{b}", ()) for b in _BOUNDS] for n in names],
                    np.float32)
    if c.standardize:
        for name in ("bias", "scale"):
            yield ("vision", "standardize", name), _fetch(source, tower + "std_" + name,
                                                          (width,))
    yield ("vision", "projection"), _fetch(
        source, "embed_vision.embedding_projection.weight", (c.out_hidden_size, width)).T
