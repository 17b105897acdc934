"""An FP8 KV cache's per-layer scales from a Hugging Face checkpoint (model/fp8_kv_cache.py):
what vLLM and SGLang read. Each layer's K is stored as K / k_scale and V as V / v_scale, one float
per tensor, under the names the quantizers write:
- `self_attn.k_scale` / `self_attn.v_scale` (llm-compressor's compressed-tensors),
- `self_attn.k_proj.k_scale` / `self_attn.v_proj.v_scale` (NVIDIA ModelOpt),
- `self_attn.k_proj.output_scale` / `self_attn.v_proj.output_scale` (AMD Quark),
- `self_attn.kv_scale`, one for both (AutoFP8's older files).
A scale that is not one positive finite float (per-head or per-channel scales), or a checkpoint
that gives some layers scales and not others, stops the load with a line naming the tensor: the
cache is never filled under a scale that was guessed."""
from __future__ import annotations

import numpy as np

from xlaserve.weights.param_layout import WeightError
from xlaserve.weights.formats.tensor_source import TensorSource

K_NAMES = ("self_attn.k_scale", "self_attn.k_proj.k_scale", "self_attn.k_proj.output_scale",
           "self_attn.kv_scale")
V_NAMES = ("self_attn.v_scale", "self_attn.v_proj.v_scale", "self_attn.v_proj.output_scale",
           "self_attn.kv_scale")


def kv_scales(source: TensorSource, num_layers: int,
              prefix: str = "model.layers.") -> tuple[tuple[float, float], ...] | None:
    """Per layer (k_scale, v_scale) as `source` names them, or None where it has none at all."""
    names = source.names()
    scales = [(_scale(source, names, prefix, i, K_NAMES), _scale(source, names, prefix, i, V_NAMES))
              for i in range(num_layers)]
    if all(k is None and v is None for k, v in scales):
        return None
    for i, pair in enumerate(scales):
        for which, scale in zip(("k_scale", "v_scale"), pair):
            if scale is None:
                raise WeightError(f"the checkpoint gives KV cache scales, but not layer {i}'s "
                                  f"{which} ({prefix}{i}.{(K_NAMES if which == 'k_scale' else V_NAMES)[0]})")
    return tuple(scales)


def _scale(source: TensorSource, names: set[str], prefix: str, layer: int,
           candidates: tuple[str, ...]) -> float | None:
    for candidate in candidates:
        name = f"{prefix}{layer}.{candidate}"
        if name not in names:
            continue
        value = np.asarray(source.get(name))
        if value.size != 1 or not np.issubdtype(value.dtype, np.floating):
            raise WeightError(f"{name}: a KV cache scale is one float per tensor; got "
                              f"{value.dtype}{list(value.shape)} (per-head or per-channel KV "
                              "scales are not supported)")
        scale = float(value.astype(np.float32).reshape(()))
        if not np.isfinite(scale) or scale <= 0:
            raise WeightError(f"{name}: a KV cache scale must be positive and finite; got {scale}")
        return scale
    return None
