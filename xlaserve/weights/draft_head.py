"""Load a speculative draft head (model/draft_heads.py) onto the target's mesh.

- EAGLE3: a directory (or hub id) with the head's `config.json` (`LlamaForCausalLMEagle3`, one
  layer, `draft_vocab_size`, optional `eagle_config.eagle_aux_hidden_state_layer_ids`) and its
  `*.safetensors`: `fc`, `midlayer.*`, `norm`, `lm_head`, `d2t` (draft id -> target id offsets),
  names as SGLang and vLLM read them, with or without a `model.` prefix. The head's embedding is
  always the target's (SGLang's `set_embed`); a `embed_tokens` in the file is not read.
- NEXTN: the target's own checkpoint, its `num_nextn_predict_layers` layer
  (`model.layers.<num_hidden_layers>.*`: `enorm`, `hnorm`, `eh_proj`, the decoder layer,
  `shared_head.norm`, `shared_head.head`); FP8 weights are dequantized into the model dtype.
  Qwen3-Next's and Qwen3.5's (`mtp_num_hidden_layers: 1`) are `mtp.*`, as SGLang and vLLM read
  them: `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `fc`, `layers.0.*` (a full-attention
  decoder layer), `norm`; their LM head and embedding are the model's.

Anything else stops start-up naming it: a head of another architecture, a PyTorch-pickle-only
checkpoint, a tensor missing or misshapen, a head whose width is not the target's.
"""
from __future__ import annotations

import json
import logging
import os

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from xlaserve.model.config.linear_attention_config import HYBRID_ARCHITECTURES
from xlaserve.model.config.model_config import ModelConfig
from xlaserve.model.draft_heads import Eagle3Head, NextNHead, eagle3_capture_layers, nextn_config
from xlaserve.model.sharding import partition_spec
from xlaserve.weights.dummy_weights import dummy_values
from xlaserve.weights.loader import resolve_model_path
from xlaserve.weights.param_layout import (SafetensorsSource, WeightError, _fetch, _fuse_qkv, _mlp,
                                           layer_weights)
from xlaserve.weights.placement import put
from xlaserve.weights.formats.quantization import dequantizing_source
from xlaserve.server_args import public_name

logger = logging.getLogger(__name__)
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


class _Prefixed:
    """A tensor source whose names may carry a `model.` prefix or not."""

    def __init__(self, source):
        self.source, self._names = source, source.names()

    def names(self) -> set[str]:
        return {n[len("model."):] if n.startswith("model.") else n for n in self._names}

    def get(self, name: str) -> np.ndarray:
        return self.source.get(name if name in self._names else "model." + name)


def read_eagle3_config(path: str, target: ModelConfig) -> tuple[ModelConfig, dict]:
    """(the head's ModelConfig, its raw config.json) for an EAGLE-3 head directory."""
    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        raise ValueError(f"--speculative-draft-model-path {path}: no config.json")
    with open(config_path) as f:
        raw = json.load(f)
    architecture = (raw.get("architectures") or ["?"])[0]
    if architecture not in EAGLE3_ARCHITECTURES:
        raise ValueError(f"--speculative-draft-model-path {path}: architecture {architecture!r} "
                         f"is not an EAGLE-3 head ({', '.join(EAGLE3_ARCHITECTURES)}); EAGLE-1/2 "
                         "heads are not supported")
    if raw.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"--speculative-draft-model-path {path}: an EAGLE-3 head has one layer; "
                         f"this one has {raw['num_hidden_layers']}")
    for field in ("bias", "load_lm_head_from_target"):  # SGLang's, not built here
        if raw.get(field):
            raise ValueError(f"--speculative-draft-model-path {path}: {field}=true is not "
                             "supported")
    from transformers import LlamaConfig

    fields = {k: v for k, v in raw.items() if k not in ("architectures", "model_type")}
    config = ModelConfig.from_hf(LlamaConfig(**fields), "LlamaForCausalLM")
    if config.hidden_size != target.hidden_size:
        raise ValueError(f"--speculative-draft-model-path {path}: the head is {config.hidden_size} "
                         f"wide, the model {target.hidden_size}: it reads the model's embedding")
    target_hidden = raw.get("target_hidden_size") or target.hidden_size
    if target_hidden != target.hidden_size:
        raise ValueError(f"--speculative-draft-model-path {path}: made for a model "
                         f"{target_hidden} wide; this one is {target.hidden_size}")
    if raw.get("vocab_size", target.vocab_size) != target.vocab_size:
        raise ValueError(f"--speculative-draft-model-path {path}: made for a vocabulary of "
                         f"{raw['vocab_size']} tokens; the model's has {target.vocab_size}")
    return config, raw


def draft_head_builder(algorithm: str, path: str | None, target: ModelConfig,
                       target_hf: dict, dtype):
    """(a function making the head for `algorithm` with random weights, its tensors' reader):
    EAGLE3's from the head directory `path`, NEXTN's from the model's config (`target_hf`,
    its checkpoint at `path`). `nnx.eval_shape` of the first is the head's structure."""
    if algorithm == "NEXTN" and target.architecture in HYBRID_ARCHITECTURES:  # Qwen's MTP layer
        config = nextn_config(target)
        check_qwen_mtp_config(target_hf)
        return (lambda: NextNHead(config, shared_lm_head=True, dtype=dtype, rngs=nnx.Rngs(0)),
                lambda: _qwen_mtp_tensors(dequantizing_source(SafetensorsSource(path), target_hf,
                                                              dtype), config))
    if algorithm == "NEXTN":
        layers = int(target_hf.get("num_nextn_predict_layers") or 0)
        if target.mla is None or layers < 1:
            raise ValueError("--speculative-algorithm NEXTN needs a DeepSeek-V3/R1 checkpoint with "
                             "num_nextn_predict_layers >= 1 (its multi-token-prediction layer), "
                             "or a Qwen3-Next / Qwen3.5 one with its mtp.* layer")
        config = nextn_config(target)
        return (lambda: NextNHead(config, dtype=dtype, rngs=nnx.Rngs(0)),
                lambda: _nextn_tensors(dequantizing_source(SafetensorsSource(path), target_hf,
                                                           dtype), target, config))
    config, raw = read_eagle3_config(path, target)
    draft_vocab = int(raw.get("draft_vocab_size") or target.vocab_size)
    layers = eagle3_capture_layers(target.num_layers, (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"))
    before = bool(raw.get("norm_before_residual", False))
    return (lambda: Eagle3Head(config, target.hidden_size, draft_vocab, layers,
                               norm_before_residual=before, dtype=dtype, rngs=nnx.Rngs(0)),
            lambda: _eagle3_tensors(path, config, target, draft_vocab))


def load_draft_head(algorithm: str, path: str | None, target: ModelConfig, target_hf: dict,
                    dtype, mesh: Mesh, load_format: str = "auto", seed: int = 0):
    """The head for `algorithm` ("EAGLE3" or "NEXTN") on `mesh`: from `path` (EAGLE3's head
    directory; NEXTN's is the model's own checkpoint), random with `load_format="dummy"`."""
    build, read = draft_head_builder(algorithm, path, target, target_hf, dtype)
    tensors = None if load_format == "dummy" else read()
    graphdef, state = nnx.split(nnx.eval_shape(build))
    expected = {p: v.get_value() for p, v in nnx.to_flat_state(state)}
    if tensors is None:
        values = dummy_values({p: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                       sharding=_sharding(mesh, p))
                               for p, x in expected.items() if p[-1] != "draft_to_target"}, seed)
        tensors = dict(values)
        if ("draft_to_target",) in expected:
            tensors[("draft_to_target",)] = np.arange(expected[("draft_to_target",)].shape[0])
    loaded = {}
    for p, want in expected.items():
        if p not in tensors:
            raise WeightError(f"draft head: no weights for {p}")
        array = tensors[p]
        if tuple(array.shape) != tuple(want.shape):
            raise WeightError(f"draft head parameter {p}: shape {list(array.shape)}, expected "
                              f"{list(want.shape)}")
        if isinstance(array, jax.Array):
            loaded[p] = array
        else:
            loaded[p] = put(np.asarray(array, dtype=want.dtype), _sharding(mesh, p))
    return nnx.merge(graphdef, nnx.from_flat_state(loaded))


def _sharding(mesh: Mesh, path: tuple) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(path))


def _eagle3_tensors(path: str, c: ModelConfig, target: ModelConfig, draft_vocab: int) -> dict:
    names = os.listdir(path)
    if not any(n.endswith(".safetensors") for n in names):
        found = [n for n in names if n.endswith((".bin", ".pt", ".pth"))]
        raise ValueError(f"--speculative-draft-model-path {path}: no *.safetensors"
                         + (f" (found {', '.join(found)}: PyTorch pickles are not read; convert "
                            "them to safetensors)" if found else ""))
    source = _Prefixed(SafetensorsSource(path))
    hidden, inter = c.hidden_size, c.intermediate_size
    q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

    def fetch(name, shape):
        return _fetch(source, name, shape)

    attn = "midlayer.self_attn."
    q = fetch(attn + "q_proj.weight", (q_rows, 2 * hidden))
    k = fetch(attn + "k_proj.weight", (kv_rows, 2 * hidden))
    v = fetch(attn + "v_proj.weight", (kv_rows, 2 * hidden))
    tensors = {
        ("fc",): fetch("fc.weight", (hidden, 3 * target.hidden_size)).T,
        ("input_norm", "scale"): fetch("midlayer.input_layernorm.weight", (hidden,)),
        ("hidden_norm", "scale"): fetch("midlayer.hidden_norm.weight", (hidden,)),
        ("post_attention_norm", "scale"): fetch("midlayer.post_attention_layernorm.weight",
                                                (hidden,)),
        ("attn", "qkv"): _fuse_qkv(q.T, k.T, v.T, c),
        ("attn", "o_proj"): fetch(attn + "o_proj.weight", (hidden, q_rows)).T.reshape(
            c.num_heads, c.head_dim, hidden),
        ("final_norm", "scale"): fetch("norm.weight", (hidden,)),
        ("lm_head",): fetch("lm_head.weight", (draft_vocab, hidden)).T,
    }
    tensors.update({("mlp",) + p[1:]: a for p, a in
                    _mlp(source, "midlayer.mlp.", inter, hidden, ("mlp",))})
    if "d2t" in source.names():
        offsets = np.asarray(source.get("d2t")).astype(np.int64)
        if offsets.shape != (draft_vocab,):
            raise WeightError(f"tensor 'd2t' has shape {list(offsets.shape)}, expected "
                              f"[{draft_vocab}]")
        ids = np.arange(draft_vocab) + offsets
        if ids.min() < 0 or ids.max() >= target.vocab_size:
            raise WeightError("tensor 'd2t' maps draft ids outside the model's vocabulary")
        tensors[("draft_to_target",)] = ids.astype(np.int32)
    elif draft_vocab != target.vocab_size:
        raise WeightError(f"the head's vocabulary has {draft_vocab} tokens, the model's "
                          f"{target.vocab_size}, and it has no 'd2t' map between them")
    else:
        tensors[("draft_to_target",)] = np.arange(draft_vocab, dtype=np.int32)
    return tensors


def _nextn_tensors(source, target: ModelConfig, c: ModelConfig) -> dict:
    prefix = f"model.layers.{target.num_layers}."
    hidden = c.hidden_size

    def fetch(name, shape):
        return _fetch(source, prefix + name, shape)

    tensors = {
        ("enorm", "scale"): fetch("enorm.weight", (hidden,)),
        ("hnorm", "scale"): fetch("hnorm.weight", (hidden,)),
        ("eh_proj",): fetch("eh_proj.weight", (hidden, 2 * hidden)).T,
        ("final_norm", "scale"): fetch("shared_head.norm.weight", (hidden,)),
        ("lm_head",): fetch("shared_head.head.weight", (c.vocab_size, hidden)).T,
    }
    tensors.update(layer_weights(source, c, 0, prefix, ("layer",)))
    return tensors


def check_qwen_mtp_config(target_hf: dict) -> None:
    """Refuses a Qwen3-Next / Qwen3.5 config (its text config's) whose MTP layer is not one
    layer on the model's embedding (SGLang's and vLLM's as well)."""
    text = target_hf.get("text_config") or target_hf
    layers = text.get("mtp_num_hidden_layers", 1)
    if layers != 1:
        raise ValueError(f"--speculative-algorithm NEXTN: mtp_num_hidden_layers is {layers}; "
                         "one MTP layer (mtp.layers.0) is built")
    if text.get("mtp_use_dedicated_embeddings"):
        raise ValueError("--speculative-algorithm NEXTN: mtp_use_dedicated_embeddings=true (an "
                         "MTP layer with an embedding of its own) is not supported")


def _qwen_mtp_tensors(source, c: ModelConfig) -> dict:
    """Qwen3-Next's / Qwen3.5's `mtp.*` as NextNHead's parameters (no LM head: the model's)."""
    if "mtp.fc.weight" not in source.names():
        raise ValueError("--speculative-algorithm NEXTN: the checkpoint has no mtp.* tensors "
                         "(mtp.fc.weight: Qwen3-Next's / Qwen3.5's multi-token-prediction layer)")
    hidden = c.hidden_size
    tensors = {
        ("enorm", "scale"): _fetch(source, "mtp.pre_fc_norm_embedding.weight", (hidden,)),
        ("hnorm", "scale"): _fetch(source, "mtp.pre_fc_norm_hidden.weight", (hidden,)),
        ("eh_proj",): _fetch(source, "mtp.fc.weight", (hidden, 2 * hidden)).T,
        ("final_norm", "scale"): _fetch(source, "mtp.norm.weight", (hidden,)),
    }
    tensors.update(layer_weights(source, c, 0, "mtp.layers.0.", ("layer",)))
    return tensors


def load_server_draft_head(args, loaded):
    """A server's draft head (ServerArgs `args`, LoadedModel `loaded`): EAGLE3's from
    --speculative-draft-model-path, NEXTN's from the model's checkpoint, on the model's mesh
    (the engine's start-up and a multi-host follower call it alike)."""
    c = loaded.config
    if (args.speculative_eagle_topk or 1) > 1 and (
            any(c.sliding_windows) or any(c.attention_chunks) or c.attention_sinks):
        raise ValueError(f"--speculative-eagle-topk {args.speculative_eagle_topk}: tree drafting "
                         "takes no sliding-window, chunked-attention or attention-sink model (its "
                         "tree rows' attention has none); use --speculative-eagle-topk 1")
    folder = loaded.source if os.path.isdir(loaded.source) else os.path.dirname(loaded.source)
    target_hf = hf_config_of(folder)
    path = args.speculative_draft_model_path
    if args.speculative_algorithm == "EAGLE3":
        path = resolve_model_path(path)
    head = load_draft_head(args.speculative_algorithm, path or folder, loaded.config, target_hf,
                           loaded.dtype, loaded.mesh, load_format=args.load_format)
    logger.info("Draft head loaded: %s (%s)", type(head).__name__,
                public_name(args.speculative_draft_model_path or loaded.name))
    return head


def hf_config_of(folder: str) -> dict:
    """The model's config.json in `folder` as a dict (NEXTN reads its num_nextn_predict_layers);
    {} where there is none (a GGUF file's, whose metadata has no such layer)."""
    path = os.path.join(folder, "config.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)
