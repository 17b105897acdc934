"""How an embedding checkpoint turns its hidden states into one vector (issue 54), as
sentence-transformers saved it: `modules.json` (the modules in order: the Transformer, a Pooling,
optionally a Normalize), the Pooling module's `config.json` and `sentence_bert_config.json`, in
the form published checkpoints have (`sentence_transformers.models.*`, a switch per pooling mode)
and in the one sentence-transformers 6 writes (new module paths, one `pooling_mode`).

Read, never guessed: what xlaserve cannot apply stops the load in one line naming it. Supported:
one pooling mode of CLS (the first token), mean (over the input's tokens) or last token, over the
whole input (`include_prompt`), then L2 normalisation when a Normalize module follows; inputs
lowercased first where `do_lower_case` says so. Read as sentence-transformers reads them: a legacy
config with no mode switched on pools the mean. Refused: no modules.json (the checkpoint does not
say how to pool; start-up pools a bare decoder's last token, normalized, as SGLang and vLLM, and
--pooler-config may choose: runtime/engine/pooled_outputs.pooling_of), other modules (Dense, LayerNorm, static or word embeddings, a router, ...),
max / mean-sqrt-len / weighted-mean pooling, several modes at once, `include_prompt: false`, a
pooled width other than the model's hidden size, the model's weights in a subfolder, a
Transformer output other than the text's last hidden state, keys these files do not define.

    Qwen3-Embedding, gte-Qwen2     last token, normalised
    bge, bge-m3                    CLS, normalised
    all-MiniLM-L6-v2, e5           mean, normalised
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from xlaserve.model.pooling import POOLING_MODES

MODULES_FILE = "modules.json"
SENTENCE_BERT_CONFIG = "sentence_bert_config.json"
# Module types by role: the names published checkpoints saved (sentence_transformers.models.*)
# and the ones sentence-transformers 6 saves.
_TRANSFORMER = {"sentence_transformers.models.Transformer",
                "sentence_transformers.base.modules.transformer.Transformer"}
_POOLING = {"sentence_transformers.models.Pooling",
            "sentence_transformers.sentence_transformer.modules.pooling.Pooling"}
_NORMALIZE = {"sentence_transformers.models.Normalize",
              "sentence_transformers.base.modules.normalize.Normalize"}
# Pooling modes: sentence-transformers' names -> ours; its other modes are refused.
_MODES = {"cls": "cls", "mean": "mean", "lasttoken": "last"}
assert set(_MODES.values()) == set(POOLING_MODES)  # what model/pooling.py pools
# The legacy config's switches (sentence-transformers reads them as one `pooling_mode`: the one
# set, or "mean" when none is).
_LEGACY_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                 "pooling_mode_mean_tokens": "mean",
                 "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                 "pooling_mode_weightedmean_tokens": "weightedmean",
                 "pooling_mode_lasttoken": "lasttoken"}
_POOLING_KEYS = {"pooling_mode", "embedding_dimension", "word_embedding_dimension",
                 "include_prompt", *_LEGACY_MODES}
_SENTENCE_BERT_KEYS = {"max_seq_length", "do_lower_case", "transformer_task", "modality_config",
                       "module_output_name"}


class PoolingConfigError(ValueError):
    """A checkpoint's pooling that xlaserve cannot apply as saved; the message names it."""


@dataclass(frozen=True)
class Pooling:
    mode: str  # "cls" | "mean" | "last"
    normalize: bool  # L2-normalised after pooling (a Normalize module follows)
    max_seq_length: int | None = None  # sentence-transformers' input limit, None where unset
    lowercase: bool = False  # inputs lowercased before tokenizing (`do_lower_case`)
    # Matryoshka (a prefix of the vector is an embedding too): the widths a client may ask for
    # (`dimensions`), from config.json's `matryoshka_dimensions` (vLLM's key), () for any width
    # (`is_matryoshka: true`), None where the checkpoint does not say so.
    matryoshka_dimensions: tuple[int, ...] | None = None


def read_pooling(directory: str, hidden_size: int) -> Pooling:
    """The pooling the sentence-transformers files in `directory` (a local model folder)
    describe, for a model of `hidden_size`; PoolingConfigError naming what cannot be applied."""
    modules = _read_json(directory, MODULES_FILE, missing=(
        f"{directory}: no {MODULES_FILE}: the checkpoint does not say how to pool its hidden "
        "states into an embedding (sentence-transformers' modules.json and its Pooling module's "
        "config.json)"))
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise PoolingConfigError(f"{directory}: {MODULES_FILE} is not a list of modules")
    types = [m.get("type") for m in sorted(modules, key=lambda m: m.get("idx", 0))]
    roles = [next((role for role, names in (("Transformer", _TRANSFORMER), ("Pooling", _POOLING),
                                            ("Normalize", _NORMALIZE)) if t in names), t)
             for t in types]
    unknown = [t for t in roles if t not in ("Transformer", "Pooling", "Normalize")]
    if unknown:
        raise PoolingConfigError(f"{directory}: sentence-transformers module {unknown[0]} is not "
                                 "supported (only Transformer, Pooling, Normalize)")
    if roles not in (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"]):
        raise PoolingConfigError(f"{directory}: sentence-transformers modules {roles} are not "
                                 "Transformer, Pooling and optionally Normalize, in that order")
    paths = dict(zip(roles, (m.get("path", "") for m in
                             sorted(modules, key=lambda m: m.get("idx", 0)))))
    if paths["Transformer"] not in ("", "."):
        raise PoolingConfigError(f"{directory}: the Transformer module lives in "
                                 f"{paths['Transformer']!r}; xlaserve reads the model from the "
                                 "folder's top")
    mode = _pooling_mode(directory, paths["Pooling"], hidden_size)
    transformer = {}
    if os.path.isfile(os.path.join(directory, SENTENCE_BERT_CONFIG)):
        transformer = _transformer_config(directory)
    return Pooling(mode, "Normalize" in roles, transformer.get("max_seq_length"),
                   bool(transformer.get("do_lower_case")), _matryoshka(directory, hidden_size))


def _matryoshka(directory: str, hidden_size: int) -> tuple[int, ...] | None:
    """config.json's `matryoshka_dimensions` (the widths) or `is_matryoshka` (any), as vLLM
    reads them; None where neither is set."""
    if not os.path.isfile(os.path.join(directory, "config.json")):
        return None
    config = _read_json(directory, "config.json")
    widths = config.get("matryoshka_dimensions")
    if widths is not None:
        if (not isinstance(widths, list) or not widths or not all(
                isinstance(w, int) and not isinstance(w, bool) and 0 < w <= hidden_size
                for w in widths)):
            raise PoolingConfigError(f"{directory}: config.json's matryoshka_dimensions "
                                     f"{str(widths)[:80]} are not widths in [1, {hidden_size}]")
        return tuple(sorted(set(widths)))
    return () if config.get("is_matryoshka") is True else None


def _transformer_config(directory: str) -> dict:
    """sentence_bert_config.json, checked: the Transformer module gives the text's last hidden
    state."""
    config = _read_json(directory, SENTENCE_BERT_CONFIG)
    _refuse_unknown_keys(directory, SENTENCE_BERT_CONFIG, config, _SENTENCE_BERT_KEYS)
    task = config.get("transformer_task", "feature-extraction")
    output = config.get("module_output_name", "token_embeddings")
    modalities = config.get("modality_config", {"text": {"method": "forward",
                                                          "method_output_name": "last_hidden_state"}})
    text = modalities.get("text") if isinstance(modalities, dict) else None
    if (task != "feature-extraction" or output != "token_embeddings" or set(modalities) != {"text"}
            or not isinstance(text, dict) or text.get("method", "forward") != "forward"
            or text.get("method_output_name") != "last_hidden_state"):
        raise PoolingConfigError(
            f"{directory}: {SENTENCE_BERT_CONFIG} takes the model's output as "
            f"{task!r} / {output!r} / {json.dumps(modalities)}; only the text's last hidden "
            "state (feature-extraction, token_embeddings) is supported")
    return config


def _pooling_mode(directory: str, folder: str, hidden_size: int) -> str:
    name = os.path.join(folder, "config.json")
    config = _read_json(directory, name)
    _refuse_unknown_keys(directory, name, config, _POOLING_KEYS)
    mode = config.get("pooling_mode")
    if mode is None:  # the legacy switches, read as sentence-transformers reads them
        set_modes = [ours for key, ours in _LEGACY_MODES.items() if config.get(key)]
        mode = set_modes[0] if len(set_modes) == 1 else set_modes or "mean"
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if not isinstance(mode, str):
        raise PoolingConfigError(f"{directory}: {name} pools with {len(mode)} modes at once "
                                 f"({', '.join(map(str, mode))}), which is not supported")
    if mode not in _MODES:
        raise PoolingConfigError(f"{directory}: {mode} pooling is not supported (cls, mean or "
                                 "lasttoken)")
    if config.get("include_prompt", True) is not True:
        raise PoolingConfigError(f"{directory}: {name} pools without the prompt "
                                 "(include_prompt: false), which is not supported")
    width = config.get("embedding_dimension", config.get("word_embedding_dimension", hidden_size))
    if width != hidden_size:
        raise PoolingConfigError(f"{directory}: {name} pools {width}-wide embeddings; the model's "
                                 f"hidden size is {hidden_size}")
    return _MODES[mode]


def _read_json(directory: str, name: str, missing: str | None = None):
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        raise PoolingConfigError(missing or f"{directory}: {name} is missing")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as error:
        raise PoolingConfigError(f"{path}: cannot be read as JSON ({error})") from None


def _refuse_unknown_keys(directory: str, name: str, config, known: set[str]) -> None:
    if not isinstance(config, dict):
        raise PoolingConfigError(f"{directory}: {name} is not a JSON object")
    unknown = sorted(set(config) - known)
    if unknown:
        raise PoolingConfigError(f"{directory}: {name} has {unknown[0]!r}, which xlaserve does "
                                 "not know how to apply")
