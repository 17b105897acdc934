"""A PEFT LoRA adapter read into our layout (issue 53): `adapter_config.json` and
`adapter_model.safetensors` from a directory or a Hugging Face hub id.

What loads: LoRA (not DoRA) on the decoder layers' q/k/v/o and gate/up/down projections, any rank
(each module's own: `rank_pattern` is read from the tensors' shapes), `lora_alpha` and rsLoRA
scaling. What does not is refused in one line naming it, never skipped: another PEFT type, DoRA,
`alpha_pattern`, biases, `modules_to_save`, embedding or LM-head targets, expert parameters, a
`.bin` file, a tensor of a shape the model's modules do not have.

Layout: module m of layer i gives `a` [K, r] (PEFT's lora_A.weight [r, K], transposed) and `b`
[r, *output axes] (lora_B.weight [N, r] transposed, times the scale, its N split as our fused
projection splits it: q's heads as [kv heads, group, head_dim], model/lora.module_shapes).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import numpy as np

from xlaserve.model.config.model_config import ModelConfig
from xlaserve.model.lora import TARGET_MODULES, module_shapes, scaling
from xlaserve.weights.loader import download

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's saved names: base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\."
                  r"(\w+)\.lora_([AB])\.weight$")


class LoraAdapterError(ValueError):
    """An adapter that cannot be served as it is: the message names what and where."""


@dataclass
class LoraAdapter:
    name: str
    path: str
    rank: int  # the largest of its modules' ranks
    target_modules: tuple[str, ...]  # modules with weights in some layer, TARGET_MODULES' order
    # (layer, module) -> (a [K, r] float32, b [r, *output axes] float32, scaled)
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def read_adapter_config(directory: str) -> dict:
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.isfile(path):
        raise LoraAdapterError(f"{directory}: no {CONFIG_FILE} (a PEFT LoRA adapter directory "
                               "holds adapter_config.json and adapter_model.safetensors)")
    with open(path) as f:
        config = json.load(f)
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoraAdapterError(f"{path}: peft_type {peft_type} is not supported (LoRA only)")
    refusals = {"use_dora": "DoRA (use_dora)", "alpha_pattern": "per-module alpha_pattern",
                "modules_to_save": "modules_to_save (fully trained modules)",
                "lora_bias": "LoRA biases (lora_bias)", "fan_in_fan_out": "fan_in_fan_out",
                "target_parameters": "target_parameters (expert parameters)",
                "trainable_token_indices": "trainable_token_indices",
                "use_qalora": "QALoRA (use_qalora)"}
    for key, what in refusals.items():
        if config.get(key):
            raise LoraAdapterError(f"{path}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise LoraAdapterError(f"{path}: bias {config['bias']!r} is not supported (only 'none')")
    if not isinstance(config.get("r"), int) or config["r"] < 1:
        raise LoraAdapterError(f"{path}: r must be a positive integer, got {config.get('r')!r}")
    return config


def load_adapter(name: str, path: str, model_config: ModelConfig) -> LoraAdapter:
    """The adapter at `path` (a directory or hub id) for a model of `model_config`."""
    directory = _adapter_directory(name, path)
    config = read_adapter_config(directory)
    weights_path = os.path.join(directory, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        if os.path.isfile(os.path.join(directory, "adapter_model.bin")):
            raise LoraAdapterError(f"{directory}: adapter_model.bin (a PyTorch pickle) is not "
                                   f"loaded; save the adapter as {WEIGHTS_FILE}")
        raise LoraAdapterError(f"{directory}: no {WEIGHTS_FILE}")
    from safetensors import SafetensorError
    from safetensors.numpy import load_file
    try:
        try:
            tensors = load_file(weights_path)
        except Exception:  # bfloat16 and other torch dtypes: numpy's reader refuses them
            tensors = _load_through_torch(weights_path)
    except SafetensorError as error:  # a truncated or corrupt file: the client's, not a 500
        raise LoraAdapterError(f"{weights_path}: not a readable safetensors file ({error})") \
            from None
    weights = adapter_weights(tensors, config, model_config, weights_path)
    modules = {module for _, module in weights}
    return LoraAdapter(name=name, path=path,
                       rank=max(a.shape[1] for a, _ in weights.values()),
                       target_modules=tuple(m for m in TARGET_MODULES if m in modules),
                       weights=weights)


def _adapter_directory(name: str, path: str) -> str:
    """A local directory, or a hub id's adapter files downloaded (or found in the cache)."""
    local = os.path.expanduser(path)
    if os.path.exists(local):
        if not os.path.isdir(local):
            raise LoraAdapterError(f"LoRA adapter {name!r}: {path} is not a directory")
        return local
    if path.count("/") != 1 or path.startswith((".", "/", "~")):
        raise LoraAdapterError(f"LoRA adapter {name!r}: {path} does not exist")
    try:
        return download(path, [CONFIG_FILE, WEIGHTS_FILE])
    except Exception as err:
        raise LoraAdapterError(f"LoRA adapter {name!r}: {err}") from None


def _load_through_torch(path: str) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    out = {}
    with safe_open(path, framework="pt") as f:
        for key in f.keys():
            out[key] = f.get_tensor(key).float().numpy()
    return out


def adapter_weights(tensors: dict[str, np.ndarray], config: dict, model_config: ModelConfig,
                    where: str) -> dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]:
    """(layer, module) -> (a, b) in our layout from PEFT's tensors (module docstring)."""
    shapes = module_shapes(model_config)
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None or match.group(2) not in TARGET_MODULES:
            raise LoraAdapterError(f"{where}: tensor {key} is not a LoRA matrix of a decoder "
                                   f"layer's {'/'.join(TARGET_MODULES)}: not supported")
        layer, module, part = int(match.group(1)), match.group(2), match.group(3)
        if layer >= model_config.num_layers:
            raise LoraAdapterError(f"{where}: tensor {key} is for layer {layer}; the model has "
                                   f"{model_config.num_layers}")
        pairs.setdefault((layer, module), {})[part] = np.asarray(tensor, np.float32)
    if not pairs:
        raise LoraAdapterError(f"{where}: no LoRA matrices in the file")
    alpha = float(config.get("lora_alpha", config["r"]))
    out = {}
    for (layer, module), found in sorted(pairs.items()):
        if set(found) != {"A", "B"}:
            raise LoraAdapterError(f"{where}: layer {layer} {module} has lora_{''.join(found)} "
                                   "without its pair")
        a, b = found["A"], found["B"]
        width, axes = shapes[module]
        rank = a.shape[0]
        outputs = int(np.prod(axes))
        if a.shape != (rank, width) or b.shape != (outputs, rank):
            raise LoraAdapterError(
                f"{where}: layer {layer} {module} has lora_A {list(a.shape)} and lora_B "
                f"{list(b.shape)}; the model's {module} needs [r, {width}] and [{outputs}, r]")
        scale = scaling(rank, alpha, bool(config.get("use_rslora")))
        out[(layer, module)] = (np.ascontiguousarray(a.T),
                                (b.T * np.float32(scale)).reshape(rank, *axes))
    return out
