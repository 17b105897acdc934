"""The building blocks every decoder shares: norms, RoPE, the matmul (`linear`), the SwiGLU MLP,
and `Kernels`, the platform's implementations the forward pass calls (runtime/executor/kernels.py picks
them). Pure functions of arrays, and two small modules.

Precision: matmuls take model-dtype inputs with float32 accumulation; norms, RoPE and the
activation work in float32 (transformer.py says why); on GPU the projections' outputs are rounded
to the model dtype (`project`).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from xlaserve.model.grouped_matmul import grouped_matmul_ragged_dot
from xlaserve.model.weight_types.fp8_weights import (FP8_TYPES, Fp8Matrix, fp8_block_linear,
                                                     fp8_matmul)
from xlaserve.model.weight_types.int8 import Int8Matrix
from xlaserve.model.weight_types.packed import PackedExperts, PackedMatrix, output_axes
from xlaserve.model.weight_types.quantized_rows import QuantizedLinear, quantized_linear
from xlaserve.native import quantized_gemm_cpu
from xlaserve.pallas_kernels.ragged_paged_attention.new_tokens import reference_new_token_attention
from xlaserve.pallas_kernels.linear_attention.reference import (
    gated_delta_rule as gated_delta_rule_reference)
from xlaserve.pallas_kernels.ragged_paged_attention.reference import mla_ragged_paged_attention
from xlaserve.pallas_kernels.mamba2.reference import mamba2_ssm as mamba2_ssm_reference


def init_weight(rngs: nnx.Rngs, shape, dtype) -> jax.Array:
    """Random init: only for tests and shape checks (real weights come from the loader)."""
    return 0.02 * jax.random.normal(rngs.params(), shape, dtype)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """float32 in, float32 out."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return scale.astype(jnp.float32) * normed


def rms_norm_xla(x: jax.Array, scale: jax.Array, eps: float, out_dtype) -> jax.Array:
    return rms_norm(x, scale, eps).astype(out_dtype)


def add_rms_norm_xla(x: jax.Array, delta: jax.Array, scale: jax.Array, eps: float,
                     out_dtype) -> tuple[jax.Array, jax.Array]:
    total = x + delta
    return total, rms_norm(total, scale, eps).astype(out_dtype)


def norm_by_rows(row_norm: Callable, x: jax.Array, scale, eps: float) -> jax.Array:
    """`rms_norm(x [..., D], scale, eps)` through a kernel of `rms_norm_xla`'s contract over
    [rows, D] (one whose rows do not depend on one another: --enable-deterministic-inference)."""
    scale = jnp.broadcast_to(jnp.asarray(scale, jnp.float32), x.shape[-1:])
    rows = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    return row_norm(rows, scale, eps, jnp.float32).reshape(x.shape)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (the transformers layout); x [T, H, D], cos/sin [T, D/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos = cos[:, None, :]
    sin = sin[:, None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def split_qkv(qkv: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """qkv [T, kv_heads, group + 2, D] -> q [T, heads, D], k and v [T, kv_heads, D]."""
    tokens, kv_heads, width, d = qkv.shape
    q = qkv[:, :, :width - 2, :].reshape(tokens, kv_heads * (width - 2), d)
    return q, qkv[:, :, width - 2, :], qkv[:, :, width - 1, :]


def rope_qk(q, k, v, cos: jax.Array, sin: jax.Array, out_dtype):
    """RoPE on q and k, and all three in `out_dtype` (the attention's inputs)."""
    return (apply_rope(q, cos, sin).astype(out_dtype), apply_rope(k, cos, sin).astype(out_dtype),
            v.astype(out_dtype))


def qkv_rope_xla(qkv: jax.Array, cos: jax.Array, sin: jax.Array, out_dtype):
    """qkv [T, kv_heads, group + 2, D] -> RoPE'd q [T, heads, D], RoPE'd k and v [T, kv_heads, D]."""
    return rope_qk(*split_qkv(qkv), cos, sin, out_dtype)


def swiglu_xla(gate_up: jax.Array, out_dtype) -> jax.Array:
    """silu(gate) * up for gate_up [T, 2, I]."""
    return (jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1]).astype(out_dtype)


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The platform's kernels the forward pass calls: attention (the ragged paged attention
    contract); on a single CPU device, the native GEMM over packed weights,
    `(x [M, K], panels, N, layer, bf16_pairs) -> float32 [M, N]` (model/weight_types/packed.py); and
    the residual stream's norms, `rms_norm(x, scale, eps, out_dtype)` and `add_rms_norm(x, delta,
    scale, eps, out_dtype) -> (x + delta, its norm)`, the attention's inputs `qkv_rope(qkv, cos,
    sin, out_dtype) -> (q, k, v)`, the MLP's `swiglu(gate_up, out_dtype)` (native ones on the
    CPU: native/norm_cpu.py, native/qkv_rope_cpu.py, native/swiglu_cpu.py)."""

    attention: Callable
    # Multi-head latent attention (model/mla.py): reference.mla_ragged_paged_attention's contract
    latent_attention: Callable = mla_ragged_paged_attention
    # MLA's expanded form for steps of at least `mla_expanded_prefill_tokens` tokens (0: never):
    # `latent_prefix_attention` is latent_attention with prefix_only (out, lse, cache; also what
    # a speculative tree row's latent attention starts from), and
    # `new_token_attention(q, k, v, cu_q_lens, num_seqs, sm_scale=)` -> (out, lse), new_tokens.py
    mla_expanded_prefill_tokens: int = 0
    latent_prefix_attention: Callable | None = None
    new_token_attention: Callable | None = None
    packed_matmul: Callable | None = None
    # `(x [T, K], weight [K, N] (or [N, K] with transposed=True)) -> float32 [T, N]` for plain
    # weights; None: XLA's dot (--enable-deterministic-inference on TPU and GPU: the
    # batch-invariant Pallas matmul, pallas_kernels/invariant_matmul.py)
    dense_matmul: Callable | None = None
    # A module's RMSNorm over its input's last axis, `(x [..., D], scale, eps) -> float32`: the
    # q and k norms, Gemma's sandwich norms (`RMSNorm.__call__` given the kernels)
    module_norm: Callable = rms_norm
    # --enable-deterministic-inference: each row's result does not depend on the step's other
    # rows (the packed GEMMs' Invariant tiles; the sampler's reductions row by row).
    deterministic: bool = False
    # `(x, panels, N, layer, bf16_pairs, out_dtype) -> swiglu(x @ W)` for a packed gate_up
    packed_matmul_swiglu: Callable | None = None
    rms_norm: Callable = rms_norm_xla
    add_rms_norm: Callable = add_rms_norm_xla
    qkv_rope: Callable = qkv_rope_xla
    swiglu: Callable = swiglu_xla
    # `(x [M, K], weights [E, K, N], group_sizes i32[E], out_dtype=float32) -> [M, N]`: rows
    # sorted by group, group g multiplied by weights[g] (the experts of a mixture-of-experts
    # layer, model/moe.py)
    grouped_matmul: Callable = grouped_matmul_ragged_dot
    # `(x [M, K], gate_up [E, K, 2, I], group_sizes, out_dtype) -> silu(x @ gate) * (x @ up)
    # [M, I]`: the experts' gate_up product with the SwiGLU fused (GPU); None: two steps
    grouped_swiglu: Callable | None = None
    # `(x, blocks, scales, group_sizes, out_dtype) -> [M, N]` over experts kept in MXFP4
    # (`mxfp4_experts.Mxfp4Experts`, decoded in the kernel): the GPU's; None elsewhere
    mxfp4_grouped_matmul: Callable | None = None
    # The same over packed experts (`PackedExperts`), on a single CPU device: `(x, panels,
    # group_sizes, N, layer, bf16_pairs) -> float32 [M, N]` (native/gemm_cpu.py)
    packed_grouped_matmul: Callable | None = None
    # The experts' gate_up [E, K, 2, I] multiplied as 2E groups of [K, I] (the rows twice),
    # not as [E, K, 2I]: on TPU the [E, K, 2, I] weight's tiled layout made that view a
    # relayout of the whole weight every step (model/moe.py).
    gate_up_as_groups: bool = False
    # TPU: a LoRA adapter's product added to a projection's output apart from the matmul (an
    # optimization barrier): fused into qkv's matmul, it had the v6e step relay 31 of
    # Llama-3.1-8B's 32 qkv weights out every step (tp 4, 64 rows: 14.4 GB moved against 11.3
    # apart and 10.0 without LoRA; XLA's cost analysis, docs/performance.md).
    lora_add_apart: bool = False
    # The experts on a mesh of several devices (`moe.expert_parallel(mesh)`, each device on its
    # own experts and its slice of their width); None: `moe.run_experts` on one device.
    run_experts: Callable | None = None
    # `(x [T, K], values f8 [N, K], scales f32 [K blocks, N], block_k) -> float32 [T, N]` for an
    # FP8 checkpoint's block-scaled weights (fp8_weights.Fp8BlockMatrix), on a single GPU
    # (pallas_kernels/fp8_block_matmul.py); None where they are dequantized at load instead.
    fp8_block_matmul: Callable | None = None
    # GPU: the projections' outputs (`project`) rounded to the model dtype, as PyTorch's
    # bfloat16 linear layers give them (transformers, SGLang, vLLM): XLA writes them from the
    # matmul in that dtype. A 256-row Llama-3.1-8B step wrote gate_up's [256, 28672] output in
    # float32 and read it back, 59 MB a layer (docs/tpu-gpu.md). The CPU keeps float32 outputs:
    # its native GEMM writes float32, and XLA's CPU dot with a bfloat16 output converted every
    # weight to float32 each step (transformer.py).
    round_projections: bool = False
    # An encoder's attention (model/encoders/encoder.py), each token against its whole sequence:
    # `(q, k, v, cu_q_lens, num_seqs, sm_scale=, window=0) -> (out float32, lse or None)`,
    # new_tokens.py's attention with causal=False on the platform's kernel (the CPU's native
    # one, bidirectional_cpu.py, gives no lse).
    bidirectional_attention: Callable = functools.partial(reference_new_token_attention,
                                                          causal=False)
    # A hybrid model's Gated DeltaNet layers (model/linear_attention.py): the gated delta rule
    # over a ragged step and its state pool, pallas_kernels/linear_attention/reference.py's
    # contract (the CPU's native kernel: kernel_cpu.py)
    gated_delta_rule: Callable = gated_delta_rule_reference
    # Nemotron-H's Mamba-2 layers (model/mamba2.py): the selective scan over a ragged step and
    # its state pool, pallas_kernels/mamba2/reference.py's (the reference on every platform).
    mamba2_ssm: Callable = mamba2_ssm_reference


def matmul_input_dtype(weight) -> jnp.dtype:
    """The dtype `linear` gives x before multiplying it by `weight`: a norm in front of the matmul
    rounds to it directly."""
    if isinstance(weight, (PackedMatrix, PackedExperts)):
        return jnp.dtype(jnp.bfloat16 if weight.bf16_pairs else jnp.float32)
    if isinstance(weight, (Int8Matrix, *FP8_TYPES)):
        return jnp.dtype(weight.compute_dtype)
    if isinstance(weight, QuantizedLinear):  # dequantized exactly, multiplied in float32
        return jnp.dtype(jnp.float32)
    return jnp.dtype(weight.dtype)


def project(x: jax.Array, weight, kernels: Kernels, lora=None, name: str = "") -> jax.Array:
    """A layer's projection: `linear`, plus what the rows' LoRA adapters add to projection
    `name` (`lora`: the layer's model/lora.LayerLora, or None), rounded to the weight's compute
    dtype where the kernels say so (`Kernels.round_projections`), float32 otherwise. Routers and
    the LM head stay `linear` (float32): they choose experts and tokens."""
    y = linear(x, weight, kernels)
    if lora is not None and (delta := lora.delta(name, x, y.shape[1:])) is not None:
        y = (jax.lax.optimization_barrier(y) if kernels.lora_add_apart else y) + delta
    return y.astype(matmul_input_dtype(weight)) if kernels.round_projections else y


def linear(x: jax.Array, weight, kernels: Kernels, transposed: bool = False) -> jax.Array:
    """x [T, K] @ weight -> float32 [T, *output axes]: the weight's leading axes that multiply to
    K are contracted (or weight [N, K] is used as weight.T). Inputs go in the weight's dtype with
    float32 accumulation. A `PackedMatrix` goes to the native GEMM, a `QuantizedLinear` to the
    native quantized GEMM (weight_types/quantized_rows.py); an `Int8Matrix` (weight_types/int8.py)
    is converted to the model dtype inside the dot, whose float32 result is scaled per column;
    FP8 weights (weight_types/fp8_weights.py) multiply FP8-quantized activations.
    Otherwise the weight's contracted axes are merged into one (a free reshape: XLA's CPU layout
    pass transposed a whole 3-d o_proj weight every step for a 3-d einsum) and its output axes
    are kept: gate_up [K, 2, I] is split over I, and merging 2 and I made XLA gather the whole
    weight onto every device each step (Llama-3.1-8B on v6e, tp 4: 34 all-gathers a step, 2
    after)."""
    rows, k = x.shape
    if isinstance(weight, QuantizedLinear):  # rows of quantized blocks, [N, K] either way
        return quantized_linear(x, weight, quantized_gemm_cpu.quantized_matmul)
    if isinstance(weight, PackedMatrix):
        y = kernels.packed_matmul(x, weight.panels, weight.columns, weight.layer, weight.bf16_pairs)
        return y.reshape(rows, *weight.output_axes)
    if transposed:
        if kernels.dense_matmul is not None:
            return kernels.dense_matmul(x, weight, transposed=True)
        # Contracting the weight's last axis directly: with an explicit `.T`, XLA converted the
        # whole bfloat16 tied embedding to float32 on every step (28 ms at 128 rows).
        return jax.lax.dot_general(x.astype(weight.dtype), weight, (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)
    if isinstance(weight, Int8Matrix):
        # The convert feeds the dot: XLA fuses it into the matmul on TPU and GPU, no model-dtype
        # copy of the weight is made (tests/executor/test_compile_int8.py). Output axes kept, as
        # below.
        dtype = jnp.dtype(weight.compute_dtype)
        values = weight.values.reshape(k, *weight.scales.shape).astype(dtype)
        y = jax.lax.dot_general(x.astype(dtype), values, (((1,), (0,)), ((), ())),
                                preferred_element_type=jnp.float32)
        return y * weight.scales
    if isinstance(weight, Fp8Matrix):  # FP8 x FP8 on the tensor cores (weight_types/fp8_weights.py)
        return fp8_matmul(x, weight)
    if isinstance(weight, FP8_TYPES):
        return fp8_block_linear(x, weight, kernels.fp8_block_matmul)
    axes = output_axes(weight.shape, k)
    if kernels.dense_matmul is not None:
        return kernels.dense_matmul(x, weight.reshape(k, -1)).reshape(rows, *axes)
    return jax.lax.dot_general(x.astype(weight.dtype), weight.reshape(k, *axes),
                               (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


class RMSNorm(nnx.Module):
    """`offset`: what the weight is added to before it multiplies (Gemma's 1; 0 elsewhere)."""

    def __init__(self, dim: int, eps: float, dtype, offset: float = 0.0):
        self.scale = nnx.Param(jnp.ones((dim,), dtype))
        self.eps, self.offset = eps, offset

    def __call__(self, x: jax.Array, kernels: Kernels | None = None) -> jax.Array:
        """float32; through `kernels.module_norm` where they are given."""
        norm = rms_norm if kernels is None else kernels.module_norm
        return norm(x, self.factor(), self.eps)

    def factor(self) -> jax.Array:
        """What x / rms(x) is multiplied by: the weight as stored, or offset + weight in float32
        (transformers' Gemma3RMSNorm: `1.0 + weight.float()`)."""
        if not self.offset:
            return self.scale[...]
        return self.scale[...].astype(jnp.float32) + self.offset


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up as one matrix; with `activation`
    "gelu_tanh", GeGLU (Gemma's: GELU's tanh approximation in place of silu)."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype, rngs: nnx.Rngs,
                 activation: str = "silu"):
        self.gate_up = nnx.Param(init_weight(rngs, (hidden_size, 2, intermediate_size), dtype))
        self.down = nnx.Param(init_weight(rngs, (intermediate_size, hidden_size), dtype))
        self.activation = activation

    def input_dtype(self) -> jnp.dtype:
        """The dtype x should come in (the norm in front rounds to it)."""
        return matmul_input_dtype(self.gate_up[...])

    def __call__(self, x: jax.Array, kernels: Kernels, lora=None) -> jax.Array:
        """`lora`: the layer's LoRA adapters (model/lora.LayerLora) or None."""
        gate_up, down = self.gate_up[...], self.down[...]
        dtype = matmul_input_dtype(down)
        fused = lora is None or "gate_up" not in lora.projections  # the adapters' add comes first
        if self.activation == "gelu_tanh":
            both = project(x, gate_up, kernels, lora, "gate_up")
            activation = (jax.nn.gelu(both[:, 0], approximate=True) * both[:, 1]).astype(dtype)
        elif (fused and isinstance(gate_up, PackedMatrix)
                and kernels.packed_matmul_swiglu is not None):
            activation = kernels.packed_matmul_swiglu(x, gate_up.panels, gate_up.columns,
                                                      gate_up.layer, gate_up.bf16_pairs, dtype)
        else:
            activation = kernels.swiglu(project(x, gate_up, kernels, lora, "gate_up"), dtype)
        return project(activation, down, kernels, lora, "down")


class ReluSquaredMLP(nnx.Module):
    """Nemotron-H's MLP: down(relu(up(x))^2), no gate (transformers' NemotronHMLP)."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype, rngs: nnx.Rngs):
        self.up = nnx.Param(init_weight(rngs, (hidden_size, intermediate_size), dtype))
        self.down = nnx.Param(init_weight(rngs, (intermediate_size, hidden_size), dtype))

    def input_dtype(self) -> jnp.dtype:
        return matmul_input_dtype(self.up[...])

    def __call__(self, x: jax.Array, kernels: Kernels, lora=None) -> jax.Array:
        down = self.down[...]
        hidden = jnp.square(jax.nn.relu(project(x, self.up[...], kernels).astype(jnp.float32)))
        return project(hidden.astype(matmul_input_dtype(down)), down, kernels)
