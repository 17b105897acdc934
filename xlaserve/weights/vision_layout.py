"""A Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3.5 checkpoint's vision tower ->
model/vision/qwen_vision.py's parameters, in the decoder's layouts (qkv [W, heads, 3, D], o_proj
[heads, D, W], gate_up [W, 2, I], matrices [in, out]). The decoder beside it converts as its text
model's (param_layout.convert: a Qwen2's, a Qwen3's, Qwen3.5's hybrid layers).

Checkpoints name the tower `visual.*` and the decoder `model.*` (as published, and as
transformers saves them); transformers' own module names (`model.visual.*`,
`model.language_model.*`: Qwen3-VL's and Qwen3.5's files) are read too
(`with_vision_language_names`), and Gemma 3's decoder as its checkpoints name it
(`language_model.model.*`: gemma-3-4b-it's files and transformers 5's saves), its SigLIP tower
and projector as `vision_tower.*` and `multi_modal_projector.*` however they are saved
(siglip_layout.py reads them); Llama 4's encoder as `vision_model.*` (llama4_vision_layout.py
reads it); Gemma 4's tower and embedder as `vision_tower.*` and `embed_vision.*`
(gemma4_vision_layout.py). Tensors no parameter asks for are not read, as everywhere: Qwen3.5's
multi-token-prediction head (`mtp.*`, which transformers does not load either), as DeepSeek's
past its layers.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from xlaserve.model.config.vision_config import VisionConfig
from xlaserve.weights.llama4_vision_layout import llama4_vision_weights
from xlaserve.weights.param_layout import _fetch
from xlaserve.weights.gemma4_vision_layout import gemma4_vision_weights
from xlaserve.weights.siglip_layout import siglip_weights
from xlaserve.weights.formats.tensor_source import TensorSource


class VisionLanguageNames:
    """`source` with transformers' module names read as the published ones."""

    # The first that fits is taken (the longer of two prefixes first).
    _RENAMES = (("model.language_model.", "model."), ("model.visual.", "visual."),
                ("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                # Gemma 3's tower: published inside `vision_model.`, saved by transformers 5
                # without it (SiglipVisionModel's own prefix dropped), or by module name.
                ("model.vision_tower.vision_model.", "vision_tower."),
                ("model.vision_tower.", "vision_tower."),
                ("vision_tower.vision_model.", "vision_tower."),
                ("model.multi_modal_projector.", "multi_modal_projector."),
                ("model.vision_model.", "vision_model."),  # Llama 4's encoder by module name
                # Gemma 4's embedder (gemma4_vision_layout.py), saved by module name.
                ("model.embed_vision.", "embed_vision."))

    def __init__(self, source: TensorSource):
        self.source = source
        self._names = {}
        for name in source.names():
            published = name
            for old, new in self._RENAMES:
                if name.startswith(old):
                    published = new + name[len(old):]
                    break
            self._names[published] = name

    def names(self) -> set[str]:
        return set(self._names)

    def get(self, name: str) -> np.ndarray:
        return self.source.get(self._names[name])


def with_vision_language_names(source: TensorSource) -> TensorSource:
    names = source.names()
    if any(n.startswith(("model.visual.", "model.language_model.", "language_model."))
           for n in names):
        return VisionLanguageNames(source)
    return source


def vision_weights(config: VisionConfig, source: TensorSource) -> Iterator[tuple[tuple, np.ndarray]]:
    """(parameter path, array) for every parameter of the vision tower (Gemma 3's SigLIP and
    projector: siglip_layout.py; Llama 4's encoder and projector: llama4_vision_layout.py; Gemma
    4's tower and embedder: gemma4_vision_layout.py)."""
    if config.kind == "gemma3":
        yield from siglip_weights(config, source)
        return
    if config.kind == "llama4":
        yield from llama4_vision_weights(config, source)
        return
    if config.kind == "gemma4":
        yield from gemma4_vision_weights(config, source)
        return
    c, width = config, config.hidden_size
    heads, d, inter = c.num_heads, c.head_dim, c.intermediate_size
    patch = _fetch(source, "visual.patch_embed.proj.weight",
                   (width, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size))
    yield ("vision", "patch_embed"), patch.reshape(width, -1).T
    if c.num_position_embeddings:  # Qwen3-VL
        yield ("vision", "patch_embed_bias"), _fetch(source, "visual.patch_embed.proj.bias",
                                                     (width,))
        yield ("vision", "pos_embed"), _fetch(source, "visual.pos_embed.weight",
                                              (c.num_position_embeddings, width))
    for i in range(c.depth):
        prefix, path = f"visual.blocks.{i}.", ("vision", "blocks", i)
        yield from _norm(source, c, prefix + "norm1", path + ("norm1",), width)
        yield from _norm(source, c, prefix + "norm2", path + ("norm2",), width)
        qkv = _fetch(source, prefix + "attn.qkv.weight", (3 * width, width))
        yield path + ("qkv",), qkv.reshape(3, heads, d, width).transpose(3, 1, 0, 2)
        qkv_bias = _fetch(source, prefix + "attn.qkv.bias", (3 * width,))
        yield path + ("qkv_bias",), qkv_bias.reshape(3, heads, d).transpose(1, 0, 2)
        proj = _fetch(source, prefix + "attn.proj.weight", (width, width))
        yield path + ("o_proj",), proj.T.reshape(heads, d, width)
        yield path + ("o_bias",), _fetch(source, prefix + "attn.proj.bias", (width,))
        if c.gated_mlp:
            gate = _fetch(source, prefix + "mlp.gate_proj.weight", (inter, width))
            up = _fetch(source, prefix + "mlp.up_proj.weight", (inter, width))
            yield path + ("gate_up",), np.stack([gate.T, up.T], axis=1)
            yield path + ("gate_up_bias",), np.stack(
                [_fetch(source, prefix + "mlp.gate_proj.bias", (inter,)),
                 _fetch(source, prefix + "mlp.up_proj.bias", (inter,))])
            down = "mlp.down_proj"
        else:
            up, down = (("mlp.linear_fc1", "mlp.linear_fc2") if c.kind == "qwen3_vl"
                        else ("mlp.fc1", "mlp.fc2"))
            yield path + ("up",), _fetch(source, prefix + up + ".weight", (inter, width)).T
            yield path + ("up_bias",), _fetch(source, prefix + up + ".bias", (inter,))
        yield path + ("down",), _fetch(source, prefix + down + ".weight", (width, inter)).T
        yield path + ("down_bias",), _fetch(source, prefix + down + ".bias", (width,))
    if c.kind == "qwen3_vl":
        yield from _merger(source, c, "visual.merger.", ("norm", "linear_fc1", "linear_fc2"),
                           ("vision", "merger"), width)
        for k in range(len(c.deepstack_layers)):  # their norms after the merge: 4 rows wide
            yield from _merger(source, c, f"visual.deepstack_merger_list.{k}.",
                               ("norm", "linear_fc1", "linear_fc2"),
                               ("vision", "deepstack_mergers", k), width * c.merge_unit)
    else:
        yield from _merger(source, c, "visual.merger.", ("ln_q", "mlp.0", "mlp.2"),
                           ("vision", "merger"), width)


def _merger(source: TensorSource, c: VisionConfig, prefix: str, names: tuple[str, str, str],
            path: tuple, norm_width: int):
    """A patch merger's norm (`norm_width` wide), up and down (`names`: the checkpoint's)."""
    norm, up, down = names
    merged = c.hidden_size * c.merge_unit
    yield from _norm(source, c, prefix + norm, path + ("norm",), norm_width)
    yield path + ("up",), _fetch(source, prefix + up + ".weight", (merged, merged)).T
    yield path + ("up_bias",), _fetch(source, prefix + up + ".bias", (merged,))
    yield path + ("down",), _fetch(source, prefix + down + ".weight",
                                   (c.out_hidden_size, merged)).T
    yield path + ("down_bias",), _fetch(source, prefix + down + ".bias", (c.out_hidden_size,))


def _norm(source: TensorSource, c: VisionConfig, name: str, path: tuple, width: int):
    yield path + ("scale",), _fetch(source, name + ".weight", (width,))
    if not c.rms_norms:  # LayerNorms have a bias
        yield path + ("bias",), _fetch(source, name + ".bias", (width,))
