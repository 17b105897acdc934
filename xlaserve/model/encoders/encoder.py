"""BERT-family encoders (BERT, XLM-RoBERTa; issue 54): what embedding models such as bge,
e5, all-MiniLM and bge-m3 run, ported from transformers' BertModel / XLMRobertaModel.

    x = LayerNorm(word[ids] + position[offset + pos] + token_type[0])
    per layer:  x = LayerNorm(x + o(attention(qkv(x))))           (post-norm, biases)
                x = LayerNorm(x + down(gelu(up(x))))
    -> the last hidden state, each token's row (no final norm, no head)

Attention is bidirectional: every token sees its whole input, so an input runs whole in one
step (the engine does not chunk an encoder's prompts) and keeps no KV cache: the new-token
attention of pallas_kernels/ragged_paged_attention/new_tokens.py with the causal mask off
(`Kernels.bidirectional_attention`), sequences kept apart by their segments. The step's KV
pool is empty for an encoder (transformer.kv_cache_shape), so `hidden_states` takes and
returns the serving step's arguments unchanged. Token types are 0, or 1 from a cross-encoder
pair's second text on (`Pooled.second_segment` of runtime/scheduler/request.py); positions are
each token's in its input.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from xlaserve.model.config.model_config import ModelConfig
from xlaserve.model.layers import Kernels, init_weight, matmul_input_dtype, project, split_qkv
from xlaserve.model.weight_types.packed import embed
from xlaserve.model.pooling import pool_sequences, reduce_chunks


class LayerNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype, bias: bool = True):
        self.scale = nnx.Param(jnp.ones((dim,), dtype))
        if bias:  # ModernBERT's have none
            self.bias = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        """float32 in, float32 out (torch's LayerNorm: biased variance)."""
        x = x.astype(jnp.float32)
        mean = x.mean(-1, keepdims=True)
        centered = x - mean
        normed = centered * jax.lax.rsqrt((centered * centered).mean(-1, keepdims=True) + self.eps)
        normed = normed * self.scale[...].astype(jnp.float32)
        return normed + self.bias[...].astype(jnp.float32) if hasattr(self, "bias") else normed


def _bias(param: nnx.Param) -> jax.Array:
    return param[...].astype(jnp.float32)


class EncoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, dtype, rngs: nnx.Rngs):
        c, eps = config, config.encoder.layer_norm_eps
        self.config = c
        # The decoder's fused layout with one query head per kv head: [hidden, heads, 3, D].
        self.qkv = nnx.Param(init_weight(rngs, (c.hidden_size, c.num_heads, 3, c.head_dim), dtype))
        self.qkv_bias = nnx.Param(jnp.zeros((c.num_heads, 3, c.head_dim), dtype))
        self.o_proj = nnx.Param(init_weight(rngs, (c.num_heads, c.head_dim, c.hidden_size), dtype))
        self.o_bias = nnx.Param(jnp.zeros((c.hidden_size,), dtype))
        self.attention_norm = LayerNorm(c.hidden_size, eps, dtype)
        self.up = nnx.Param(init_weight(rngs, (c.hidden_size, c.intermediate_size), dtype))
        self.up_bias = nnx.Param(jnp.zeros((c.intermediate_size,), dtype))
        self.down = nnx.Param(init_weight(rngs, (c.intermediate_size, c.hidden_size), dtype))
        self.down_bias = nnx.Param(jnp.zeros((c.hidden_size,), dtype))
        self.output_norm = LayerNorm(c.hidden_size, eps, dtype)

    def __call__(self, x: jax.Array, cu_q_lens, num_seqs, kernels: Kernels) -> jax.Array:
        c = self.config
        qkv = project(x, self.qkv[...], kernels) + _bias(self.qkv_bias)
        dtype = matmul_input_dtype(self.o_proj[...])
        q, k, v = (part.astype(dtype) for part in split_qkv(qkv))
        out, _ = kernels.bidirectional_attention(q, k, v, cu_q_lens, num_seqs,
                                                 sm_scale=c.head_dim**-0.5)
        attended = project(out.reshape(x.shape[0], -1).astype(dtype), self.o_proj[...], kernels)
        x = self.attention_norm(x + attended + _bias(self.o_bias))
        up = project(x, self.up[...], kernels) + _bias(self.up_bias)
        up = jax.nn.gelu(up, approximate=c.encoder.activation == "gelu_tanh")
        down = project(up.astype(matmul_input_dtype(self.down[...])), self.down[...], kernels)
        return self.output_norm(x + down + _bias(self.down_bias))


class Encoder(nnx.Module):
    """A BERT-family encoder over the serving step's ragged batch (module docstring)."""

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        c = config
        self.config = c
        positions = c.max_position_embeddings + c.encoder.position_offset
        # Gathered, never multiplied (no LM head): whole on every device, whatever the vocabulary
        # (BERT's 30522 and XLM-R's 250002 rows do not split over 4 or 8 devices).
        self.word_embedding = nnx.Param(init_weight(rngs, (c.vocab_size, c.hidden_size), dtype))
        self.position_embedding = nnx.Param(init_weight(rngs, (positions, c.hidden_size), dtype))
        self.token_type_embedding = nnx.Param(
            init_weight(rngs, (c.encoder.type_vocab_size, c.hidden_size), dtype))
        self.embedding_norm = LayerNorm(c.hidden_size, c.encoder.layer_norm_eps, dtype)
        self.layers = nnx.List([EncoderLayer(c, dtype, rngs) for _ in range(c.num_layers)])

    def hidden_states(self, input_ids, positions, kv_caches, metadata, kernels: Kernels,
                      rope=None, token_types=None):
        """float32[T, hidden]: every token's last hidden state, and `kv_caches` (an encoder's
        pool is empty) as given. `rope` is not read: the positions are learned embeddings.
        `token_types` i32[T]: each token's type (None: all 0)."""
        c = self.config
        rows = jnp.clip(positions + c.encoder.position_offset, 0,
                        c.max_position_embeddings + c.encoder.position_offset - 1)
        x = (embed(self.word_embedding[...], input_ids).astype(jnp.float32)
             + self.position_embedding[...][rows].astype(jnp.float32)
             + (self.token_type_embedding[...][0] if token_types is None else
                self.token_type_embedding[...][token_types]).astype(jnp.float32))
        x = self.embedding_norm(x)
        for layer in self.layers:
            x = layer(x, metadata.cu_q_lens, metadata.num_seqs, kernels)
        return x, kv_caches

    def embeddings(self, hidden: jax.Array, cu_q_lens: jax.Array, mode: str,
                   normalize: bool) -> jax.Array:
        """float32[S, hidden]: each sequence's rows pooled (model/pooling.py)."""
        return pool_sequences(hidden, cu_q_lens, mode, normalize)

    def chunk_embeddings(self, hidden: jax.Array, cu_q_lens: jax.Array, mode: str) -> jax.Array:
        """float32[S, hidden]: each input's rows reduced for `mode` (model/pooling.reduce_chunks;
        an encoder's input is one chunk)."""
        return reduce_chunks(hidden, cu_q_lens, mode)
