"""One Flax NNX decoder for the Llama family (Llama, Mistral, Qwen2, Qwen3), switched by config.

The forward pass works on a packed ragged batch: the new tokens of every sequence in one array,
with the attention metadata saying which tokens belong to which sequence and where each
sequence's pages are. The same code therefore serves prefill, decode and mixed batches, and
writes the new K/V into the paged cache as it goes.

Weight layouts are chosen for speed and for tensor parallelism:
- q, k and v are one matrix `qkv [hidden, kv_heads, queries_per_kv + 2, head_dim]`: one GEMM
  instead of three (measurably faster on CPU), and sharding its kv-head axis keeps each query head
  on the same device as the kv head it reads.
- gate and up are one matrix `gate_up [hidden, 2, intermediate]`, sharded on `intermediate`.
Layers are a Python loop (unrolled in the trace): a `lax.scan` over stacked layers was measured
2.4x slower for batch-1 decode on CPU.

Precision: weights and the KV cache are in the model dtype; the residual stream, norms, RoPE and
softmax statistics are float32, and every matmul takes model-dtype inputs with float32
accumulation (`linear`). With bfloat16 weights that is the usual mixed precision, and on XLA's
CPU backend it is what makes bfloat16 fast: a bfloat16 x bfloat16 -> float32 dot runs on the
CPU's bfloat16 instructions (1.9x float32 at 128 rows), where a dot with a bfloat16 output made
XLA convert every weight to float32 on every step.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from xlaserve.model.config import ModelConfig
from xlaserve.model.packed import PackedMatrix, embed, output_axes


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttentionMetadata:
    """Where each sequence's new tokens and cached pages are (docs/architecture.md, the kernel contract)."""

    kv_lens: jax.Array  # i32[S] full length of each sequence, new tokens included
    page_indices: jax.Array  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array  # i32[S+1] start of each sequence's new tokens in the packed batch
    num_seqs: jax.Array  # i32[1] live rows of the S padded ones


# Partition spec of every parameter, by its leaf name; mesh axes are ("data", "tensor").
PARTITION_SPECS = {
    "embedding": P("tensor", None),
    "qkv": P(None, "tensor", None, None),
    "qkv_bias": P("tensor", None, None),
    "o_proj": P("tensor", None, None),
    "o_bias": P(),
    "gate_up": P(None, None, "tensor"),
    "down": P("tensor", None),
    "lm_head": P(None, "tensor"),
    "scale": P(),
}
# The KV cache of one layer, [num_pages, page_size, 2 * kv_heads * head_dim] (kv_cache_shape),
# split by kv head: each device holds the K|V pairs of its own heads, contiguous.
KV_CACHE_SPEC = P(None, None, "tensor")


def _init(rngs: nnx.Rngs, shape, dtype) -> jax.Array:
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
    `(x [M, K], panels, N, layer, bf16_pairs) -> float32 [M, N]` (model/packed.py); and the
    residual stream's norms, `rms_norm(x, scale, eps, out_dtype)` and `add_rms_norm(x, delta,
    scale, eps, out_dtype) -> (x + delta, its norm)`, the attention's inputs `qkv_rope(qkv, cos,
    sin, out_dtype) -> (q, k, v)` and the MLP's `swiglu(gate_up, out_dtype)` (native ones on the
    CPU: native/norm_cpu.py, native/qkv_rope_cpu.py, native/swiglu_cpu.py)."""

    attention: Callable
    packed_matmul: Callable | None = None
    # `(x, panels, N, layer, bf16_pairs, out_dtype) -> swiglu(x @ W)` for a packed gate_up
    packed_matmul_swiglu: Callable | None = None
    rms_norm: Callable = rms_norm_xla
    add_rms_norm: Callable = add_rms_norm_xla
    qkv_rope: Callable = qkv_rope_xla
    swiglu: Callable = swiglu_xla


def matmul_input_dtype(weight) -> jnp.dtype:
    """The dtype `linear` gives x before multiplying it by `weight`: a norm in front of the matmul
    rounds to it directly."""
    if isinstance(weight, PackedMatrix):
        return jnp.dtype(jnp.bfloat16 if weight.bf16_pairs else jnp.float32)
    return jnp.dtype(weight.dtype)


def linear(x: jax.Array, weight, kernels: Kernels, transposed: bool = False) -> jax.Array:
    """x [T, K] @ weight -> float32 [T, *output axes]: the weight's leading axes that multiply to
    K are contracted (or weight [N, K] is used as weight.T). Inputs go in the weight's dtype with
    float32 accumulation. A `PackedMatrix` goes to the native GEMM. Otherwise the weight is used
    as a 2-d matrix (a free reshape): XLA's CPU layout pass transposed a whole 3-d o_proj weight
    every step for a 3-d einsum."""
    rows, k = x.shape
    if isinstance(weight, PackedMatrix):
        y = kernels.packed_matmul(x, weight.panels, weight.columns, weight.layer, weight.bf16_pairs)
        return y.reshape(rows, *weight.output_axes)
    if transposed:
        # Contracting the weight's last axis directly: with an explicit `.T`, XLA converted the
        # whole bfloat16 tied embedding to float32 on every step (28 ms at 128 rows).
        return jax.lax.dot_general(x.astype(weight.dtype), weight, (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)
    axes = output_axes(weight.shape, k)
    y = jax.lax.dot_general(x.astype(weight.dtype), weight.reshape(k, -1), (((1,), (0,)), ((), ())),
                            preferred_element_type=jnp.float32)
    return y.reshape(rows, *axes)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.scale = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps)


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, layer_index: int, dtype, rngs: nnx.Rngs):
        c = config
        self.config = c
        self.sliding_window = c.sliding_windows[layer_index]
        group = c.queries_per_kv
        self.qkv = nnx.Param(_init(rngs, (c.hidden_size, c.num_kv_heads, group + 2, c.head_dim), dtype))
        if c.qkv_bias:
            self.qkv_bias = nnx.Param(jnp.zeros((c.num_kv_heads, group + 2, c.head_dim), dtype))
        self.o_proj = nnx.Param(_init(rngs, (c.num_heads, c.head_dim, c.hidden_size), dtype))
        if c.o_bias:
            self.o_bias = nnx.Param(jnp.zeros((c.hidden_size,), dtype))
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype)

    def __call__(self, x, cos, sin, kv_cache, metadata: AttentionMetadata, kernels: Kernels):
        c = self.config
        qkv = linear(x, self.qkv[...], kernels)
        if c.qkv_bias:
            qkv = qkv + self.qkv_bias[...].astype(jnp.float32)
        num_tokens = x.shape[0]
        # Attention takes its inputs in the cache's dtype (the model dtype).
        if c.qk_norm:  # the norms come between the split and RoPE: XLA's path
            q, k, v = split_qkv(qkv)
            q, k, v = rope_qk(self.q_norm(q), self.k_norm(k), v, cos, sin, kv_cache.dtype)
        else:
            q, k, v = kernels.qkv_rope(qkv, cos, sin, kv_cache.dtype)
        out, kv_cache = kernels.attention(
            q, k, v, kv_cache, metadata.kv_lens, metadata.page_indices, metadata.cu_q_lens,
            metadata.num_seqs, sm_scale=c.head_dim**-0.5, sliding_window=self.sliding_window,
        )
        out = linear(out.reshape(num_tokens, -1), self.o_proj[...], kernels)
        if c.o_bias:
            out = out + self.o_bias[...].astype(jnp.float32)
        return out, kv_cache


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, dtype, rngs: nnx.Rngs):
        self.gate_up = nnx.Param(_init(rngs, (config.hidden_size, 2, config.intermediate_size), dtype))
        self.down = nnx.Param(_init(rngs, (config.intermediate_size, config.hidden_size), dtype))

    def __call__(self, x: jax.Array, kernels: Kernels) -> jax.Array:
        gate_up, down = self.gate_up[...], self.down[...]
        dtype = matmul_input_dtype(down)
        if isinstance(gate_up, PackedMatrix) and kernels.packed_matmul_swiglu is not None:
            activation = kernels.packed_matmul_swiglu(x, gate_up.panels, gate_up.columns,
                                                      gate_up.layer, gate_up.bf16_pairs, dtype)
        else:
            activation = kernels.swiglu(linear(x, gate_up, kernels), dtype)
        return linear(activation, down, kernels)


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, layer_index: int, dtype, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.attn = Attention(config, layer_index, dtype, rngs)
        self.post_attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype, rngs)

    def __call__(self, x, normed, cos, sin, kv_cache, metadata, kernels: Kernels):
        """`x` is the residual stream and `normed` its input norm (`input_rms_norm`), which the
        caller takes together with the residual add in front of it. Returns x + attention, the
        MLP's output (the caller adds it) and the KV cache."""
        attn_out, kv_cache = self.attn(normed, cos, sin, kv_cache, metadata, kernels)
        norm = self.post_attention_norm
        x, normed = kernels.add_rms_norm(x, attn_out, norm.scale[...], norm.eps,
                                         matmul_input_dtype(self.mlp.gate_up[...]))
        return x, self.mlp(normed, kernels), kv_cache

    def input_rms_norm(self, x, delta, kernels: Kernels):
        """(x + delta, input_norm(x + delta)) in the dtype the qkv matmul takes; no add when delta
        is None."""
        norm, dtype = self.input_norm, matmul_input_dtype(self.attn.qkv[...])
        if delta is None:
            return x, kernels.rms_norm(x, norm.scale[...], norm.eps, dtype)
        return kernels.add_rms_norm(x, delta, norm.scale[...], norm.eps, dtype)


class CausalLM(nnx.Module):
    """Decoder-only LM over a paged KV cache. Build it with `nnx.eval_shape` and load real weights
    with `xlaserve.model.loader`; random init is only for tests and shape checks."""

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.embedding = nnx.Param(_init(rngs, (config.vocab_size, config.hidden_size), dtype))
        self.layers = nnx.List(
            [DecoderLayer(config, i, dtype, rngs) for i in range(config.num_layers)]
        )
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if not config.tie_word_embeddings:
            self.lm_head = nnx.Param(_init(rngs, (config.hidden_size, config.vocab_size), dtype))

    def __call__(
        self,
        input_ids: jax.Array,  # i32[T] packed new tokens
        positions: jax.Array,  # i32[T] absolute position of each token in its sequence
        kv_caches: list[jax.Array],  # one [num_pages, page_size, 2*kv_heads*head_dim] per layer
        metadata: AttentionMetadata,
        logits_indices: jax.Array,  # i32[R] rows of the batch whose logits are wanted
        kernels: Kernels,
    ) -> tuple[jax.Array, list[jax.Array]]:
        hidden, new_caches = self.hidden_states(input_ids, positions, kv_caches, metadata, kernels)
        return self.logits(hidden[logits_indices], kernels), new_caches

    def hidden_states(self, input_ids, positions, kv_caches, metadata: AttentionMetadata,
                      kernels: Kernels, rope: tuple[jax.Array, jax.Array] | None = None
                      ) -> tuple[jax.Array, list[jax.Array]]:
        """float32[T, hidden]: the residual stream after the last layer (before the final norm)
        for every token row, and the updated KV caches. Split from `logits` so that a step can
        take the LM head over a few rows (sampling) and, when asked, over all of them (prompt
        logprobs). `rope`: the rows' (cos, sin), `rope_cos_sin(inv_freq, positions)` computed on
        the host; computed here when not given."""
        x = embed(self.embedding[...], input_ids).astype(jnp.float32)
        if rope is None:
            angles = rope_angles(self.config.rope.inv_freq(self.config.head_dim), positions)
            rope = jnp.cos(angles), jnp.sin(angles)
        cos, sin = rope
        new_caches, mlp_out = [], None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, normed = layer.input_rms_norm(x, mlp_out, kernels)
            x, mlp_out, kv_cache = layer(x, normed, cos, sin, kv_cache, metadata, kernels)
            new_caches.append(kv_cache)
        return x + mlp_out, new_caches

    def logits(self, hidden: jax.Array, kernels: Kernels) -> jax.Array:
        """float32[R, V]: final norm and LM head (tied to the embedding or not) of `hidden` rows."""
        x = self.final_norm(hidden)
        if self.config.tie_word_embeddings:
            return linear(x, self.embedding[...], kernels, transposed=True)
        return linear(x, self.lm_head[...], kernels)


def rope_angles(inv_freq: np.ndarray, positions):
    """float32 [T, head_dim / 2]: position x frequency, traced (jax) or on the host (numpy)."""
    return positions.astype(np.float32)[:, None] * inv_freq[None, :]


def rope_cos_sin(inv_freq: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 (cos, sin) [T, head_dim / 2] of the rows at `positions`, on the host, for
    `inv_freq = config.rope.inv_freq(head_dim)`. Inside a step, XLA's CPU fusion recomputed cos
    and sin in every layer's RoPE fusion, for every head (~3M sincos per 128-row step of the
    default model, 4% of it); as step inputs they are computed once. The angles are the traced
    version's float32 products; cos and sin are taken in float64 and rounded."""
    angles = rope_angles(inv_freq, positions).astype(np.float64)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def partition_spec(path: tuple) -> P:
    """The PartitionSpec of the parameter at `path` (a tuple of state keys)."""
    return PARTITION_SPECS[str(path[-1])]


def abstract_model(config: ModelConfig, dtype, model_class=CausalLM) -> CausalLM:
    """The model's structure with ShapeDtypeStruct leaves: no memory, no random numbers."""
    return nnx.eval_shape(lambda: model_class(config, dtype=dtype, rngs=nnx.Rngs(0)))


def abstract_parameters(config: ModelConfig, dtype, mesh, model_class=CausalLM):
    """(graphdef, abstract state, {path: ShapeDtypeStruct of the parameter in `dtype`, with its
    partition spec on `mesh`}): where each weight goes, before any is made, loaded or restored."""
    graphdef, state = nnx.split(abstract_model(config, dtype, model_class))
    parameters = {path: jax.ShapeDtypeStruct(variable.get_value().shape, dtype,
                                             sharding=NamedSharding(mesh, partition_spec(path)))
                  for path, variable in nnx.to_flat_state(state)}
    return graphdef, state, parameters


def kv_cache_shape(config: ModelConfig, num_pages: int, page_size: int) -> tuple[int, ...]:
    """One layer's cache: the attention contract's `[pages, page_size, 2*Hkv, D]` stored flat, as
    `[pages, page_size, 2*Hkv*D]`. Every kernel views it as it needs; this is the TPU kernel's own
    layout, where viewing a 4-D array flat would copy it (TPU arrays are tiled by their last two
    dims). On CPU and GPU, layouts are dense and any view is free."""
    return (num_pages, page_size, 2 * config.num_kv_heads * config.head_dim)


def param_count(state: nnx.State) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(state)))
