"""Gemma 4's per-layer embeddings (PLE; `hidden_size_per_layer_input`, gemma-4-e2b and e4b): each
decoder layer gets an input of its own per token, of width P, added after its MLP.

How transformers' Gemma4TextModel makes them (the tests' oracle), for a token with embedding e
(the scaled one the first layer reads):
- its row of a second table, [vocab, layers * P], times sqrt(P): the token's own part;
- e projected to [layers * P], times 1 / sqrt(hidden), RMS-normed per layer (`projection_norm`):
  the part that depends on the embedding;
- the two added, times 1 / sqrt(2), then split per layer.
Layer i (`PerLayerInput`, a DecoderLayer's) then adds to its residual stream h, after the MLP's
residual add: norm(projection(gelu_tanh(gate(h)) * input_i)).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from xlaserve.model.config.model_config import ModelConfig
from xlaserve.model.layers import Kernels, RMSNorm, init_weight, linear


class PerLayerEmbeddings(nnx.Module):
    """The model's half: every layer's input for each token."""

    def __init__(self, config: ModelConfig, dtype, rngs: nnx.Rngs):
        c = config
        width = c.num_layers * c.per_layer_input_size
        self.config = c
        self.per_layer_embedding = nnx.Param(init_weight(rngs, (c.vocab_size, width), dtype))
        self.per_layer_model_projection = nnx.Param(init_weight(rngs, (c.hidden_size, width),
                                                                dtype))
        self.projection_norm = RMSNorm(c.per_layer_input_size, c.rms_norm_eps, dtype,
                                       c.norm_offset)

    def __call__(self, input_ids: jax.Array, embeddings: jax.Array, kernels: Kernels
                 ) -> jax.Array:
        """float32 [T, layers, P] for token rows `input_ids` [T] (negative ids, a vision model's
        image rows, read row 0's token part) whose embeddings (as the first layer reads them)
        are `embeddings` float32 [T, hidden]."""
        c = self.config
        rows, size = input_ids.shape[0], c.per_layer_input_size
        table = self.per_layer_embedding[...]
        # times sqrt(P) in the table's dtype, as transformers' scaled embedding rounds it
        own = (jnp.take(table, jnp.maximum(input_ids, 0), axis=0)
               * jnp.asarray(size**0.5, table.dtype)).astype(jnp.float32)
        projection = self.per_layer_model_projection[...]
        context = linear(embeddings.astype(projection.dtype), projection, kernels)
        context = self.projection_norm((context * c.hidden_size**-0.5).reshape(
            rows, c.num_layers, size))
        return (context + own.reshape(rows, c.num_layers, size)) * 2.0**-0.5


class PerLayerInput(nnx.Module):
    """A layer's half: what its input adds to the residual stream after the MLP."""

    def __init__(self, config: ModelConfig, dtype, rngs: nnx.Rngs):
        c = config
        self.per_layer_gate = nnx.Param(init_weight(rngs, (c.hidden_size,
                                                           c.per_layer_input_size), dtype))
        self.per_layer_projection = nnx.Param(init_weight(rngs, (c.per_layer_input_size,
                                                                 c.hidden_size), dtype))
        self.per_layer_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, c.norm_offset)

    def __call__(self, h: jax.Array, layer_input: jax.Array, kernels: Kernels) -> jax.Array:
        """float32 [T, hidden]: the delta for residual stream `h` [T, hidden] and this layer's
        input `layer_input` float32 [T, P]."""
        gate = self.per_layer_gate[...]
        gated = jax.nn.gelu(linear(h.astype(gate.dtype), gate, kernels), approximate=True)
        projection = self.per_layer_projection[...]
        out = linear((gated * layer_input).astype(projection.dtype), projection, kernels)
        return self.per_layer_norm(out)
