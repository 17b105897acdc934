"""ModernBERT encoders (issue 54): what gte-modernbert and modernbert-embed run, ported from
transformers' ModernBertModel.

    x = LayerNorm(word[ids])
    per layer:  x = x + o(attention(rope(qkv(LayerNorm(x)))))   (layer 0: no norm before)
                x = x + down(gelu(in) * gate),  in | gate = gate_up(LayerNorm(x))
    -> final LayerNorm of every token's row

No biases; LayerNorms without one unless the config says `norm_bias`. Attention is
bidirectional (model/encoders/encoder.py says how an encoder runs in the serving step); a local
layer's token sees the keys at most `local_window` positions away on either side, a global layer's
the whole input, each with RoPE of its own theta (computed here from the positions: the server's
RoPE table is one theta's).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from xlaserve.model.config.model_config import ModelConfig
from xlaserve.model.config.rope_config import RopeConfig
from xlaserve.model.encoders.encoder import LayerNorm
from xlaserve.model.layers import (Kernels, apply_rope, init_weight, matmul_input_dtype, project,
                                   split_qkv)
from xlaserve.model.weight_types.packed import embed
from xlaserve.model.pooling import pool_sequences, reduce_chunks
from xlaserve.model.rope import rope_angles


class ModernBertLayer(nnx.Module):
    def __init__(self, config: ModelConfig, index: int, dtype, rngs: nnx.Rngs):
        c, e = config, config.encoder
        self.config, self.local = c, e.local_layers[index]
        if index:  # layer 0's attention reads the embeddings' norm directly
            self.attention_norm = LayerNorm(c.hidden_size, e.layer_norm_eps, dtype, e.norm_bias)
        self.qkv = nnx.Param(init_weight(rngs, (c.hidden_size, c.num_heads, 3, c.head_dim), dtype))
        self.o_proj = nnx.Param(init_weight(rngs, (c.num_heads, c.head_dim, c.hidden_size), dtype))
        self.mlp_norm = LayerNorm(c.hidden_size, e.layer_norm_eps, dtype, e.norm_bias)
        self.gate_up = nnx.Param(init_weight(rngs, (c.hidden_size, 2, c.intermediate_size), dtype))
        self.down = nnx.Param(init_weight(rngs, (c.intermediate_size, c.hidden_size), dtype))

    def __call__(self, x, cos, sin, cu_q_lens, num_seqs, kernels: Kernels) -> jax.Array:
        c = self.config
        normed = self.attention_norm(x) if hasattr(self, "attention_norm") else x
        q, k, v = split_qkv(project(normed, self.qkv[...], kernels))
        dtype = matmul_input_dtype(self.o_proj[...])
        q, k = apply_rope(q, cos, sin).astype(dtype), apply_rope(k, cos, sin).astype(dtype)
        out, _ = kernels.bidirectional_attention(
            q, k, v.astype(dtype), cu_q_lens, num_seqs, sm_scale=c.head_dim**-0.5,
            window=c.encoder.local_window if self.local else 0)
        x = x + project(out.reshape(x.shape[0], -1).astype(dtype), self.o_proj[...], kernels)
        gate_up = project(self.mlp_norm(x), self.gate_up[...], kernels)
        hidden = jax.nn.gelu(gate_up[:, 0], approximate=c.encoder.activation == "gelu_tanh")
        hidden = (hidden * gate_up[:, 1]).astype(matmul_input_dtype(self.down[...]))
        return x + project(hidden, self.down[...], kernels)


class ModernBert(nnx.Module):
    """A ModernBERT encoder over the serving step's ragged batch (module docstring)."""

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        c, e = config, config.encoder
        self.config = c
        # Gathered, never multiplied: whole on every device (model/encoders/encoder.py).
        self.word_embedding = nnx.Param(init_weight(rngs, (c.vocab_size, c.hidden_size), dtype))
        self.embedding_norm = LayerNorm(c.hidden_size, e.layer_norm_eps, dtype, e.norm_bias)
        self.layers = nnx.List([ModernBertLayer(c, i, dtype, rngs) for i in range(c.num_layers)])
        self.final_norm = LayerNorm(c.hidden_size, e.layer_norm_eps, dtype, e.norm_bias)

    def hidden_states(self, input_ids, positions, kv_caches, metadata, kernels: Kernels,
                      rope=None, token_types=None):
        """float32[T, hidden]: every token's last hidden state, and `kv_caches` as given (an
        encoder keeps none). `rope` and `token_types` are not read (module docstring)."""
        c = self.config
        tables = {}
        for local, theta in ((False, c.encoder.rope_thetas[0]), (True, c.encoder.rope_thetas[1])):
            angles = rope_angles(RopeConfig(theta=theta).inv_freq(c.head_dim), positions)
            tables[local] = (jnp.cos(angles), jnp.sin(angles))
        x = self.embedding_norm(embed(self.word_embedding[...], input_ids))
        for layer in self.layers:
            x = layer(x, *tables[layer.local], metadata.cu_q_lens, metadata.num_seqs, kernels)
        return self.final_norm(x), kv_caches

    def embeddings(self, hidden: jax.Array, cu_q_lens: jax.Array, mode: str,
                   normalize: bool) -> jax.Array:
        return pool_sequences(hidden, cu_q_lens, mode, normalize)

    def chunk_embeddings(self, hidden: jax.Array, cu_q_lens: jax.Array, mode: str) -> jax.Array:
        return reduce_chunks(hidden, cu_q_lens, mode)
