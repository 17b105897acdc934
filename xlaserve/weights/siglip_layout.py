"""Gemma 3's SigLIP tower and projector (model/vision/siglip_vision.py) from a
Gemma3ForConditionalGeneration checkpoint, in the decoder's layouts (qkv [W, heads, 3, D],
o_proj [heads, D, W], matrices [in, out]). The decoder beside it converts as a Gemma 3's
(param_layout.convert).

The names are read as vision_layout.VisionLanguageNames gives them: `vision_tower.*` and
`multi_modal_projector.*`, whichever way the file has them: gemma-3-4b-it's published files
(`vision_tower.vision_model.*`), transformers 5's saves (`vision_tower.*`, the vision_model
prefix dropped) and transformers' module names (`model.vision_tower.*`,
`model.multi_modal_projector.*`).
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from xlaserve.model.config.siglip_config import SiglipConfig
from xlaserve.weights.formats.tensor_source import TensorSource
from xlaserve.weights.param_layout import _fetch


def siglip_weights(config: SiglipConfig, source: TensorSource
                   ) -> Iterator[tuple[tuple, np.ndarray]]:
    """(parameter path, array) for every parameter of the tower and the projector."""
    c, width = config, config.hidden_size
    heads, d, inter = c.num_heads, c.head_dim, c.intermediate_size
    tower = "vision_tower."
    patch = _fetch(source, tower + "embeddings.patch_embedding.weight",
                   (width, c.in_channels, c.patch_size, c.patch_size))
    yield ("vision", "patch_embed"), patch.reshape(width, -1).T
    yield ("vision", "patch_embed_bias"), _fetch(
        source, tower + "embeddings.patch_embedding.bias", (width,))
    yield ("vision", "pos_embed"), _fetch(source, tower + "embeddings.position_embedding.weight",
                                          (c.num_patches, width))
    for i in range(c.depth):
        prefix, path = f"{tower}encoder.layers.{i}.", ("vision", "blocks", i)
        yield from _layer_norm(source, prefix + "layer_norm1", path + ("norm1",), width)
        yield from _layer_norm(source, prefix + "layer_norm2", path + ("norm2",), width)
        names = [prefix + f"self_attn.{p}_proj" for p in "qkv"]
        qkv = np.concatenate([_fetch(source, n + ".weight", (width, width)) for n in names])
        yield path + ("qkv",), qkv.reshape(3, heads, d, width).transpose(3, 1, 0, 2)
        bias = np.concatenate([_fetch(source, n + ".bias", (width,)) for n in names])
        yield path + ("qkv_bias",), bias.reshape(3, heads, d).transpose(1, 0, 2)
        out = _fetch(source, prefix + "self_attn.out_proj.weight", (width, width))
        yield path + ("o_proj",), out.T.reshape(heads, d, width)
        yield path + ("o_bias",), _fetch(source, prefix + "self_attn.out_proj.bias", (width,))
        yield path + ("up",), _fetch(source, prefix + "mlp.fc1.weight", (inter, width)).T
        yield path + ("up_bias",), _fetch(source, prefix + "mlp.fc1.bias", (inter,))
        yield path + ("down",), _fetch(source, prefix + "mlp.fc2.weight", (width, inter)).T
        yield path + ("down_bias",), _fetch(source, prefix + "mlp.fc2.bias", (width,))
    yield from _layer_norm(source, tower + "post_layernorm", ("vision", "post_norm"), width)
    projector = "multi_modal_projector."
    yield ("vision", "projector_norm", "scale"), _fetch(
        source, projector + "mm_soft_emb_norm.weight", (width,))
    yield ("vision", "projection"), _fetch(source, projector + "mm_input_projection_weight",
                                           (width, c.out_hidden_size))


def _layer_norm(source: TensorSource, name: str, path: tuple, width: int):
    yield path + ("scale",), _fetch(source, name + ".weight", (width,))
    yield path + ("bias",), _fetch(source, name + ".bias", (width,))
