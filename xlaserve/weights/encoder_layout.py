"""A BERT-family encoder's checkpoint tensors -> model/encoders/encoder.py's parameters (issue 54).

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

from xlaserve.model.config.model_config import ModelConfig
from xlaserve.weights.param_layout import WeightError, _fetch
from xlaserve.weights.formats.tensor_source import TensorSource

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
    """`(param_path, array)` of every parameter of model/encoders/encoder.Encoder (a ModernBERT's:
    `modernbert_weights`)."""
    if config.architecture == "ModernBertModel":
        yield from modernbert_weights(config, source)
        return
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


def modernbert_weights(config: ModelConfig, source: TensorSource):
    """`(param_path, array)` of model/encoders/modernbert.ModernBert, from transformers' names (no
    prefix, or `model.` for a model saved with a head):

        embeddings.tok_embeddings, embeddings.norm, final_norm
        layers.N.attn_norm (N > 0), layers.N.mlp_norm
        layers.N.attn.Wqkv [3 * hidden, hidden] (q | k | v)  -> qkv [hidden, heads, 3, D]
        layers.N.attn.Wo                                     -> o_proj [heads, D, hidden]
        layers.N.mlp.Wi [2 * I, hidden] (input | gate)       -> gate_up [hidden, 2, I]
        layers.N.mlp.Wo                                      -> down [I, hidden]
    """
    c = config
    hidden, heads, head_dim, inner = c.hidden_size, c.num_heads, c.head_dim, c.intermediate_size
    prefix = "model." if "model.embeddings.tok_embeddings.weight" in source.names() else ""

    def fetch(name, shape):
        return _fetch(source, prefix + name, shape)

    def norm(name, path):
        yield path + ("scale",), fetch(f"{name}.weight", (hidden,))
        if c.encoder.norm_bias:
            yield path + ("bias",), fetch(f"{name}.bias", (hidden,))

    yield ("word_embedding",), fetch("embeddings.tok_embeddings.weight", (c.vocab_size, hidden))
    yield from norm("embeddings.norm", ("embedding_norm",))
    for i in range(c.num_layers):
        layer, at = f"layers.{i}.", ("layers", i)
        if i:
            yield from norm(f"{layer}attn_norm", at + ("attention_norm",))
        qkv = fetch(f"{layer}attn.Wqkv.weight", (3 * heads * head_dim, hidden))
        yield at + ("qkv",), qkv.T.reshape(hidden, 3, heads, head_dim).transpose(0, 2, 1, 3)
        yield at + ("o_proj",), fetch(f"{layer}attn.Wo.weight",
                                      (hidden, heads * head_dim)).T.reshape(heads, head_dim, hidden)
        yield from norm(f"{layer}mlp_norm", at + ("mlp_norm",))
        yield at + ("gate_up",), fetch(f"{layer}mlp.Wi.weight", (2 * inner, hidden)).T.reshape(
            hidden, 2, inner)
        yield at + ("down",), fetch(f"{layer}mlp.Wo.weight", (hidden, inner)).T
    yield from norm("final_norm", ("final_norm",))
