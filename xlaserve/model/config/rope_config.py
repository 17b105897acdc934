"""RopeConfig: a model's rotary position embedding as its Hugging Face config sets it (the
default, linear, Llama 3.1 and YaRN scalings; Qwen-VL's multimodal sections), and the per-pair
frequencies transformers computes from it (`RopeConfig.inv_freq`). ModelConfig.from_hf reads it
with `rope_from_hf`; DeepSeek's latent attention scales its softmax by `yarn_mscale`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3 | yarn | proportional
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN only: the ramp between extrapolated (fast) and interpolated (slow) frequencies, in
    # rotations over the original context; `truncate` rounds its ends to whole dimensions.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    # YaRN's cos/sin scale as the config gives it (None: derived from `factor`, with DeepSeek's
    # mscale / mscale_all_dim when both are set); see `attention_factor`.
    configured_attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    # Multimodal RoPE (Qwen2-VL, Qwen2.5-VL): the rotation pairs' split among the temporal,
    # height and width positions (each token has three; a text token's are equal, so its RoPE
    # is the plain one); () for a plain RoPE. runtime/executor/step_inputs.RopeTable applies it.
    mrope_section: tuple[int, ...] = ()
    # Qwen3-VL: the pairs' axes interleaved (t, h, w, t, h, w, ...: pair j takes height where
    # j % 3 == 1 and j < 3 x section[1], width likewise, else time) instead of in sections.
    mrope_interleaved: bool = False
    # "proportional" (Gemma 4's full layers): the first `rotary_fraction` of each head's pairs
    # rotate at theta ** (-2j / head_dim), the rest not at all (frequency 0); all over `factor`.
    rotary_fraction: float = 1.0
    # transformers' partial_rotary_factor of the other kinds (Qwen3.5, Qwen3-Next: 0.25): RoPE
    # over each head's first `partial_rotary` x head_dim rows alone, at the frequencies of a head
    # that wide; the rest pass through. The weights' rows are reordered at load so that a whole
    # head's rotate-half does it (`partial_rope_rows`): the pairs past those rows rotate at
    # frequency 0 (`inv_freq`'s zeros), which is the identity.
    partial_rotary: float = 1.0

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """Per-pair rotation frequencies, float32, the way transformers computes them."""
        if self.partial_rotary != 1.0:  # the rotated rows' own frequencies, then zeros
            rotated = dataclasses.replace(self, partial_rotary=1.0).inv_freq(
                partial_rotary_dims(head_dim, self.partial_rotary))
            return np.concatenate([rotated, np.zeros(head_dim // 2 - len(rotated), np.float32)])
        exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
        pos_freqs = self.theta ** exponents
        inv_freq = 1.0 / pos_freqs
        if self.kind == "linear":
            inv_freq = inv_freq / self.factor
        elif self.kind == "llama3":
            inv_freq = _llama3_scale(inv_freq, self)
        elif self.kind == "yarn":
            inv_freq = _yarn_blend(pos_freqs, head_dim, self)
        elif self.kind == "proportional":
            rotated = int(self.rotary_fraction * head_dim // 2)
            inv_freq = np.where(np.arange(head_dim // 2) < rotated, inv_freq, 0) / self.factor
        return inv_freq.astype(np.float32)

    @property
    def attention_factor(self) -> float:
        """What transformers multiplies cos and sin by (YaRN's "mscale"); 1.0 but for YaRN."""
        if self.kind != "yarn":
            return 1.0
        if self.configured_attention_factor is not None:
            return float(self.configured_attention_factor)
        if self.mscale and self.mscale_all_dim:
            return float(yarn_mscale(self.factor, self.mscale)
                         / yarn_mscale(self.factor, self.mscale_all_dim))
        return yarn_mscale(self.factor)


def partial_rotary_dims(head_dim: int, fraction: float) -> int:
    """The rows of a head of `head_dim` that RoPE rotates at `partial_rotary_factor` `fraction`
    (transformers' int(head_dim * fraction)); ValueError where that is odd or none."""
    dims = int(head_dim * fraction)
    if dims <= 0 or dims % 2:
        raise ValueError(f"partial_rotary_factor {fraction} of head_dim {head_dim}: {dims} rows, "
                         "not an even number of them")
    return dims


def partial_rope_rows(head_dim: int, fraction: float) -> np.ndarray:
    """The order to store a head's rows in (q's and k's alike, so q . k is unchanged) so that
    rotating whole-head halves does what transformers' partial RoPE does over the first R rows:
    its pairs (j, j + R/2) become (j, j + head_dim/2), and the rows it leaves alone fill the
    pairs whose frequency is 0 (`RopeConfig.inv_freq`)."""
    rotated = partial_rotary_dims(head_dim, fraction)
    half, passed = rotated // 2, np.arange(rotated, head_dim)
    rest = head_dim // 2 - half
    return np.concatenate([np.arange(half), passed[:rest], np.arange(half, rotated),
                           passed[rest:]])


def _llama3_scale(inv_freq: np.ndarray, rope: RopeConfig) -> np.ndarray:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    # Equal factors (Llama 4 Scout's 1.0 and 1.0) leave no band: its blend divides by zero, and
    # no pair takes it (is_medium only where a wavelength equals old_len exactly, as transformers).
    with np.errstate(divide="ignore", invalid="ignore"):
        smooth = ((old_len / wavelen - rope.low_freq_factor)
                  / (rope.high_freq_factor - rope.low_freq_factor))
        blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, blended, scaled)


def _yarn_blend(pos_freqs: np.ndarray, head_dim: int, rope: RopeConfig) -> np.ndarray:
    # YaRN (transformers' _compute_yarn_parameters, same float32 operations in the same order):
    # pairs that turn more than beta_fast times over the original context keep their frequency
    # (extrapolation), those that turn fewer than beta_slow times are slowed by `factor`
    # (interpolation), and a linear ramp over the pair index blends the two between.
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (rope.factor * pos_freqs)
    low = _yarn_correction_dim(rope.beta_fast, head_dim, rope)
    high = _yarn_correction_dim(rope.beta_slow, head_dim, rope)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    return interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight


def _yarn_correction_dim(num_rotations: float, head_dim: int, rope: RopeConfig) -> float:
    """The (fractional) pair index whose pair turns `num_rotations` times over the original
    context."""
    turns = rope.original_max_position_embeddings / (num_rotations * 2 * math.pi)
    return head_dim * math.log(turns) / (2 * math.log(rope.theta))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    # The YaRN paper's attention temperature, sqrt(1/t) = 0.1 ln(s) + 1.
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_from_hf(hf_config: Any, layer_type: str = "full_attention") -> RopeConfig:
    """The RopeConfig of a `transformers.PretrainedConfig` (ModelConfig.from_hf's `rope`); where
    the config gives one RoPE per kind of layer (transformers 5's Gemma 3: `rope_parameters`
    keyed by "full_attention" and "sliding_attention"), that of `layer_type`."""
    # transformers >= 5 folds rope_theta and rope_scaling into `rope_parameters`; older configs
    # (and older transformers) keep them apart.
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if isinstance(params.get("full_attention"), dict):
        params = dict(params.get(layer_type) or params["full_attention"])
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    if not params:
        params = dict(scaling)
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "mrope":  # older Qwen2-VL configs: the default RoPE, split by mrope_section
        kind = "default"
    partial = float(params.get("partial_rotary_factor")
                    or getattr(hf_config, "partial_rotary_factor", None) or 1.0)
    if partial != 1.0 and kind not in ("default", "proportional"):
        raise ValueError(f"partial_rotary_factor {partial} with rope type {kind!r} is not "
                         "supported (only with the default RoPE)")
    if kind not in _ROPE_KINDS:
        raise ValueError(f"rope type {kind!r} is not supported "
                         f"(supported: {', '.join(_ROPE_KINDS)})")
    fields = dict(
        theta=float(params.get("rope_theta", 10000.0)),
        kind=kind,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        mrope_section=tuple(int(n) for n in params.get("mrope_section", ())),
    )
    if kind == "proportional":
        fields.update(rotary_fraction=partial)
    elif partial != 1.0:
        fields.update(partial_rotary=partial)
    if kind == "yarn":
        fields.update(_yarn_fields(params, hf_config))
    else:
        fields.update(factor=float(params.get("factor", 1.0)), original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", 8192)))
    return RopeConfig(**fields)


_ROPE_KINDS = ("default", "linear", "llama3", "yarn", "proportional")


def _yarn_fields(params: dict, hf_config: Any) -> dict:
    """RopeConfig's YaRN fields, read the way transformers' _compute_yarn_parameters reads them."""
    max_positions = getattr(hf_config, "max_position_embeddings", None)
    # transformers' standardize_rope_params: a top-level original_max_position_embeddings (Phi-3
    # style) wins, else the rope dict's, else max_position_embeddings (transformers >= 5 has
    # already done it in rope_parameters; repeated for older ones).
    original = (getattr(hf_config, "original_max_position_embeddings", None)
                or params.get("original_max_position_embeddings") or max_positions)
    factor = params["factor"]  # transformers' config refuses a yarn dict without one
    if factor is None:  # DeepSeek-V3 style: the ratio of the extended to the original context
        factor = max_positions / original
    return dict(
        factor=float(factor), original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32),  # `or`: 0 or None is the default there too
        beta_slow=float(params.get("beta_slow") or 1),
        truncate=bool(params.get("truncate", True)),
        configured_attention_factor=_float_or_none(params.get("attention_factor")),
        mscale=_float_or_none(params.get("mscale")),
        mscale_all_dim=_float_or_none(params.get("mscale_all_dim")))


def _float_or_none(value) -> float | None:
    return None if value is None else float(value)
