"""RoPE's tables in a step: the rows' (cos, sin), computed on the host once per position
(`rope_cos_sin`, runtime/executor/step_inputs.RopeTable) or traced (`traced_rope`), split per
table (`rope_tables`: Gemma's local and global layers read their own); Llama 4's NoPE layers'
query temperature (`attention_temperature`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.model.config.model_config import ModelConfig


def traced_rope(config: ModelConfig, positions) -> tuple[jax.Array, jax.Array]:
    """RoPE's (cos, sin) [T, tables x head_dim / 2] of `positions` by `config` (its tables side
    by side, `ModelConfig.rope_inv_freq`), computed in the program (YaRN's attention factor
    applied; 1.0 for the other kinds): where no host table is sent (step_inputs.RopeTable), as
    for a draft head (draft_heads.py) whose RoPE may differ from its target's."""
    angles = rope_angles(config.rope_inv_freq(), positions)
    scale = config.rope.attention_factor
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def attention_temperature(config: ModelConfig, positions) -> jax.Array | None:
    """float32 [T]: Llama 4's query scale at `positions` in its NoPE layers,
    log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1, as transformers computes it; None
    where the config has none."""
    if config.attention_temperature is None:
        return None
    floor_scale, attn_scale = config.attention_temperature
    steps = jnp.floor((positions.astype(jnp.float32) + 1.0) / floor_scale)
    return jnp.log1p(steps) * attn_scale + 1.0


def rope_tables(cos: jax.Array, sin: jax.Array, widths: tuple[int, ...]
                ) -> list[tuple[jax.Array, jax.Array]]:
    """The step's (cos, sin) rows as one (cos, sin) pair per RoPE table, `widths` pairs each
    (`ModelConfig.rope_widths`; `ModelConfig.rope_table` says which a layer reads); with one
    table, the arrays as they are."""
    if len(widths) == 1:
        return [(cos, sin)]
    bounds = np.cumsum((0,) + tuple(widths))
    return [(cos[:, a:b], sin[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def rope_angles(inv_freq: np.ndarray, positions):
    """float32 [T, head_dim / 2]: position x frequency, traced (jax) or on the host (numpy)."""
    return positions.astype(np.float32)[:, None] * inv_freq[None, :]


def rope_cos_sin(inv_freq: np.ndarray, positions: np.ndarray, attention_factor: float = 1.0
                 ) -> tuple[np.ndarray, np.ndarray]:
    """float32 (cos, sin) [T, head_dim / 2] of the rows at `positions`, on the host, for
    `inv_freq = config.rope_inv_freq()`, both times `config.rope.attention_factor` (YaRN
    scales them, as transformers does). Inside a step, XLA's CPU fusion recomputed cos
    and sin in every layer's RoPE fusion, for every head (~3M sincos per 128-row step of the
    default model, 4% of it); as step inputs they are computed once. The angles are the traced
    version's float32 products; cos and sin are taken in float64 and rounded, then scaled in
    float32 like transformers' `cos() * attention_scaling`."""
    angles = rope_angles(inv_freq, positions).astype(np.float64)
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    if attention_factor != 1.0:
        cos *= np.float32(attention_factor)
        sin *= np.float32(attention_factor)
    return cos, sin
