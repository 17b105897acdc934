"""A random EAGLE-3 head for any target, in the checkpoint layout SGLang and vLLM load
(`LlamaForCausalLMEagle3`: `midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`): for timing a
speculative server's steps where no trained head is at hand (bench_speculative.py), and for the
tests (tests/draft_head_models.py). Its drafts are noise: what it measures is the head's cost."""
from __future__ import annotations

import json
import os

import numpy as np


def write_random_eagle3_head(directory: str, *, hidden: int, heads: int, vocab: int,
                             kv_heads: int = 2, intermediate: int | None = None,
                             draft_vocab: int | None = None, capture=None, seed: int = 1) -> dict:
    """Writes the head's config.json and model.safetensors to `directory` and returns
    {"tensors": ..., "config": ...}. RoPE: theta 10000 (not necessarily the target's);
    `capture`: its eagle_aux_hidden_state_layer_ids, layers named by their output (None: the
    head's default, the inputs of layers 2, L/2 and L-3)."""
    from safetensors.numpy import save_file

    head_dim, inter = hidden // heads, intermediate or hidden * 3 // 2
    draft_vocab = draft_vocab or vocab
    rng = np.random.default_rng(seed)

    def w(*shape, scale=0.08):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    # Draft id i -> target id: a spread-out subset of the vocabulary (d2t holds the offsets).
    targets = np.sort(rng.choice(vocab, draft_vocab, replace=False))
    tensors = {
        "fc.weight": w(hidden, 3 * hidden),
        "midlayer.input_layernorm.weight": 1 + w(hidden, scale=0.2),
        "midlayer.hidden_norm.weight": 1 + w(hidden, scale=0.2),
        "midlayer.post_attention_layernorm.weight": 1 + w(hidden, scale=0.2),
        "midlayer.self_attn.q_proj.weight": w(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": w(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": w(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": w(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": w(inter, hidden),
        "midlayer.mlp.up_proj.weight": w(inter, hidden),
        "midlayer.mlp.down_proj.weight": w(hidden, inter),
        "norm.weight": 1 + w(hidden, scale=0.2),
        "lm_head.weight": w(draft_vocab, hidden, scale=0.3),
        "d2t": (targets - np.arange(draft_vocab)).astype(np.int64),
        "t2d": np.isin(np.arange(vocab), targets),
    }
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
              "hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "num_hidden_layers": 1, "rms_norm_eps": 1e-6,
              "vocab_size": vocab, "draft_vocab_size": draft_vocab, "rope_theta": 10000.0,
              "max_position_embeddings": 8192, "target_hidden_size": hidden}
    if capture is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(capture)}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return {"tensors": tensors, "config": config}
