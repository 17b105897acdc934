"""The mixture-of-experts MLP of Qwen2-MoE, Qwen3-MoE and Mixtral.

A router scores every expert for each token; the top `num_experts_per_tok` run, and their
outputs are summed with the router's weights (softmax over all experts, then the top k,
renormalized to sum to one when `norm_topk_prob`, as Mixtral always does). Qwen2-MoE adds a
shared expert that every token runs, scaled by a sigmoid gate.

The experts run without a loop over experts and without a shape that depends on the routing: the
T x k (token, expert) pairs are sorted by expert, so that each expert's tokens are one contiguous
group, and two grouped matmuls (`Kernels.grouped_matmul`, model/grouped_matmul.py) multiply each
group by its expert's gate|up and down weights. The outputs go back to token order by the inverse
permutation and are summed over k with the router's weights.

Weights: `experts_gate_up [E, hidden, 2, moe_intermediate]` and `experts_down [E,
moe_intermediate, hidden]`, the dense MLP's layout with an expert axis in front; `router
[hidden, E]`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from xlaserve.model.config import ModelConfig
from xlaserve.model.layers import MLP, Kernels, init_weight, linear


def route(router_logits: jax.Array, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """(weights float32 [T, k], experts int32 [T, k]) from float32 router logits [T, E]."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def run_experts(x: jax.Array, weights: jax.Array, experts: jax.Array, gate_up: jax.Array,
                down: jax.Array, kernels: Kernels) -> jax.Array:
    """float32 [T, hidden]: sum over k of weights[t, k] * expert experts[t, k] applied to x[t]."""
    tokens, top_k = experts.shape
    num_experts, hidden, _, intermediate = gate_up.shape
    flat_experts = experts.reshape(-1)
    order = jnp.argsort(flat_experts, stable=True)  # (token, slot) pairs sorted by expert
    group_sizes = jnp.bincount(flat_experts, length=num_experts).astype(jnp.int32)
    sorted_x = x[order // top_k]
    gate_up_out = kernels.grouped_matmul(
        sorted_x, gate_up.reshape(num_experts, hidden, 2 * intermediate), group_sizes)
    activation = kernels.swiglu(gate_up_out.reshape(-1, 2, intermediate), down.dtype)
    sorted_out = kernels.grouped_matmul(activation, down, group_sizes)
    out = sorted_out[jnp.argsort(order)].reshape(tokens, top_k, hidden)
    return jnp.einsum("tkh,tk->th", out, weights)


class MoE(nnx.Module):
    def __init__(self, config: ModelConfig, dtype, rngs: nnx.Rngs):
        c = config
        self.config = c
        self.router = nnx.Param(init_weight(rngs, (c.hidden_size, c.num_experts), dtype))
        self.experts_gate_up = nnx.Param(init_weight(
            rngs, (c.num_experts, c.hidden_size, 2, c.moe_intermediate_size), dtype))
        self.experts_down = nnx.Param(init_weight(
            rngs, (c.num_experts, c.moe_intermediate_size, c.hidden_size), dtype))
        if c.shared_expert_intermediate_size:
            self.shared_expert = MLP(c.hidden_size, c.shared_expert_intermediate_size, dtype, rngs)
            self.shared_expert_gate = nnx.Param(init_weight(rngs, (c.hidden_size, 1), dtype))

    def input_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.experts_gate_up[...].dtype)

    def __call__(self, x: jax.Array, kernels: Kernels) -> jax.Array:
        c = self.config
        weights, experts = route(linear(x, self.router[...], kernels), c.num_experts_per_tok,
                                 c.norm_topk_prob)
        out = run_experts(x, weights, experts, self.experts_gate_up[...], self.experts_down[...],
                          kernels)
        if c.shared_expert_intermediate_size:
            shared_out = self.shared_expert(x.astype(self.shared_expert.input_dtype()), kernels)
            out = out + jax.nn.sigmoid(linear(x, self.shared_expert_gate[...], kernels)) * shared_out
        return out
