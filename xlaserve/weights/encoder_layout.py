"""A BERT-family encoder's checkpoint tensors -> model/encoder.py's parameters (issue 54).

transformers' names, under a prefix that depends on how the checkpoint was saved: none for a
BertModel / XLMRobertaModel (sentence-transformers' saves, most embedding models), `bert.` or
`roberta.` for a model saved with a head (the head's own tensors are not read). Older BERT files
name the LayerNorms' parameters `gamma` / `beta`; both spellings are read. The pooler
(`pooler.dense`) is not a parameter here: sentence-transformers pools the last hidden state.

    embeddings.{word,position,token_type}_embeddings.weight, embeddings.LayerNorm
    encoder.layer.N.attention.self.{query,key,value}   -> qkv [hidden, heads, 3, D], qkv_bias
    encoder.layer.N.attention.output.dense, .LayerNorm -> o_proj [heads, D, hidden], attention_norm
    encoder.layer.N.intermediate.dense                 -> up [hidden, I], up_bias
    encoder.layer.N.output.dense, .LayerNorm           -> down [I, hidden], output_norm
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from xlaserve.model.config import ModelConfig
from xlaserve.weights.param_layout import WeightError, _fetch
from xlaserve.weights.tensor_source import TensorSource

PREFIXES = ("", "bert.", "roberta.")


def encoder_prefix(source: TensorSource) -> str:
    """The prefix the checkpoint's encoder tensors are under."""
    names = source.names()
    for prefix in PREFIXES:
        if prefix + "embeddings.word_embeddings.weight" in names:
            return prefix
    raise WeightError("checkpoint is missing tensor 'embeddings.word_embeddings.weight' (an "
                      f"encoder's, under one of the prefixes {[p for p in PREFIXES if p]} or none)")


def encoder_weights(config: ModelConfig, source: TensorSource) -> Iterator[tuple[tuple, np.ndarray]]:
    """`(param_path, array)` of every parameter of model/encoder.Encoder."""
    c, prefix = config, encoder_prefix(source)
    hidden, heads, head_dim = c.hidden_size, c.num_heads, c.head_dim
    positions = c.max_position_embeddings + c.encoder.position_offset

    def fetch(name, shape):
        return _fetch(source, prefix + name, shape)

    def norm(name, path):
        gamma = f"{name}.gamma" if prefix + f"{name}.gamma" in source.names() else f"{name}.weight"
        beta = f"{name}.beta" if prefix + f"{name}.beta" in source.names() else f"{name}.bias"
        yield path + ("scale",), fetch(gamma, (hidden,))
        yield path + ("bias",), fetch(beta, (hidden,))

    yield ("word_embedding",), fetch("embeddings.word_embeddings.weight", (c.vocab_size, hidden))
    yield ("position_embedding",), fetch("embeddings.position_embeddings.weight",
                                         (positions, hidden))
    yield ("token_type_embedding",), fetch("embeddings.token_type_embeddings.weight",
                                           (c.encoder.type_vocab_size, hidden))
    yield from norm("embeddings.LayerNorm", ("embedding_norm",))
    for i in range(c.num_layers):
        layer, at = f"encoder.layer.{i}.", ("layers", i)
        attention = layer + "attention."
        # [out, in] linear weights as [in, heads, D], stacked q | k | v on axis 2
        qkv = [fetch(f"{attention}self.{part}.weight", (heads * head_dim, hidden))
               .T.reshape(hidden, heads, head_dim) for part in ("query", "key", "value")]
        yield at + ("qkv",), np.stack(qkv, axis=2)
        qkv_bias = [fetch(f"{attention}self.{part}.bias", (heads * head_dim,))
                    .reshape(heads, head_dim) for part in ("query", "key", "value")]
        yield at + ("qkv_bias",), np.stack(qkv_bias, axis=1)
        yield at + ("o_proj",), fetch(f"{attention}output.dense.weight",
                                      (hidden, heads * head_dim)).T.reshape(heads, head_dim, hidden)
        yield at + ("o_bias",), fetch(f"{attention}output.dense.bias", (hidden,))
        yield from norm(f"{attention}output.LayerNorm", at + ("attention_norm",))
        yield at + ("up",), fetch(f"{layer}intermediate.dense.weight",
                                  (c.intermediate_size, hidden)).T
        yield at + ("up_bias",), fetch(f"{layer}intermediate.dense.bias", (c.intermediate_size,))
        yield at + ("down",), fetch(f"{layer}output.dense.weight", (hidden, c.intermediate_size)).T
        yield at + ("down_bias",), fetch(f"{layer}output.dense.bias", (hidden,))
        yield from norm(f"{layer}output.LayerNorm", at + ("output_norm",))
