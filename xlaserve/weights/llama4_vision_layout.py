"""Llama 4's vision encoder and projector (model/vision/llama4_vision.py) from a
Llama4ForConditionalGeneration checkpoint, in the decoder's layouts (qkv [W, heads, 3, D],
o_proj [heads, D, W], matrices [in, out]). The decoder beside it converts as a Llama 4's
(param_layout.convert).

The names are read as vision_layout.VisionLanguageNames gives them, `vision_model.*` and
`multi_modal_projector.*`: the published files' (Llama-4-Scout-17B-16E: `vision_model.*`,
`multi_modal_projector.linear_1.weight`, `language_model.model.*`), transformers 5's saves (the
same) and transformers' module names (`model.vision_model.*`, `model.multi_modal_projector.*`,
`model.language_model.*`).

q's and k's rows (and biases) are stored each head's even rows, then its odd ones: the
checkpoint's RoPE turns interleaved pairs, the tower's turns halves (model/mla.py's
interleaved_rope_rows, the text model's permutation).
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from xlaserve.model.config.llama4_vision_config import Llama4VisionConfig
from xlaserve.model.mla import interleaved_rope_rows
from xlaserve.weights.formats.tensor_source import TensorSource
from xlaserve.weights.param_layout import _fetch

TOWER, PROJECTOR = "vision_model.", "multi_modal_projector."


def llama4_vision_weights(config: Llama4VisionConfig, source: TensorSource
                          ) -> Iterator[tuple[tuple, np.ndarray]]:
    """(parameter path, array) for every parameter of the encoder and the projector."""
    c, width = config, config.hidden_size
    heads, d, inter = c.num_heads, c.head_dim, c.intermediate_size
    yield ("vision", "patch_embed"), _fetch(source, TOWER + "patch_embedding.linear.weight",
                                            (width, c.patch_dim)).T
    yield ("vision", "class_embedding"), _fetch(source, TOWER + "class_embedding", (width,))
    yield ("vision", "pos_embed"), _fetch(source, TOWER + "positional_embedding_vlm",
                                          (c.num_patches + 1, width))
    yield from _layer_norm(source, TOWER + "layernorm_pre", ("vision", "pre_norm"), width)
    yield from _layer_norm(source, TOWER + "layernorm_post", ("vision", "post_norm"), width)
    order = np.concatenate([h * d + interleaved_rope_rows(d, d) for h in range(heads)])
    for i in range(c.depth):
        prefix, path = f"{TOWER}model.layers.{i}.", ("vision", "blocks", i)
        yield from _layer_norm(source, prefix + "input_layernorm", path + ("norm1",), width)
        yield from _layer_norm(source, prefix + "post_attention_layernorm", path + ("norm2",),
                               width)
        names = [prefix + f"self_attn.{p}_proj" for p in "qkv"]
        weights = [_fetch(source, n + ".weight", (width, width)) for n in names]
        biases = [_fetch(source, n + ".bias", (width,)) for n in names]
        for j in (0, 1):  # q and k: each head's rows de-interleaved
            weights[j], biases[j] = weights[j][order], biases[j][order]
        qkv = np.concatenate(weights)
        yield path + ("qkv",), qkv.reshape(3, heads, d, width).transpose(3, 1, 0, 2)
        yield path + ("qkv_bias",), np.concatenate(biases).reshape(3, heads, d).transpose(1, 0, 2)
        out = _fetch(source, prefix + "self_attn.o_proj.weight", (width, width))
        yield path + ("o_proj",), out.T.reshape(heads, d, width)
        yield path + ("o_bias",), _fetch(source, prefix + "self_attn.o_proj.bias", (width,))
        yield path + ("up",), _fetch(source, prefix + "mlp.fc1.weight", (inter, width)).T
        yield path + ("up_bias",), _fetch(source, prefix + "mlp.fc1.bias", (inter,))
        yield path + ("down",), _fetch(source, prefix + "mlp.fc2.weight", (width, inter)).T
        yield path + ("down_bias",), _fetch(source, prefix + "mlp.fc2.bias", (width,))
    adapter, dim = TOWER + "vision_adapter.mlp.", c.projector_dim
    yield ("vision", "adapter", "up"), _fetch(source, adapter + "fc1.weight", (dim, inter)).T
    yield ("vision", "adapter", "down"), _fetch(source, adapter + "fc2.weight", (dim, dim)).T
    yield ("vision", "projection"), _fetch(source, PROJECTOR + "linear_1.weight",
                                           (c.out_hidden_size, dim)).T


def _layer_norm(source: TensorSource, name: str, path: tuple, width: int):
    yield path + ("scale",), _fetch(source, name + ".weight", (width,))
    yield path + ("bias",), _fetch(source, name + ".bias", (width,))
