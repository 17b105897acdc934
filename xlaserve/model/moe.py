"""The mixture-of-experts MLP of Qwen2-MoE, Qwen3-MoE, Mixtral, gpt-oss and DeepSeek-V2/V3, and
Gemma 4's MoE block beside its dense MLP (`ExpertsBesideMlp`).

A router scores every expert for each token; the top `num_experts_per_tok` run, and their
outputs are summed with the router's weights (model/routing.py: softmax over all experts, then
the top k, renormalized to sum to one when `norm_topk_prob`, as Mixtral and gpt-oss always do;
DeepSeek's sigmoid scores, expert groups, choice bias and scale). Qwen2-MoE adds a shared expert
that every token runs, scaled by a sigmoid gate; DeepSeek's shared experts are one ungated MLP.
gpt-oss adds biases (router, gate|up, down) and clamps its SwiGLU (`clamped_swiglu`).

The experts run without a loop over experts and without a shape that depends on the routing: the
T x k (token, expert) pairs are sorted by expert, so that each expert's tokens are one contiguous
group, and two grouped matmuls (`grouped_matmul`: `Kernels.grouped_matmul`,
model/grouped_matmul.py, or on a single CPU device the native one over packed experts) multiply
each group by its expert's gate|up and down weights. The outputs go back to token order by the
inverse permutation and are summed over k with the router's weights.

Weights: `experts_gate_up [E, hidden, 2, moe_intermediate]` and `experts_down [E,
moe_intermediate, hidden]`, the dense MLP's layout with an expert axis in front; `router
[hidden, E]`; gpt-oss's `router_bias [E]`, `experts_gate_up_bias [E, 2, moe_intermediate]` and
`experts_down_bias [E, hidden]`; DeepSeek-V3's `router_correction_bias [E]` (float32).
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from xlaserve.model.config.model_config import ModelConfig
from xlaserve.model.layers import (MLP, Kernels, ReluSquaredMLP, RMSNorm, init_weight, linear,
                                   matmul_input_dtype, rms_norm)
from xlaserve.model.weight_types.mxfp4_experts import Mxfp4Experts
from xlaserve.model.weight_types.mxfp4_experts import partition_specs as mxfp4_partition_specs
from xlaserve.model.weight_types.packed import PackedExperts
from xlaserve.model.routing import route
from xlaserve.model.sharding import PARTITION_SPECS


def clamped_swiglu(gate_up: jax.Array, out_dtype, *, limit: float, alpha: float) -> jax.Array:
    """gpt-oss's activation for gate_up [T, 2, I]: (clamp(up, -limit, limit) + 1) * g *
    sigmoid(alpha * g), with g = min(gate, limit)."""
    gate = jnp.minimum(gate_up[:, 0], limit)
    up = jnp.clip(gate_up[:, 1], -limit, limit)
    return ((up + 1) * gate * jax.nn.sigmoid(alpha * gate)).astype(out_dtype)


def grouped_matmul(x: jax.Array, weight, group_sizes: jax.Array, kernels: Kernels) -> jax.Array:
    """x [M, K], its rows sorted by expert, times each group's expert of `weight` [E, K, N...]:
    float32 [M, N...flattened], or the weight's dtype where the kernels round projections (GPU:
    the kernel writes it so). `PackedExperts` go to the native grouped GEMM."""
    if isinstance(weight, PackedExperts):
        return kernels.packed_grouped_matmul(x, weight.panels, group_sizes, weight.columns,
                                             weight.layer, weight.bf16_pairs)
    out_dtype = weight.dtype if kernels.round_projections else jnp.float32
    if isinstance(weight, Mxfp4Experts):
        if kernels.mxfp4_grouped_matmul is None:
            raise ValueError("MXFP4 experts are multiplied on GPU only")
        return kernels.mxfp4_grouped_matmul(x, *weight.flat(), group_sizes, out_dtype)
    if weight.ndim == 4 and kernels.gate_up_as_groups:
        return gate_up_as_groups(x, weight, group_sizes, kernels, out_dtype)
    return kernels.grouped_matmul(x, weight.reshape(weight.shape[0], x.shape[1], -1), group_sizes,
                                  out_dtype)


def gate_up_as_groups(x: jax.Array, weight: jax.Array, group_sizes: jax.Array,
                      kernels: Kernels, out_dtype=jnp.float32) -> jax.Array:
    """`grouped_matmul` of gate_up [E, K, 2, I] as one of [2E, K, I], gate's experts then up's: a
    view XLA lays out in place (the weight's 2 axis major), where [E, K, 2I] was a copy of the
    whole weight every step on TPU (Qwen3-30B-A3B, v6e: 805 MB a layer). Each of the groups'
    `total` rows goes through both halves: rows [0, total) of the doubled x for gate, [total,
    2 total) for up, the rest past the groups (expert parallelism's other pairs)."""
    rows = x.shape[0]
    experts, k, two, n = weight.shape
    total = jnp.sum(group_sizes)
    doubled = jnp.arange(two * rows)
    source = jnp.where(doubled < total, doubled, jnp.minimum(doubled - total, rows - 1))
    out = kernels.grouped_matmul(x[source], weight.transpose(2, 0, 1, 3).reshape(-1, k, n),
                                 jnp.concatenate([group_sizes] * two), out_dtype)
    up = out[jnp.minimum(jnp.arange(rows) + total, two * rows - 1)]
    return jnp.stack([out[:rows], up], axis=1).reshape(rows, -1)


def run_experts(x: jax.Array, weights: jax.Array, experts: jax.Array, expert_weights: dict,
                kernels: Kernels, activation: Callable, first_expert=0) -> jax.Array:
    """float32 [T, hidden]: sum over k of weights[t, k] * expert experts[t, k] applied to x[t],
    without the down projection's bias, for the experts held here: `first_expert` onwards, as
    many as `expert_weights` holds (all of them without expert parallelism); pairs routed
    elsewhere add nothing. `expert_weights`: experts_gate_up, experts_down, and
    experts_gate_up_bias where the model has it."""
    gate_up, down = expert_weights["experts_gate_up"], expert_weights["experts_down"]
    tokens, top_k = experts.shape
    num_experts, hidden, _, intermediate = gate_up.shape
    local = experts.reshape(-1) - first_expert
    # Pairs for other devices' experts sort last, as group `num_experts`, which bincount drops:
    # they are rows past sum(group_sizes), which no expert multiplies (TPU's ragged_dot leaves
    # whatever was in them, so they are dropped below).
    held = (local >= 0) & (local < num_experts)
    local = jnp.where(held, local, num_experts)
    order = jnp.argsort(local, stable=True)  # (token, slot) pairs sorted by expert
    group_sizes = jnp.bincount(local, length=num_experts).astype(jnp.int32)
    sorted_x = x[order // top_k]
    if (kernels.grouped_swiglu is not None and activation is kernels.swiglu
            and "experts_gate_up_bias" not in expert_weights
            and not isinstance(gate_up, (PackedExperts, Mxfp4Experts))
            and not kernels.gate_up_as_groups):
        activated = kernels.grouped_swiglu(sorted_x, gate_up, group_sizes,
                                           matmul_input_dtype(down))
    else:
        gate_up_out = grouped_matmul(sorted_x, gate_up, group_sizes, kernels)
        gate_up_out = gate_up_out.reshape(-1, gate_up.shape[2], intermediate)  # 1: no gate
        if "experts_gate_up_bias" in expert_weights:  # rows past the groups: dropped below
            bias = expert_weights["experts_gate_up_bias"].astype(jnp.float32)
            gate_up_out = gate_up_out + jnp.take(bias, local[order], axis=0, mode="clip")
        activated = activation(gate_up_out, matmul_input_dtype(down))
    sorted_out = grouped_matmul(activated, down, group_sizes, kernels)
    out = sorted_out[jnp.argsort(order)].reshape(tokens, top_k, hidden)
    out = jnp.where(held.reshape(tokens, top_k, 1), out, 0.0)
    return jnp.einsum("tkh,tk->th", out, weights)


def expert_parallel(mesh: Mesh) -> Callable:
    """`run_experts` with the experts split over the mesh's "expert" axis (and each expert's
    width over "tensor"): every device runs its own experts on the pairs routed to them, and one
    all-reduce sums the devices' outputs. With an expert axis of 1 (no --ep-size) every device
    holds every expert's slice of the width, and the all-reduce sums the down projection's
    partial products, which is what the dense MLP's split does.

    The tokens need no exchange: attention is tensor-parallel over the same devices, so after its
    output projection's all-reduce every device already holds every token (and routes them all,
    the router being replicated). Dispatch is a local mask, and the combine is the all-reduce of
    [T, hidden] that a tensor-parallel MLP ends with anyway. An all-to-all dispatch and combine
    would only pay where tokens are split across devices (data-parallel attention), which
    xlaserve does not do."""

    def body(x, weights, experts, expert_weights, kernels, activation):
        first_expert = jax.lax.axis_index("expert") * expert_weights["experts_gate_up"].shape[0]
        out = run_experts(x, weights, experts, expert_weights, kernels, activation, first_expert)
        return jax.lax.psum(out, ("expert", "tensor"))

    def sharded(x, weights, experts, expert_weights, kernels, activation):
        specs = {name: mxfp4_partition_specs(name) if isinstance(weight, Mxfp4Experts)
                 else PARTITION_SPECS[name] for name, weight in expert_weights.items()}
        return jax.shard_map(
            functools.partial(body, kernels=kernels, activation=activation), mesh=mesh,
            in_specs=(P(), P(), P(), specs),
            # Unchecked, like the attention kernel's: the CPU grouped matmul's loop carries a
            # replicated zero into a per-device sum, which the check refuses.
            out_specs=P(), check_vma=False)(x, weights, experts, expert_weights)

    return sharded


class MoE(nnx.Module):
    def __init__(self, config: ModelConfig, dtype, rngs: nnx.Rngs):
        c = config
        self.config = c
        self.router = nnx.Param(init_weight(rngs, (c.hidden_size, c.num_experts), dtype))
        # Nemotron-H's experts have no gate (ReLU^2 of up): [E, hidden, 1, I], `relu_squared`.
        self.experts_gate_up = nnx.Param(init_weight(
            rngs, (c.num_experts, c.hidden_size, 1 if c.activation == "relu2" else 2,
                   c.moe_intermediate_size), dtype))
        self.experts_down = nnx.Param(init_weight(
            rngs, (c.num_experts, c.moe_intermediate_size, c.hidden_size), dtype))
        if c.router_bias:
            self.router_bias = nnx.Param(jnp.zeros((c.num_experts,), dtype))
        if c.router_correction_bias:
            self.router_correction_bias = nnx.Param(jnp.zeros((c.num_experts,), jnp.float32))
        if c.expert_bias:
            self.experts_gate_up_bias = nnx.Param(
                jnp.zeros((c.num_experts, 2, c.moe_intermediate_size), dtype))
            self.experts_down_bias = nnx.Param(jnp.zeros((c.num_experts, c.hidden_size), dtype))
        if c.shared_expert_intermediate_size:
            self.shared_expert = (ReluSquaredMLP if c.activation == "relu2" else MLP)(
                c.hidden_size, c.shared_expert_intermediate_size, dtype, rngs)
            if c.shared_expert_gate:
                self.shared_expert_gate = nnx.Param(init_weight(rngs, (c.hidden_size, 1), dtype))

    def input_dtype(self) -> jnp.dtype:
        return matmul_input_dtype(self.experts_gate_up[...])

    def __call__(self, x: jax.Array, kernels: Kernels) -> jax.Array:
        c = self.config
        router_logits = linear(x, self.router[...], kernels)
        if c.router_bias:
            router_logits = router_logits + self.router_bias[...].astype(jnp.float32)
        weights, experts = route(router_logits, c.router, self.router_correction_bias[...]
                                 if c.router_correction_bias else None)
        routed = x
        if c.expert_input_scaled:  # Llama 4: the (top 1) weight scales the input, not the output
            routed = (x.astype(jnp.float32) * weights).astype(x.dtype)
            weights = jnp.ones_like(weights)
        expert_weights = {"experts_gate_up": self.experts_gate_up[...],
                          "experts_down": self.experts_down[...]}
        activation = relu_squared if c.activation == "relu2" else kernels.swiglu
        if c.expert_bias:
            expert_weights["experts_gate_up_bias"] = self.experts_gate_up_bias[...]
        if c.swiglu_limit is not None:
            activation = functools.partial(clamped_swiglu, limit=c.swiglu_limit,
                                           alpha=c.swiglu_alpha)
        out = (kernels.run_experts or run_experts)(routed, weights, experts, expert_weights,
                                                   kernels, activation)
        if c.expert_bias:
            # The down projection's bias, weighted like its expert's output: outside the experts'
            # matmuls, which under --tp-size sum partial products across devices.
            down_bias = self.experts_down_bias[...].astype(jnp.float32)
            out = out + jnp.einsum("tkh,tk->th", down_bias[experts], weights)
        if c.shared_expert_intermediate_size:
            shared_out = self.shared_expert(x.astype(self.shared_expert.input_dtype()), kernels)
            if c.shared_expert_gate:
                shared_out = jax.nn.sigmoid(linear(x, self.shared_expert_gate[...], kernels)) * shared_out
            out = out + shared_out
        return out


class ExpertsBesideMlp(nnx.Module):
    """Gemma 4's MoE block (`enable_moe_block`), run beside the layer's dense MLP: its output
    is norm_1(the MLP's output) + norm_2(the experts' output), whose sum the layer's own
    post-MLP norm then takes (transformers' Gemma4TextDecoderLayer). The experts read the
    residual stream itself, not the MLP's input: the router a weightless RMS norm of it times
    `router_scale` / sqrt(hidden) (softmax over all experts, the top k renormalized, each times
    its `per_expert_scale`), the experts their own RMS norm of it (`input_norm`); GeGLU
    experts, the dense MLP's layout with an expert axis in front."""

    def __init__(self, config: ModelConfig, dtype, rngs: nnx.Rngs):
        c = config
        self.config = c
        hidden, experts = c.hidden_size, c.num_experts
        self.router = nnx.Param(init_weight(rngs, (hidden, experts), dtype))
        self.router_scale = nnx.Param(jnp.ones((hidden,), dtype))
        self.per_expert_scale = nnx.Param(jnp.ones((experts,), dtype))
        self.experts_gate_up = nnx.Param(init_weight(
            rngs, (experts, hidden, 2, c.moe_intermediate_size), dtype))
        self.experts_down = nnx.Param(init_weight(
            rngs, (experts, c.moe_intermediate_size, hidden), dtype))
        self.mlp_norm = RMSNorm(hidden, c.rms_norm_eps, dtype, c.norm_offset)
        self.input_norm = RMSNorm(hidden, c.rms_norm_eps, dtype, c.norm_offset)
        self.output_norm = RMSNorm(hidden, c.rms_norm_eps, dtype, c.norm_offset)

    def __call__(self, residual: jax.Array, mlp_out: jax.Array, kernels: Kernels) -> jax.Array:
        """float32 [T, hidden]: the block's output for the residual stream `residual` [T,
        hidden] beside the dense MLP's output `mlp_out`."""
        c = self.config
        scale = self.router_scale[...].astype(jnp.float32) * c.hidden_size**-0.5
        router_in = rms_norm(residual, scale, c.rms_norm_eps).astype(matmul_input_dtype(
            self.router[...]))
        weights, experts = route(linear(router_in, self.router[...], kernels), c.router)
        weights = weights * self.per_expert_scale[...].astype(jnp.float32)[experts]
        dtype = matmul_input_dtype(self.experts_gate_up[...])
        expert_weights = {"experts_gate_up": self.experts_gate_up[...],
                          "experts_down": self.experts_down[...]}
        out = (kernels.run_experts or run_experts)(self.input_norm(residual).astype(dtype),
                                                   weights, experts, expert_weights, kernels,
                                                   geglu)
        return self.mlp_norm(mlp_out) + self.output_norm(out)


def relu_squared(up: jax.Array, out_dtype) -> jax.Array:
    """Nemotron-H's experts' activation for their ungated up [T, 1, I]: relu(up)^2."""
    return jnp.square(jax.nn.relu(up[:, 0])).astype(out_dtype)


def geglu(gate_up: jax.Array, out_dtype) -> jax.Array:
    """Gemma's activation for gate_up [T, 2, I]: gelu_tanh(gate) * up."""
    return (jax.nn.gelu(gate_up[:, 0], approximate=True) * gate_up[:, 1]).astype(out_dtype)
