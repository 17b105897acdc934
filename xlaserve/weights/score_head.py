"""A reranker's score head (issue 54): what turns a pooled vector into a relevance score.

- A cross-encoder (`XLMRobertaForSequenceClassification`: bge-reranker; `BertForSequenceClassification`:
  ms-marco MiniLM cross-encoders): the first token's last hidden state, a dense layer + tanh
  (XLM-R's `classifier.dense`, BERT's `pooler.dense`), then the one-label projection
  (`classifier.out_proj` / `classifier`), as transformers' heads compute it.
- A decoder reranker scored by two tokens' logits (Qwen3-Reranker, vLLM's `classifier_from_token:
  ["no", "yes"]`): the last token's normed hidden state against the LM head's (or the tied
  embedding's) "yes" row minus its "no" row, so that sigmoid of it is softmax([no, yes])[yes].

The score is the logit through a sigmoid (sentence-transformers' CrossEncoder default for one
label, vLLM's) unless the checkpoint's sentence-transformers config names the identity. The head
is a few float32 matrices on the host: applied to the finished vectors by whoever asked (the
HTTP route, `Engine.rerank`), never on the engine loop. Anything else (several labels, another
activation) stops the load in one line.
"""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from xlaserve.model.config.model_config import ModelConfig
from xlaserve.weights.param_layout import SafetensorsSource, _fetch, with_decoder_names

CROSS_ENCODERS = ("XLMRobertaForSequenceClassification", "BertForSequenceClassification")
# sentence-transformers' names for a CrossEncoder's activation (config.json's
# "sentence_transformers": {"activation_fn": ...}): whether it is the sigmoid.
_ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": True,
                "torch.nn.modules.linear.Identity": False}


class ScoreHeadError(ValueError):
    """A reranker's head that xlaserve cannot apply as saved; the message names it."""


@dataclasses.dataclass(frozen=True)
class ScoreHead:
    dense: tuple[np.ndarray, np.ndarray] | None  # ([in, out], bias): then tanh; None: none
    out: np.ndarray  # float32 [hidden]: the one label's row
    out_bias: float
    sigmoid: bool

    def scores(self, vectors) -> np.ndarray:
        """float32 [N]: the scores of pooled vectors [N, hidden]."""
        x = np.asarray(vectors, np.float32)
        if self.dense is not None:
            x = np.tanh(x @ self.dense[0] + self.dense[1])
        logits = x @ self.out + np.float32(self.out_bias)
        return (1 / (1 + np.exp(-logits)) if self.sigmoid else logits).astype(np.float32)


def cross_encoder_head(folder: str, config: ModelConfig) -> ScoreHead:
    """The head of a sequence-classification checkpoint in `folder` (CROSS_ENCODERS)."""
    source, hidden = SafetensorsSource(folder), config.hidden_size
    if config.architecture == "XLMRobertaForSequenceClassification":
        names = ("classifier.dense", "classifier.out_proj")
    else:
        names = ("bert.pooler.dense", "classifier")
    labels = [n for n in source.names() if n == names[1] + ".weight"]
    if labels and source.get(labels[0]).shape[0] != 1:
        raise ScoreHeadError(f"{folder}: the classifier has {source.get(labels[0]).shape[0]} "
                             "labels; a reranker's score needs one")
    dense = (_fetch(source, names[0] + ".weight", (hidden, hidden)).astype(np.float32).T,
             _fetch(source, names[0] + ".bias", (hidden,)).astype(np.float32))
    out = _fetch(source, names[1] + ".weight", (1, hidden)).astype(np.float32)[0]
    bias = float(_fetch(source, names[1] + ".bias", (1,))[0])
    return ScoreHead(dense, out, bias, _sigmoid(folder))


def token_logit_head(folder: str, config: ModelConfig, tokenizer, tokens) -> ScoreHead:
    """vLLM's `classifier_from_token: [no, yes]` head of a causal LM checkpoint in `folder`:
    the LM head's (tied: the embedding's) `yes` row minus its `no` row, through a sigmoid."""
    if len(tokens) != 2:
        raise ScoreHeadError(f"classifier_from_token {tokens}: two tokens (no, yes) are supported")
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens]
    if any(i is None or i == tokenizer.unk_token_id for i in ids):
        raise ScoreHeadError(f"classifier_from_token {tokens}: not tokens of the vocabulary")
    source = with_decoder_names(SafetensorsSource(folder))
    name = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    rows = _fetch(source, name, (config.vocab_size, config.hidden_size))[ids].astype(np.float32)
    return ScoreHead(None, rows[1] - rows[0], 0.0, True)


def _sigmoid(folder: str) -> bool:
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    saved = (config.get("sentence_transformers") or {}).get("activation_fn")
    if saved is None:
        return True
    if saved not in _ACTIVATIONS:
        raise ScoreHeadError(f"{folder}: config.json's sentence_transformers activation_fn "
                             f"{saved!r} is not supported ({', '.join(_ACTIVATIONS)})")
    return _ACTIVATIONS[saved]
