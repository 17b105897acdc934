"""The router of a mixture of experts: which experts each token runs, and with what weights.

Qwen-MoE, Mixtral and gpt-oss: a softmax over all experts, the top k, renormalized to sum to one
where `norm_topk_prob`. DeepSeek adds (`RouterConfig`):
- sigmoid scores (V3, `scoring_func: sigmoid`) instead of the softmax (V2);
- group-limited choice: the experts are split into `groups` equal groups, each scored (V2's
  `group_limited_greedy`: its best expert; V3's `noaux_tc`: the sum of its best two), and the
  top k are chosen within the `topk_groups` best groups only;
- V3's `e_score_correction_bias`, added to the scores for the choice alone: the weights are the
  scores of the experts chosen;
- `routed_scaling_factor`, applied to the weights last.
Each reads the way transformers' DeepseekV2TopkRouter / DeepseekV3TopkRouter do (the tests'
oracle), but for V2's `norm_topk_prob`, which DeepSeek's own V2 code applies and transformers'
port ignores (every released V2 checkpoint has it false).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

SCORINGS = ("softmax", "sigmoid")
GROUP_SCORES = ("max", "top2_sum")


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    top_k: int
    normalize: bool  # renormalize the top k weights to sum to one
    scoring: str = "softmax"
    groups: int = 1  # the experts split into this many groups (n_group)
    topk_groups: int = 1  # experts are chosen from this many best groups (topk_group)
    group_score: str = "max"  # a group's score: its best expert's, or the sum of its best two
    correction_bias: bool = False  # a per-expert bias added for the choice only (V3)
    scaling: float = 1.0  # routed_scaling_factor

    def __post_init__(self):
        if self.scoring not in SCORINGS:
            raise ValueError(f"router scoring {self.scoring!r} is not supported "
                             f"(supported: {', '.join(SCORINGS)})")
        if self.group_score not in GROUP_SCORES:
            raise ValueError(f"router group score {self.group_score!r} is not supported")
        if self.groups > 1 and not 0 < self.topk_groups <= self.groups:
            raise ValueError(f"topk_group ({self.topk_groups}) must be between 1 and n_group "
                             f"({self.groups})")


def route(router_logits: jax.Array, config: RouterConfig,
          correction_bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(weights float32 [T, k], experts int32 [T, k]) from router logits [T, E]."""
    logits = router_logits.astype(jnp.float32)
    if config.scoring == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
    choice = scores
    if config.correction_bias:
        choice = scores + correction_bias.astype(jnp.float32)
    if config.groups > 1:
        choice = _best_groups_only(choice, config)
    if choice is scores:
        weights, experts = jax.lax.top_k(scores, config.top_k)
    else:
        _, experts = jax.lax.top_k(choice, config.top_k)
        weights = jnp.take_along_axis(scores, experts, axis=-1)
    if config.normalize:
        # transformers' V3 adds 1e-20 (sigmoid weights may all be ~0); a softmax's top k never are.
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True)
                             + (1e-20 if config.scoring == "sigmoid" else 0.0))
    return weights * config.scaling, experts.astype(jnp.int32)


def _best_groups_only(choice: jax.Array, config: RouterConfig) -> jax.Array:
    """`choice` [T, E] with the experts outside each token's `topk_groups` best groups masked:
    to -inf for V3's choice scores (any value can win there), to 0 for V2's softmax
    probabilities (as transformers masks them)."""
    tokens, num_experts = choice.shape
    grouped = choice.reshape(tokens, config.groups, num_experts // config.groups)
    if config.group_score == "max":
        group_scores = jnp.max(grouped, axis=-1)
    else:
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
    _, best = jax.lax.top_k(group_scores, config.topk_groups)
    keep = jnp.zeros((tokens, config.groups), jnp.bool_).at[
        jnp.arange(tokens)[:, None], best].set(True)
    masked = -jnp.inf if config.correction_bias or config.scoring == "sigmoid" else 0.0
    return jnp.where(keep[:, :, None], grouped, masked).reshape(tokens, num_experts)
