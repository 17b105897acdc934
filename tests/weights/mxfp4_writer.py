"""Tiny gpt-oss checkpoints in the real on-disk format: MXFP4 experts (`*_blocks` + `*_scales`,
uint8) beside bfloat16 tensors, and a `quantization_config` in config.json, as openai/gpt-oss-20b
ships them. Test-only: the server decodes (xlaserve/weights/formats/mxfp4.py) and never encodes."""
from __future__ import annotations

import json
import os

import numpy as np

from xlaserve.weights.formats.mxfp4 import FP4_VALUES, GROUP, SCALE_BIAS

# openai/gpt-oss-20b's config.json.
QUANTIZATION_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                               "model.embed_tokens", "lm_head"],
}
EXPERT_MATRICES = ("gate_up_proj", "down_proj")
_MAGNITUDES = np.abs(FP4_VALUES[:8]).astype(np.float64)  # codes 0..7: 0, 0.5, ..., 6
_MIDPOINTS = (_MAGNITUDES[1:] + _MAGNITUDES[:-1]) / 2


def encode_mxfp4(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[E, in, out] (transformers' GptOssExperts orientation) -> blocks uint8 [E, out, in/32, 16],
    scales uint8 [E, out, in/32], the inverse of `decode_mxfp4`.

    Each group of 32 takes the OCP MX shared exponent floor(log2(max |v|)) - 2 (2 is e2m1's largest
    exponent), and each value the nearest FP4 value at that scale (ties to the even code, above 6
    saturating), so a group of values that are all FP4 values times one power of two comes back
    exactly."""
    w = np.asarray(weight, dtype=np.float64)
    if w.ndim != 3 or w.shape[1] % GROUP:
        raise ValueError(f"encode_mxfp4 takes [experts, in, out] with in a multiple of {GROUP}, got {list(w.shape)}")
    if not np.isfinite(w).all():
        raise ValueError("encode_mxfp4: the weight has inf or NaN values")
    experts, cols, rows = w.shape
    groups = w.transpose(0, 2, 1).reshape(experts, rows, cols // GROUP, GROUP)
    _, exponent = np.frexp(np.abs(groups).max(axis=-1))  # max = m * 2**exponent, m in [0.5, 1)
    shared = np.clip(exponent - 1 - 2, -SCALE_BIAS, None)
    if shared.max(initial=-SCALE_BIAS) > 254 - SCALE_BIAS:
        raise ValueError("encode_mxfp4: a group's magnitude is beyond MXFP4's largest scale 2**127")
    scaled = np.ldexp(groups, -shared[..., None])
    magnitude = np.abs(scaled)
    codes = np.searchsorted(_MIDPOINTS, magnitude, side="left")  # a tie lands on the lower code
    tie = (codes < 7) & (magnitude == _MIDPOINTS[np.minimum(codes, 6)])
    codes = codes + (tie & (codes % 2 == 1))  # ... which moves to the even code
    codes = (codes | np.where(np.signbit(scaled), 8, 0)).astype(np.uint8)
    blocks = codes[..., 0::2] | codes[..., 1::2] << 4
    return np.ascontiguousarray(blocks), np.ascontiguousarray(shared + SCALE_BIAS, dtype=np.uint8)


def tiny_gpt_oss_config(**overrides):
    """A transformers GptOssConfig: 2 layers (sliding then full attention), hidden 64, 4 heads of
    16 with 2 kv heads, 4 experts of width 64, top 2, vocab 512, window 8, YaRN RoPE."""
    import transformers

    fields = dict(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                  vocab_size=512, sliding_window=8, max_position_embeddings=512,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                   "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                   "original_max_position_embeddings": 16})
    config = transformers.GptOssConfig(**{**fields, **overrides})
    config.architectures = ["GptOssForCausalLM"]
    return config


def write_tiny_gpt_oss_checkpoint(path: str, config=None, seed: int = 0, dtype: str = "bfloat16"):
    """Write `path`/config.json (with QUANTIZATION_CONFIG) and `path`/model.safetensors: the
    expert matrices of every layer as MXFP4 `<name>_blocks`/`<name>_scales`, every other tensor
    (expert biases included) in `dtype`. No tokenizer.

    Returns the transformers GptOssForCausalLM (float32, eager attention, eval) whose parameters
    are exactly the checkpoint's values: the experts as MXFP4 decodes them, the rest rounded to
    `dtype`. Every weight, bias, norm scale and sink is random (transformers' zeros and ones would
    hide a missing bias or a misplaced norm)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from xlaserve.weights.formats.mxfp4 import decode_mxfp4

    config = config if config is not None else tiny_gpt_oss_config()
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM._from_config(config, attn_implementation="eager")
    stored_dtype = getattr(torch, dtype)
    tensors = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            _randomize(name, param)
            if name.rpartition(".")[2] in EXPERT_MATRICES:
                blocks, scales = encode_mxfp4(param.numpy())
                tensors[name + "_blocks"], tensors[name + "_scales"] = torch.from_numpy(blocks), torch.from_numpy(scales)
                param.copy_(torch.from_numpy(decode_mxfp4(blocks, scales, np.float32)))
            else:
                tensors[name] = param.to(stored_dtype).contiguous()
                param.copy_(tensors[name].float())
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    hf_config = config.to_dict()
    hf_config.update(architectures=["GptOssForCausalLM"], dtype=dtype, quantization_config=QUANTIZATION_CONFIG)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=1)
    return model.float().eval()


def _randomize(name: str, param) -> None:
    import torch

    if "norm" in name:
        param.copy_(1.0 + 0.2 * torch.randn_like(param))
    elif "embed" in name:
        param.copy_(0.5 * torch.randn_like(param))
    elif "router" in name:
        # Decisive routers (logits ~N(0, 4^2)) so bfloat16 picks the same experts as float32.
        param.copy_(0.5 * torch.randn_like(param))
    elif name.endswith("sinks"):
        param.copy_(torch.randn_like(param))
    else:
        param.copy_(0.08 * torch.randn_like(param))
