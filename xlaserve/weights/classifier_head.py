"""A classifier's head (issues 54 and 73): what turns a pooled vector into its labels' logits,
and those into a reranker's score or a classification's probabilities.

- A decoder classifier or reward model (`Qwen2ForSequenceClassification`,
  `LlamaForSequenceClassification`: Skywork-Reward; SEQUENCE_CLASSIFIERS): the last token's
  normed hidden state through `score.weight` [labels, hidden], no bias, as transformers' head.
  (transformers reads the last token that is not its padding id; a served prompt has no
  padding, so that is its last token, as vLLM and SGLang read it.)
- An encoder classifier or cross-encoder (`XLMRobertaForSequenceClassification`: bge-reranker;
  `BertForSequenceClassification`: ms-marco MiniLM; CROSS_ENCODERS): the first token's last
  hidden state, a dense layer + tanh (XLM-R's `classifier.dense`, BERT's `pooler.dense`), then
  the labels' projection (`classifier.out_proj` / `classifier`).
- A decoder reranker scored by two tokens' logits (Qwen3-Reranker, vLLM's `classifier_from_token:
  ["no", "yes"]`): the last token's normed hidden state against the LM head's (or the tied
  embedding's) "yes" row minus its "no" row, one label, so that sigmoid of it is
  softmax([no, yes])[yes].

Activations. A pair's score (rerank, score: one label only) is its logit through a sigmoid
(sentence-transformers' CrossEncoder default, vLLM's) unless the checkpoint's
sentence-transformers config names the identity. A classification's probabilities follow vLLM's
`/classify` (transformers' loss for the config's `problem_type`): the identity for regression, a
sigmoid per label for multi-label classification or a single label, else a softmax over the
labels. Labels are the config's `id2label` (transformers' `LABEL_i` where it has none).

The head is a few float32 matrices on the host: applied to the finished vectors by whoever asked
(the HTTP routes, `Engine.encode`), never on the engine loop. Anything else (an activation not
listed, labels that disagree with the weights) stops the load in one line.
"""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from xlaserve.model.config.encoder_config import SEQUENCE_CLASSIFIERS
from xlaserve.model.config.model_config import ModelConfig
from xlaserve.weights.param_layout import SafetensorsSource, _fetch, with_decoder_names

CROSS_ENCODERS = ("XLMRobertaForSequenceClassification", "BertForSequenceClassification")
# sentence-transformers' names for a CrossEncoder's activation (config.json's
# "sentence_transformers": {"activation_fn": ...}): whether it is the sigmoid.
_ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": True,
                "torch.nn.modules.linear.Identity": False}
# config.json's problem_type -> the classification's activation (None: by the labels' count).
_PROBLEM_TYPES = {None: None, "single_label_classification": None,
                  "multi_label_classification": "sigmoid", "regression": "identity"}


class ClassifierHeadError(ValueError):
    """A classifier's head that xlaserve cannot apply as saved; the message names it."""


@dataclasses.dataclass(frozen=True)
class ClassifierHead:
    dense: tuple[np.ndarray, np.ndarray] | None  # ([in, out], bias): then tanh; None: none
    out: np.ndarray  # float32 [hidden, labels]
    out_bias: np.ndarray  # float32 [labels]
    labels: tuple[str, ...]  # each label's name, in the weights' order
    activation: str  # a classification's: "softmax", "sigmoid" or "identity"
    score_sigmoid: bool  # a pair's score: its logit through a sigmoid (else the logit)

    def logits(self, vectors) -> np.ndarray:
        """float32 [N, labels]: the logits of pooled vectors [N, hidden]."""
        x = np.asarray(vectors, np.float32)
        if self.dense is not None:
            x = np.tanh(x @ self.dense[0] + self.dense[1])
        return (x @ self.out + self.out_bias).astype(np.float32)

    def probabilities(self, logits) -> np.ndarray:
        """float32 [N, labels]: the classification's activation of `logits` [N, labels]."""
        logits = np.asarray(logits, np.float32)
        if self.activation == "identity":
            return logits
        if self.activation == "sigmoid":
            return _sigmoid(logits)
        shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
        return (shifted / shifted.sum(axis=-1, keepdims=True)).astype(np.float32)

    def scores(self, vectors) -> np.ndarray:
        """float32 [N]: a one-label head's scores of pooled vectors [N, hidden]."""
        logits = self.logits(vectors)[:, 0]
        return (_sigmoid(logits) if self.score_sigmoid else logits).astype(np.float32)


def checkpoint_head(folder: str, config: ModelConfig) -> tuple[str, ClassifierHead] | None:
    """(the pooling mode its head reads, the head) of a classifier checkpoint in `folder` (its
    config.json names a CROSS_ENCODERS or SEQUENCE_CLASSIFIERS architecture), else None."""
    saved = _saved_config(folder)
    architecture = (saved.get("architectures") or [None])[0]
    if architecture in CROSS_ENCODERS:
        return "cls", _cross_encoder_head(folder, config, saved, architecture)
    if architecture in SEQUENCE_CLASSIFIERS:
        source = with_decoder_names(SafetensorsSource(folder))
        out = _label_rows(source, "score.weight", config.hidden_size, folder)
        if "score.bias" in source.names():
            raise ClassifierHeadError(f"{folder}: {architecture}'s score has a bias, which "
                                      "transformers' head does not")
        return "last", _head(None, out, np.zeros(len(out), np.float32), saved, folder)
    return None


def _cross_encoder_head(folder: str, config: ModelConfig, saved: dict,
                        architecture: str) -> ClassifierHead:
    source, hidden = SafetensorsSource(folder), config.hidden_size
    if architecture == "XLMRobertaForSequenceClassification":
        names = ("classifier.dense", "classifier.out_proj")
    else:
        names = ("bert.pooler.dense", "classifier")
    out = _label_rows(source, names[1] + ".weight", hidden, folder)
    dense = (_fetch(source, names[0] + ".weight", (hidden, hidden)).astype(np.float32).T,
             _fetch(source, names[0] + ".bias", (hidden,)).astype(np.float32))
    bias = _fetch(source, names[1] + ".bias", (len(out),)).astype(np.float32)
    return _head(dense, out, bias, saved, folder)


def _label_rows(source, name: str, hidden: int, folder: str) -> np.ndarray:
    """float32 [labels, hidden]: a classifier's projection `name`, one row per label (as many
    labels as it has rows); a missing or misshapen one stops the load, naming it."""
    if name not in source.names():
        raise ClassifierHeadError(f"{folder}: checkpoint is missing tensor {name}")
    shape = source.get(name).shape
    if len(shape) != 2 or shape[1] != hidden:
        raise ClassifierHeadError(f"{folder}: {name} has shape {list(shape)}; expected "
                                  f"[labels, {hidden}]")
    return _fetch(source, name, tuple(shape)).astype(np.float32)


def token_logit_head(folder: str, config: ModelConfig, tokenizer, tokens) -> ClassifierHead:
    """vLLM's `classifier_from_token: [no, yes]` head of a causal LM checkpoint in `folder`:
    the LM head's (tied: the embedding's) `yes` row minus its `no` row, one label."""
    if len(tokens) != 2:
        raise ClassifierHeadError(f"classifier_from_token {tokens}: two tokens (no, yes) are "
                                  "supported")
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens]
    if any(i is None or i == tokenizer.unk_token_id for i in ids):
        raise ClassifierHeadError(f"classifier_from_token {tokens}: not tokens of the vocabulary")
    source = with_decoder_names(SafetensorsSource(folder))
    name = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    rows = _fetch(source, name, (config.vocab_size, config.hidden_size))[ids].astype(np.float32)
    return ClassifierHead(None, (rows[1] - rows[0])[:, None], np.zeros(1, np.float32),
                          ("LABEL_0",), "sigmoid", True)


def _head(dense, out: np.ndarray, bias: np.ndarray, saved: dict, folder: str) -> ClassifierHead:
    """The head of `out` [labels, hidden] and `bias` [labels], its labels and activations read
    from the checkpoint's config.json (`saved`)."""
    count = len(out)
    names = saved.get("id2label") or {str(i): f"LABEL_{i}" for i in range(count)}
    try:
        labels = tuple(str(names[key]) for key in sorted(names, key=int))
    except ValueError:
        raise ClassifierHeadError(f"{folder}: config.json's id2label keys are not label "
                                  f"indices: {sorted(names)}") from None
    if sorted(int(k) for k in names) != list(range(count)):
        raise ClassifierHeadError(f"{folder}: config.json's id2label names {len(names)} labels; "
                                  f"the classifier's weights have {count}")
    problem = saved.get("problem_type")
    if problem not in _PROBLEM_TYPES:
        raise ClassifierHeadError(f"{folder}: config.json's problem_type {problem!r} is not one "
                                  f"of {', '.join(p for p in _PROBLEM_TYPES if p)}")
    activation = _PROBLEM_TYPES[problem] or ("sigmoid" if count < 2 else "softmax")
    return ClassifierHead(dense, np.ascontiguousarray(out.T), bias, labels, activation,
                          _score_sigmoid(saved, folder))


def _saved_config(folder: str) -> dict:
    """The checkpoint's config.json ({} without one: a GGUF's folder)."""
    if not os.path.isfile(os.path.join(folder, "config.json")):
        return {}
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


def _score_sigmoid(saved: dict, folder: str) -> bool:
    function = (saved.get("sentence_transformers") or {}).get("activation_fn")
    if function is None:
        return True
    if function not in _ACTIVATIONS:
        raise ClassifierHeadError(f"{folder}: config.json's sentence_transformers activation_fn "
                                  f"{function!r} is not supported ({', '.join(_ACTIVATIONS)})")
    return _ACTIVATIONS[function]


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return (1 / (1 + np.exp(-x))).astype(np.float32)
