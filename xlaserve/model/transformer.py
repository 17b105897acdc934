"""One Flax NNX decoder for the Llama family (Llama, Mistral, Qwen2, Qwen3) and its mixture-of-experts
kin (Qwen2-MoE, Qwen3-MoE, Mixtral, gpt-oss: moe.py), switched by config; blocks in layers.py.

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
accumulation (`linear`; on GPU the projections' outputs are rounded to the model dtype,
`layers.project`). With bfloat16 weights that is the usual mixed precision, and on XLA's
CPU backend it is what makes bfloat16 fast: a bfloat16 x bfloat16 -> float32 dot runs on the
CPU's bfloat16 instructions (1.9x float32 at 128 rows), where a dot with a bfloat16 output made
XLA convert every weight to float32 on every step.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from xlaserve.model.config.model_config import ModelConfig
from xlaserve.model.weight_types.int8 import check_quantization, quantized_parameters
from xlaserve.model.fp8_kv_cache import is_fp8, quantize, rescaled
from xlaserve.model.layer_parts import feed_forward, state_mixer
from xlaserve.model.layers import (
    Kernels, RMSNorm, apply_rope, init_weight, linear, matmul_input_dtype, project, rope_qk,
    split_qkv)
from xlaserve.model.linear_attention import VerifiedRows
from xlaserve.model.mla import MLAttention
from xlaserve.model.moe import ExpertsBesideMlp
from xlaserve.model.per_layer_inputs import PerLayerEmbeddings, PerLayerInput
from xlaserve.model.rope import attention_temperature, rope_tables, traced_rope
from xlaserve.model.weight_types.packed import embed
from xlaserve.model.pooling import pool_sequences, reduce_chunks
from xlaserve.model.sharding import partition_spec
from xlaserve.pallas_kernels.ragged_paged_attention.image_spans import (ImageSpans,
                                                                         image_span_attention)
from xlaserve.pallas_kernels.ragged_paged_attention.tree_tokens import tree_attention


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttentionMetadata:
    """Where each sequence's new tokens and cached pages are (docs/internals.md, the kernel contract)."""

    kv_lens: jax.Array  # i32[S] full length of each sequence, new tokens included
    page_indices: jax.Array  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array  # i32[S+1] start of each sequence's new tokens in the packed batch
    num_seqs: jax.Array  # i32[1] live rows of the S padded ones
    # Speculative tree rows (pallas_kernels/ragged_paged_attention/tree_tokens.py): i32[T], bit j
    # of a token's the new tokens of its sequence it sees; None: causal (every other step).
    tree_masks: jax.Array | None = None
    tree_width: int = dataclasses.field(default=0, metadata={"static": True})  # new tokens a row has at most
    # Gemma 3's and 4's images in the step, whose tokens see their whole image (image_spans.py);
    # None: causal (every other model, and a program shorter than an image).
    image_spans: ImageSpans | None = None
    # Hybrid linear-attention models (linear_attention.py): i32[S], the state-pool slot each
    # sequence reads and writes (its request's); None where the model has no linear layers.
    state_slots: jax.Array | None = None
    verified_rows: VerifiedRows | None = None  # their speculative steps' (linear_attention.py)


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, layer_index: int, dtype, rngs: nnx.Rngs,
                 input_size: int | None = None):
        """`input_size`: the width q, k and v are projected from (default hidden_size; an
        EAGLE-3 head's attention reads its embedding and hidden state side by side,
        model/draft_heads.py)."""
        c = config.layer(layer_index)  # its own heads where the model's layers differ
        self.config = c
        self.sliding_window = c.sliding_windows[layer_index]
        self.attention_chunk = c.attention_chunks[layer_index]  # Llama 4's RoPE layers
        # Llama 4: a NoPE layer (no RoPE; its queries scaled by the attention temperature where
        # the config tunes it), or a RoPE layer with weightless q and k norms (qk_l2_norm).
        self.nope = c.nope_layers[layer_index]
        self.l2_norm = c.qk_l2_norm and not self.nope
        self.kv_scales = c.kv_scales[layer_index] if c.kv_scales else (1.0, 1.0)
        group = c.queries_per_kv
        # Gemma 4's KV-shared layers project only their queries: their keys and values are
        # those the layer whose cache they read wrote this step (`shared_kv`).
        self.kv_source = c.kv_source_layers[layer_index] if c.kv_source_layers else layer_index
        self.layer_index = layer_index
        self.qkv = nnx.Param(init_weight(
            rngs, (input_size or c.hidden_size, c.num_kv_heads,
                   group + (2 if self.kv_source == layer_index else 0), c.head_dim), dtype))
        if c.qkv_bias:
            self.qkv_bias = nnx.Param(jnp.zeros((c.num_kv_heads, group + 2, c.head_dim), dtype))
        self.o_proj = nnx.Param(init_weight(rngs, (c.num_heads, c.head_dim, c.hidden_size), dtype))
        if c.o_bias:
            self.o_bias = nnx.Param(jnp.zeros((c.hidden_size,), dtype))
        if c.attention_sinks:
            self.sinks = nnx.Param(jnp.zeros((c.num_heads,), dtype))
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype, c.norm_offset)
        if c.qk_norm and self.kv_source == layer_index:
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype, c.norm_offset)
        if c.attention_output_gate:  # Qwen3.5's, Qwen3-Next's: sigmoid(x W_gate) per query row
            self.output_gate = nnx.Param(init_weight(
                rngs, (input_size or c.hidden_size, c.num_heads, c.head_dim), dtype))

    def __call__(self, x, cos, sin, kv_cache, metadata: AttentionMetadata, kernels: Kernels,
                 lora=None, temperature=None, shared_kv: dict | None = None):
        """`lora`: the layer's LoRA adapters (model/lora.LayerLora) or None. `temperature`:
        float32 [T], the rows' query scale in a NoPE layer (`attention_temperature`), or None.
        `shared_kv`: with KV-shared layers, the step's new keys and values by the layer that
        wrote them (a layer whose cache others read puts its own there; one that reads
        another's takes them, and writes them again, the same values in the same slots, as the
        kernels write before they read)."""
        c = self.config
        if self.kv_source != self.layer_index:
            return self._read_shared(x, cos, sin, kv_cache, metadata, kernels,
                                     shared_kv[self.kv_source])
        qkv = project(x, self.qkv[...], kernels, lora, "qkv")
        if c.qkv_bias:
            qkv = qkv + self.qkv_bias[...].astype(jnp.float32)
        fp8, dtype = self._attention_dtypes(kv_cache)
        if self.nope:  # RoPE the identity: cos 1, sin 0
            cos, sin = jnp.ones_like(cos), jnp.zeros_like(sin)
        if c.qk_norm:  # the norms come between the split and RoPE: XLA's path
            q, k, v = split_qkv(qkv)
            if c.value_norm:  # Gemma 4's weightless norm of the values
                v = kernels.module_norm(v, jnp.float32(1.0), c.rms_norm_eps)
            q, k, v = rope_qk(self.q_norm(q, kernels), self.k_norm(k, kernels), v, cos, sin,
                              dtype)
        elif self.l2_norm:  # Llama 4 norms after RoPE, which keeps each pair's length: the same
            q, k, v = split_qkv(qkv)
            one = jnp.float32(1.0)
            norm = kernels.module_norm
            q, k, v = rope_qk(norm(q, one, c.rms_norm_eps), norm(k, one, c.rms_norm_eps),
                              v, cos, sin, dtype)
        else:
            q, k, v = kernels.qkv_rope(qkv, cos, sin, dtype)
        if temperature is not None and self.nope:
            q = (q.astype(jnp.float32) * temperature[:, None, None]).astype(dtype)
        sm_scale, (k_scale, v_scale) = c.softmax_scale, self.kv_scales
        if fp8:  # the scales fold into the softmax scale and the output
            k, v = quantize(k, k_scale, kv_cache.dtype), quantize(v, v_scale, kv_cache.dtype)
            sm_scale *= k_scale
        if shared_kv is not None:
            shared_kv[self.layer_index] = (k, v, sm_scale, v_scale)
        return self._attend(q, k, v, kv_cache, metadata, kernels, lora, sm_scale, v_scale, x)

    def _read_shared(self, x, cos, sin, kv_cache, metadata, kernels, shared):
        """A KV-shared layer: its queries (q norm, RoPE) over the cache another layer wrote,
        with that layer's keys and values of this step and their scales."""
        k, v, sm_scale, v_scale = shared
        q = project(x, self.qkv[...], kernels)  # [T, kv heads, group, D]
        _, dtype = self._attention_dtypes(kv_cache)
        q = apply_rope(self.q_norm(q.reshape(q.shape[0], -1, q.shape[-1]), kernels), cos, sin)
        return self._attend(q.astype(dtype), k, v, kv_cache, metadata, kernels, None, sm_scale,
                            v_scale)

    def _attention_dtypes(self, kv_cache) -> tuple[bool, jnp.dtype]:
        """(an FP8 cache?, the dtype q, k and v go in): attention takes its inputs in the
        cache's dtype (the model dtype); an FP8 cache takes K and V scaled into FP8 and q in the
        model dtype (fp8_kv_cache.py)."""
        fp8 = kv_cache is not None and is_fp8(kv_cache.dtype)
        dtype = (matmul_input_dtype(self.o_proj[...]) if kv_cache is None or fp8
                 else kv_cache.dtype)
        return fp8, dtype

    def _attend(self, q, k, v, kv_cache, metadata, kernels, lora, sm_scale, v_scale, x_gate=None):
        """`x_gate`: the layer's input, for the output gate (attention_output_gate)."""
        c = self.config
        num_tokens = q.shape[0]
        fp8, dtype = self._attention_dtypes(kv_cache)
        sinks = self.sinks[...].astype(jnp.float32) if c.attention_sinks else None
        args = (q, k, v, kv_cache, metadata.kv_lens, metadata.page_indices, metadata.cu_q_lens,
                metadata.num_seqs)
        if c.bidirectional:  # every token its whole input (vLLM's is_causal false), no cache
            group = c.queries_per_kv
            out, _ = kernels.bidirectional_attention(
                q, jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1), metadata.cu_q_lens,
                metadata.num_seqs, sm_scale=c.softmax_scale)
            out = out.astype(dtype)
        elif metadata.tree_masks is None:
            out, kv_cache = kernels.attention(*args, sm_scale=sm_scale,
                                              sliding_window=self.sliding_window, sinks=sinks,
                                              attention_chunk=self.attention_chunk)
            spans = metadata.image_spans  # Gemma 3's and 4's image rows see their whole image
            if spans is not None and (self.sliding_window or not spans.sliding_layers_only):
                out, kv_cache = image_span_attention(
                    kernels.attention, q, k, v, kv_cache, out, spans, sm_scale=sm_scale,
                    sliding_window=self.sliding_window, sinks=sinks)
        else:  # no sliding window or chunk here (draft_head refuses trees for such models)
            out, kv_cache = tree_attention(kernels.attention, *args, metadata.tree_masks,
                                           sm_scale=sm_scale, width=metadata.tree_width,
                                           sinks=sinks)
        if fp8:
            out = rescaled(out, v_scale)
        if c.attention_output_gate:
            gate = jax.nn.sigmoid(project(x_gate, self.output_gate[...], kernels))
            out = (out.astype(jnp.float32) * gate).astype(dtype)
        out = project(out.reshape(num_tokens, -1), self.o_proj[...], kernels, lora, "o_proj")
        if c.o_bias:
            out = out + self.o_bias[...].astype(jnp.float32)
        return out, kv_cache

    def input_matrix(self):
        """The first matrix the layer's input meets (its dtype is the input's)."""
        return self.qkv[...]


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, layer_index: int, dtype, rngs: nnx.Rngs):
        c = config
        self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, c.norm_offset)
        if c.linear_layers[layer_index]:  # its state in the step's caches, not a KV cache
            self.attn = state_mixer(c, dtype, rngs)  # Gated DeltaNet or Mamba-2
        else:
            self.attn = (MLAttention if c.mla is not None else Attention)(c, layer_index, dtype,
                                                                           rngs)
        self.post_attention_norm, self.mlp = feed_forward(c, layer_index, dtype, rngs)
        if c.sandwich_norms:  # Gemma's norms of the sublayers' outputs
            self.attn_output_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, c.norm_offset)
            self.mlp_output_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, c.norm_offset)
        self.rope_table = c.rope_table(layer_index)  # which of the step's RoPE tables it reads
        if c.layer_scalars:  # Gemma 4: the layer's output, residual included, times this
            self.layer_scalar = nnx.Param(jnp.ones((1,), dtype))
        if c.experts_beside_mlp:  # Gemma 4's MoE block, on the residual beside the MLP
            self.experts = ExpertsBesideMlp(c, dtype, rngs)
        if c.per_layer_input_size:  # Gemma 4's per-layer embeddings, after the MLP
            self.per_layer = PerLayerInput(c, dtype, rngs)

    def __call__(self, x, normed, cos, sin, kv_cache, metadata, kernels: Kernels, lora=None,
                 temperature=None, per_layer_input=None, shared_kv=None):
        """`x` is the residual stream and `normed` its input norm (`input_rms_norm`), which the
        caller takes together with the residual add in front of it. Returns x + attention, the
        MLP's output (the caller adds it) and the KV cache. `lora`: the layer's LoRA adapters
        (model/lora.LayerLora; model/lora.check_model keeps them off latent attention and
        experts), or None. With sandwich norms (Gemma) attention's and the MLP's outputs are
        normed before they are added. `temperature`: Attention's (Llama 4's NoPE layers).
        `per_layer_input` float32 [T, P]: this layer's per-layer embedding (Gemma 4), or None.
        `shared_kv`: Attention's, where layers share KV caches (Gemma 4), else None."""
        extra = {} if temperature is None else {"temperature": temperature}
        if shared_kv is not None:
            extra["shared_kv"] = shared_kv
        if lora is None:
            attn_out, kv_cache = self.attn(normed, cos, sin, kv_cache, metadata, kernels, **extra)
        else:
            attn_out, kv_cache = self.attn(normed, cos, sin, kv_cache, metadata, kernels, lora,
                                           **extra)
        sandwich = hasattr(self, "attn_output_norm")
        if sandwich:
            attn_out = self.attn_output_norm(attn_out, kernels)
        norm = self.post_attention_norm
        x, normed = kernels.add_rms_norm(x, attn_out, norm.factor(), norm.eps,
                                         self.mlp.input_dtype())
        mlp_out = self.mlp(normed, kernels) if lora is None else self.mlp(normed, kernels, lora)
        if hasattr(self, "experts"):
            mlp_out = self.experts(x, mlp_out, kernels)
        if sandwich:
            mlp_out = self.mlp_output_norm(mlp_out, kernels)
        if hasattr(self, "per_layer"):  # after the MLP's residual add, its own delta
            x = x + mlp_out
            mlp_out = self.per_layer(x, per_layer_input, kernels)
        if hasattr(self, "layer_scalar"):  # (x + mlp_out) * s, the caller adding them
            scalar = self.layer_scalar[...].astype(jnp.float32)
            x, mlp_out = x * scalar, mlp_out * scalar
        return x, mlp_out, kv_cache

    def input_rms_norm(self, x, delta, kernels: Kernels):
        """(x + delta, input_norm(x + delta)) in the dtype the qkv matmul takes; no add when delta
        is None."""
        norm, dtype = self.input_norm, matmul_input_dtype(self.attn.input_matrix())
        if delta is None:
            return x, kernels.rms_norm(x, norm.factor(), norm.eps, dtype)
        return kernels.add_rms_norm(x, delta, norm.factor(), norm.eps, dtype)


class CausalLM(nnx.Module):
    """Decoder-only LM over a paged KV cache. Build it with `nnx.eval_shape` and load real weights
    with `xlaserve.weights.loader`; random init is only for tests and shape checks."""

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = config
        if config.per_layer_input_size:  # Gemma 4's per-layer embeddings
            self.per_layer_embeddings = PerLayerEmbeddings(config, dtype, rngs)
        self.embedding = nnx.Param(init_weight(rngs, (config.vocab_size, config.hidden_size), dtype))
        self.layers = nnx.List(
            [DecoderLayer(config, i, dtype, rngs) for i in range(config.num_layers)]
        )
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype,
                                  config.norm_offset)
        if not config.tie_word_embeddings and config.lm_head:
            self.lm_head = nnx.Param(init_weight(rngs, (config.hidden_size, config.vocab_size), dtype))

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
                      kernels: Kernels, rope: tuple[jax.Array, jax.Array] | None = None,
                      capture: tuple[int, ...] | None = None, lora=None, input_embeds=None):
        """float32[T, hidden]: the residual stream after the last layer (before the final norm)
        for every token row, and the updated KV caches. Split from `logits` so that a step can
        take the LM head over a few rows (sampling) and, when asked, over all of them (prompt
        logprobs). `rope`: the rows' (cos, sin), `rope_cos_sin(inv_freq, positions,
        attention_factor)` computed on the host; computed here when not given. `capture`
        (given, even empty): layer indices whose input (the residual stream entering them) is
        returned too, as a third value, a list in that order (an EAGLE-3 head's features,
        model/draft_heads.py). `lora`: the step's LoRA adapters (model/lora.LoraBatch) or None.
        `input_embeds` [levels, T, hidden]: the rows whose id is negative take theirs from
        input_embeds[0] (a vision model's image tokens, model/vision/qwen_vision.py), the others
        their token's embedding; layer i's output adds input_embeds[i + 1] (Qwen3-VL's DeepStack:
        zeros but at image tokens)."""
        if input_embeds is None:
            x = self.token_embeddings(input_ids)
        else:
            x = jnp.where((input_ids < 0)[:, None], input_embeds[0].astype(jnp.float32),
                          self.token_embeddings(jnp.maximum(input_ids, 0)))
        tables = rope_tables(*(rope if rope is not None else traced_rope(self.config, positions)),
                             self.config.rope_widths())
        c, mlp_out, captured = self.config, None, {}
        temperature = attention_temperature(c, positions)
        # Gemma 4: per-layer embeddings; layers that read another's cache (their pool arrays
        # are the cache layers', ModelConfig.cache_slot) and the new keys they take from it.
        per_layer = (self.per_layer_embeddings(input_ids, x, kernels) if c.per_layer_input_size
                     else None)
        shared_kv = {} if len(c.cache_layers) < c.num_layers else None
        new_caches = [None] * len(self.layers) if c.bidirectional else list(kv_caches)
        if len(new_caches) != len(c.cache_layers) + len(c.state_layers):
            raise ValueError(f"{len(new_caches)} caches for {len(c.cache_layers)} KV, "
                             f"{len(c.state_layers)} state layers")
        for index, layer in enumerate(self.layers):
            x, normed = layer.input_rms_norm(x, mlp_out, kernels)
            if capture and index in capture:
                captured[index] = x
            slot = c.cache_slot(index)
            x, mlp_out, new_caches[slot] = layer(
                x, normed, *tables[layer.rope_table], new_caches[slot], metadata, kernels,
                None if lora is None else lora.layer(index), temperature,
                None if per_layer is None else per_layer[:, index], shared_kv)
            if input_embeds is not None and index + 1 < input_embeds.shape[0]:
                mlp_out = mlp_out + input_embeds[index + 1].astype(jnp.float32)
        if c.bidirectional:
            new_caches = []
        if capture is not None:
            return x + mlp_out, new_caches, [captured[i] for i in capture]
        return x + mlp_out, new_caches

    def token_embeddings(self, input_ids: jax.Array) -> jax.Array:
        """float32[T, hidden]: the tokens' embedding rows, times the config's
        `embedding_multiplier` in the embedding's dtype where it is not 1 (Gemma's sqrt(hidden),
        rounded to that dtype as transformers' Gemma3TextScaledWordEmbedding does)."""
        rows = embed(self.embedding[...], input_ids)
        if self.config.embedding_multiplier != 1.0:
            rows = rows * np.float32(self.config.embedding_multiplier).astype(rows.dtype)
        return rows.astype(jnp.float32)

    def embeddings(self, hidden: jax.Array, cu_q_lens: jax.Array, mode: str,
                   normalize: bool) -> jax.Array:
        """float32[S, hidden]: each sequence's rows of `hidden` after the final norm, pooled
        (model/pooling.py): the embedding model's output, where no LM head is used."""
        return pool_sequences(self.final_norm(hidden), cu_q_lens, mode, normalize)

    def chunk_embeddings(self, hidden: jax.Array, cu_q_lens: jax.Array, mode: str) -> jax.Array:
        """float32[S, hidden]: each chunk's rows after the final norm, reduced for `mode`
        (model/pooling.reduce_chunks): what an embedding server's step returns."""
        return reduce_chunks(self.final_norm(hidden), cu_q_lens, mode)

    def logits(self, hidden: jax.Array, kernels: Kernels) -> jax.Array:
        """float32[R, V]: final norm and LM head (tied to the embedding or not) of `hidden` rows,
        soft-capped where the config says (Gemma 4)."""
        # The kernels' norm (native on a CPU: its rows independent of one another, where XLA's
        # fused reduction over [M, hidden] is not: --enable-deterministic-inference).
        x = kernels.rms_norm(hidden, self.final_norm.factor(), self.final_norm.eps, jnp.float32)
        if not self.config.lm_head:
            raise ValueError("this model was built without its LM head (an embedding server's)")
        if self.config.tie_word_embeddings:
            logits = linear(x, self.embedding[...], kernels, transposed=True)
        else:
            logits = linear(x, self.lm_head[...], kernels)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else jnp.tanh(logits / cap) * cap


def abstract_model(config: ModelConfig, dtype, model_class=CausalLM) -> CausalLM:
    """The model's structure with ShapeDtypeStruct leaves: no memory, no random numbers."""
    return nnx.eval_shape(lambda: model_class(config, dtype=dtype, rngs=nnx.Rngs(0)))


def abstract_parameters(config: ModelConfig, dtype, mesh, model_class=CausalLM,
                        quantization: str | None = None, draft_head=None):
    """(graphdef, abstract state, {path: ShapeDtypeStruct of the parameter in `dtype`, with its
    partition spec on `mesh`}): where each weight goes, before any is made, loaded or restored.
    With a `quantization` ("int8", "fp8", an int8.Fp8Checkpoint), the quantized weights are
    `Int8Matrix`es or FP8 matrices of ShapeDtypeStructs (weight_types/int8.py, fp8_weights.py); the
    abstract state stays the float model's. `draft_head`: an abstract speculative draft head
    (draft_heads.py, under nnx.eval_shape) set on the model, as start-up sets a loaded one;
    integer tables (its draft-to-target ids) keep their dtype."""
    model = abstract_model(config, dtype, model_class)
    if draft_head is not None:
        model.draft_head = draft_head
    graphdef, state = nnx.split(model)
    parameters = {}
    for path, variable in nnx.to_flat_state(state):
        value = variable.get_value()
        kind = value.dtype if jnp.issubdtype(value.dtype, jnp.integer) else dtype
        parameters[path] = jax.ShapeDtypeStruct(value.shape, kind, sharding=NamedSharding(
            mesh, partition_spec(path)))
    check_quantization(quantization)
    if quantization is not None:
        parameters = quantized_parameters(parameters, quantization)
    return graphdef, state, parameters


def kv_cache_shape(config: ModelConfig, num_pages: int, page_size: int,
                   platform: str) -> tuple[int, ...]:
    """One layer's cache on `platform` (`config`: that layer's, `ModelConfig.layer`): the attention contract's `[pages, page_size, 2*Hkv, D]`
    stored flat, as `[pages, page_size, 2*Hkv*D]`. Every kernel views it as it needs; this is the
    TPU kernel's own layout, where viewing a 4-D array flat would copy it (TPU arrays are tiled by
    their last two dims). On CPU and GPU, layouts are dense and any view is free. Multi-head
    latent attention (mla.py) keeps one latent row per token instead: `[pages, page_size,
    kv_lora + rope]`, on TPU padded to whole 128-lane tiles (V3: 576 -> 640). Unpadded, TPU's
    default layout for such an array is not row-major (it avoids the lane padding by tiling the
    pages dim), and the kernel's row-major view of it was a copy of the whole cache per layer
    (compiled for v6e: tests/kernels/test_compile_mla_kernels.py)."""
    if config.mla is not None:
        width = config.mla.cache_width
        return (num_pages, page_size, -(-width // 128) * 128 if platform == "tpu" else width)
    return (num_pages, page_size, 2 * config.num_kv_heads * config.head_dim)


def param_count(state: nnx.State) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(state)))
