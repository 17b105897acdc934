"""Checkpoint tensors -> our parameter layout.

A *tensor source* (formats/tensor_source.py) answers `get(hf_name) -> np.ndarray` in the Hugging
Face naming and layout (`[out_features, in_features]` for linear weights). Safetensors directories
are one source, GGUF files another (they translate llama.cpp names and undo its q/k row
permutation), so the conversion to our fused layouts below is written once.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Iterator

import ml_dtypes
import numpy as np

from xlaserve.model.config.model_config import ModelConfig
from xlaserve.model.config.llama4_config import LLAMA4_NAMES
from xlaserve.model.config.rope_config import partial_rope_rows
from xlaserve.model.mla import interleaved_rope_rows, mla_weights
from xlaserve.weights.formats.mxfp4 import read_expert_weight
from xlaserve.weights.linear_attention_layout import gated_delta_net_weights, nemotron_h_weights
from xlaserve.weights.formats.quantization import check_float_tensor
from xlaserve.weights.formats.tensor_source import TensorSource


class WeightError(ValueError):
    """A tensor is missing from the checkpoint or has the wrong shape."""


_SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}


class SafetensorsSource:
    """All `*.safetensors` files of a directory, memory-mapped.

    Read through the documented file layout (8-byte header size, JSON header, raw data) rather
    than `safe_open(framework="numpy")`, which cannot return bfloat16 tensors.
    """

    def __init__(self, directory: str):
        index_path = os.path.join(directory, "model.safetensors.index.json")
        if os.path.exists(index_path):
            with open(index_path) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {directory}")
        self._where: dict[str, tuple[np.memmap, dict]] = {}
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.exists(path):
                raise FileNotFoundError(f"{path} is listed in model.safetensors.index.json but missing")
            with open(path, "rb") as f:
                (header_size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(header_size))
            header.pop("__metadata__", None)
            data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_size)
            for tensor_name, info in header.items():
                self._where[tensor_name] = (data, info)

    def names(self) -> set[str]:
        return set(self._where)

    def get(self, name: str) -> np.ndarray:
        data, info = self._where[name]
        start, end = info["data_offsets"]
        dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise WeightError(f"tensor {name}: unsupported safetensors dtype {info['dtype']}")
        return data[start:end].view(dtype).reshape(info["shape"])


class BackboneNames:
    """A checkpoint of the decoder alone, saved without the `model.` prefix (Qwen3-Embedding's
    files, a sentence-transformers save: `embed_tokens.weight`, `layers.0...`, `norm.weight`),
    its tensors named as a causal LM's (`model.embed_tokens.weight`, ...); an LM head it lacks
    stays missing, for the config to decide (tied: none needed)."""

    def __init__(self, source: TensorSource):
        self.source = source
        self._names = {"model." + n if not n.startswith("lm_head.") else n: n
                       for n in source.names()}

    def names(self) -> set[str]:
        return set(self._names)

    def get(self, name: str) -> np.ndarray:
        return self.source.get(self._names[name])


def with_decoder_names(source: TensorSource) -> TensorSource:
    """`source`, or its tensors under a causal LM's names where it holds a backbone saved without
    the `model.` prefix (BackboneNames)."""
    names = source.names()
    if "model.embed_tokens.weight" not in names and "embed_tokens.weight" in names:
        return BackboneNames(source)
    return source


def _fetch(source: TensorSource, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """The float tensor `name` of `shape`; a missing, misshapen or non-float one raises.
    (Quantized tensors reach here dequantized by the source: quantization.dequantizing_source.)"""
    if name not in source.names():
        raise WeightError(f"checkpoint is missing tensor {name!r} (expected shape {list(shape)})")
    array = check_float_tensor(name, source.get(name))  # before the shape: packed codes differ
    if tuple(array.shape) != tuple(shape):
        raise WeightError(
            f"tensor {name!r} has shape {list(array.shape)}, expected {list(shape)} from the config"
        )
    return array


def convert(config: ModelConfig, source: TensorSource,
            skip: frozenset = frozenset()) -> Iterator[tuple[tuple, np.ndarray]]:
    """Yield `(param_path, array)` for every parameter of `CausalLM`, in our layouts, but those in
    `skip` (the caller has them: a GGUF's weights kept quantized,
    weights/kept_quantized/gguf_kept.py), whose tensors are not read."""
    c = config
    hidden = c.hidden_size
    if c.nemotron_blocks:  # its own names, blocks paired into layers, Mamba-2 mixers
        yield from nemotron_h_weights(
            lambda name, shape: _fetch(source, name, shape), c,
            lambda prefix, i, layer: _attention(source, c.layer(i), i, prefix, layer, skip,
                                                _kv_rows(source, c, i)), skip)
        return
    if ("embedding",) not in skip:
        yield ("embedding",), _fetch(source, "model.embed_tokens.weight", (c.vocab_size, hidden))
    if c.per_layer_input_size:  # Gemma 4's per-layer embeddings: the model's half
        width, path = c.num_layers * c.per_layer_input_size, ("per_layer_embeddings",)
        yield path + ("per_layer_embedding",), _fetch(
            source, "model.embed_tokens_per_layer.weight", (c.vocab_size, width))
        yield path + ("per_layer_model_projection",), _fetch(
            source, "model.per_layer_model_projection.weight", (width, hidden)).T
        yield path + ("projection_norm", "scale"), _fetch(
            source, "model.per_layer_projection_norm.weight", (c.per_layer_input_size,))
    for i in range(c.num_layers):
        yield from layer_weights(source, c, i, f"model.layers.{i}.", ("layers", i), skip)
    yield ("final_norm", "scale"), _fetch(source, "model.norm.weight", (hidden,))
    if not c.tie_word_embeddings and c.lm_head and ("lm_head",) not in skip:
        yield ("lm_head",), _fetch(source, "lm_head.weight", (c.vocab_size, hidden)).T


def layer_weights(source: TensorSource, c: ModelConfig, i: int, prefix: str, layer: tuple,
                  skip: frozenset = frozenset()):
    """`(param_path, array)` of decoder layer `i` of `c` (its experts or not, its window), read
    from the tensors under `prefix` and placed under `layer` (also DeepSeek's multi-token
    prediction layer, model/draft_heads.py)."""
    kv_fetch = _kv_rows(source, c, i)
    c = c.layer(i)  # its own heads where the model's layers differ (Gemma 4)
    hidden = c.hidden_size
    attn = prefix + "self_attn."
    yield layer + ("input_norm", "scale"), _fetch(source, prefix + "input_layernorm.weight", (hidden,))
    if c.linear_layers[i]:  # Gated DeltaNet (model/linear_attention.py)
        yield from gated_delta_net_weights(lambda name, shape: _fetch(source, name, shape), c,
                                           prefix + "linear_attn.", layer + ("attn",))
    else:
        yield from _attention(source, c, i, attn, layer, skip, kv_fetch)
    if c.sandwich_norms:  # Gemma: post_attention_layernorm norms attention's output
        yield from (
            (layer + (ours, "scale"), _fetch(source, f"{prefix}{theirs}_layernorm.weight", (hidden,)))
            for ours, theirs in (("attn_output_norm", "post_attention"),
                                 ("post_attention_norm", "pre_feedforward"),
                                 ("mlp_output_norm", "post_feedforward")))
    else:
        yield layer + ("post_attention_norm", "scale"), _fetch(
            source, prefix + "post_attention_layernorm.weight", (hidden,)
        )
    if c.layer_scalars:  # Gemma 4
        yield layer + ("layer_scalar",), _fetch(source, prefix + "layer_scalar", (1,))
    if c.architecture == "GptOssForCausalLM":
        yield from _gpt_oss_experts(source, c, prefix + "mlp.", layer + ("mlp",), skip)
    elif c.architecture in LLAMA4_NAMES:
        yield from _llama4_feed_forward(source, c, i, prefix + "feed_forward.", layer + ("mlp",))
    elif c.moe_layers[i]:
        yield from _experts(source, c, prefix, layer + ("mlp",))
    else:
        yield from _mlp(source, prefix + "mlp.", c.intermediate_size, hidden, layer + ("mlp",),
                        skip=skip)
    if c.experts_beside_mlp:
        yield from _gemma4_experts(source, c, prefix, layer + ("experts",))
    if c.per_layer_input_size:  # Gemma 4's per-layer embeddings: the layer's half
        size = c.per_layer_input_size
        yield layer + ("per_layer", "per_layer_gate"), _fetch(
            source, prefix + "per_layer_input_gate.weight", (size, hidden)).T
        yield layer + ("per_layer", "per_layer_projection"), _fetch(
            source, prefix + "per_layer_projection.weight", (hidden, size)).T
        yield layer + ("per_layer", "per_layer_norm", "scale"), _fetch(
            source, prefix + "post_per_layer_input_norm.weight", (hidden,))


def _kv_rows(source: TensorSource, c: ModelConfig, i: int):
    """Layer `i`'s reader of a K or V projection's rows (name, shape) -> array: each KV head
    as many times as the layer holds it (`kv_replicas`: more devices than heads)."""
    copies = c.kv_replicas[i] if c.kv_replicas else 1  # of each stored KV head
    head_dim = c.layer(i).head_dim

    def kv_fetch(name, shape):
        rows = _fetch(source, name, shape)
        heads = rows.reshape(-1, head_dim, *rows.shape[1:])
        return np.repeat(heads, copies, axis=0).reshape(-1, *rows.shape[1:])

    return kv_fetch


def _attention(source: TensorSource, c: ModelConfig, i: int, attn: str, layer: tuple,
               skip: frozenset, kv_fetch):
    """Attention's weights of layer `i` (`c` that layer's config) from the tensors under `attn`
    into `layer`'s "attn": latent attention's, a KV-shared layer's queries, or q, k and v fused
    (with Qwen3.5's output gate beside them), o_proj, biases, sinks and q/k norms. `kv_fetch`:
    a K or V projection's rows, each KV head as many times as the layer holds it."""
    hidden, head_dim = c.hidden_size, c.head_dim
    copies = c.kv_replicas[i] if c.kv_replicas else 1
    q_rows, kv_rows = c.num_heads * head_dim, c.num_kv_heads // copies * head_dim
    if c.mla is not None:
        yield from mla_weights(lambda name, shape: _fetch(source, name, shape), c, attn,
                               layer + ("attn",))
    elif c.kv_source_layers[i] != i:  # Gemma 4's KV-shared layer: queries only
        q = _fetch(source, attn + "q_proj.weight", (q_rows, hidden)).T
        yield layer + ("attn", "qkv"), q.reshape(hidden, c.num_kv_heads, c.queries_per_kv,
                                                 head_dim)
    elif layer + ("attn", "qkv") not in skip:
        q = _fetch(source, attn + "q_proj.weight",
                   (q_rows * (2 if c.attention_output_gate else 1), hidden))
        if c.attention_output_gate:  # each head's query rows, then its gate's
            q, gate = np.moveaxis(q.reshape(c.num_heads, 2, head_dim, hidden), 1, 0)
            yield layer + ("attn", "output_gate"), np.ascontiguousarray(
                gate.reshape(q_rows, hidden).T).reshape(hidden, c.num_heads, head_dim)
        q = _rope_rows(c, q.reshape(q_rows, hidden))
        k = kv_fetch(attn + "k_proj.weight", (kv_rows, hidden))
        # Gemma 4's attention_k_eq_v layers have no v_proj: their values are k's projection.
        v = k if c.value_is_key[i] else kv_fetch(attn + "v_proj.weight", (kv_rows, hidden))
        k = _rope_rows(c, k)
        yield layer + ("attn", "qkv"), _fuse_qkv(q.T, k.T, v.T, c)
    if c.qkv_bias:
        qb = _rope_rows(c, _fetch(source, attn + "q_proj.bias", (q_rows,)))
        kb = _rope_rows(c, kv_fetch(attn + "k_proj.bias", (kv_rows,)))
        vb = kv_fetch(attn + "v_proj.bias", (kv_rows,))
        yield layer + ("attn", "qkv_bias"), _fuse_qkv(qb, kb, vb, c)
    if layer + ("attn", "o_proj") not in skip and c.mla is None:
        o = _fetch(source, attn + "o_proj.weight", (hidden, q_rows))
        yield layer + ("attn", "o_proj"), o.T.reshape(c.num_heads, head_dim, hidden)
    if c.o_bias:
        yield layer + ("attn", "o_bias"), _fetch(source, attn + "o_proj.bias", (hidden,))
    if c.attention_sinks:
        yield layer + ("attn", "sinks"), _fetch(source, attn + "sinks", (c.num_heads,))
    if c.qk_norm:  # in the rows' order (partial RoPE reorders them: _rope_rows)
        yield layer + ("attn", "q_norm", "scale"), _rope_rows(
            c, _fetch(source, attn + "q_norm.weight", (head_dim,)))
    if c.qk_norm and c.kv_source_layers[i] == i:
        yield layer + ("attn", "k_norm", "scale"), _rope_rows(
            c, _fetch(source, attn + "k_norm.weight", (head_dim,)))


def _mlp(source: TensorSource, prefix: str, inter: int, hidden: int, path: tuple,
         names=("gate_proj", "up_proj", "down_proj"), skip: frozenset = frozenset()):
    """A SwiGLU MLP's gate_up [hidden, 2, inter] and down [inter, hidden] (but those in `skip`)."""
    if path + ("gate_up",) not in skip:
        gate = _fetch(source, f"{prefix}{names[0]}.weight", (inter, hidden))
        up = _fetch(source, f"{prefix}{names[1]}.weight", (inter, hidden))
        yield path + ("gate_up",), np.stack([gate.T, up.T], axis=1)
    if path + ("down",) not in skip:
        yield path + ("down",), _fetch(source, f"{prefix}{names[2]}.weight", (hidden, inter)).T


def _experts(source: TensorSource, c: ModelConfig, prefix: str, path: tuple):
    """A mixture-of-experts MLP (model/moe.py): the router, every expert stacked, the shared expert
    and its gate. Checkpoints keep one tensor per expert (as transformers saves them), or all
    experts in two (`_fused_experts`: Qwen3.5-MoE's published files); Mixtral names them w1
    (gate), w3 (up) and w2 (down) under `block_sparse_moe`; DeepSeek's router has V3's
    `e_score_correction_bias`, and its ungated shared experts are `shared_experts`."""
    hidden, inter = c.hidden_size, c.moe_intermediate_size
    if c.architecture == "MixtralForCausalLM":
        prefix, names = prefix + "block_sparse_moe.", ("w1", "w3", "w2")
    else:
        prefix, names = prefix + "mlp.", ("gate_proj", "up_proj", "down_proj")
    yield path + ("router",), _fetch(source, prefix + "gate.weight", (c.num_experts, hidden)).T
    if c.router_correction_bias:
        yield path + ("router_correction_bias",), _fetch(
            source, prefix + "gate.e_score_correction_bias", (c.num_experts,))
    fused, first = prefix + "experts.gate_up_proj", f"{prefix}experts.0.{names[0]}.weight"
    if fused in source.names():
        yield from _fused_experts(source, c, prefix + "experts.", path)
    elif first not in source.names():
        raise WeightError(f"checkpoint has neither {fused!r} (all experts) nor {first!r} (one "
                          "tensor per expert)")
    else:
        gate_up, down = [], []
        for expert in range(c.num_experts):
            tensors = dict(_mlp(source, f"{prefix}experts.{expert}.", inter, hidden, (), names))
            gate_up.append(tensors[("gate_up",)])
            down.append(tensors[("down",)])
        yield path + ("experts_gate_up",), np.stack(gate_up)
        yield path + ("experts_down",), np.stack(down)
    if c.shared_expert_intermediate_size:
        name = "shared_expert." if c.shared_expert_gate else "shared_experts."
        yield from _mlp(source, prefix + name, c.shared_expert_intermediate_size, hidden,
                        path + ("shared_expert",))
    if c.shared_expert_intermediate_size and c.shared_expert_gate:
        yield path + ("shared_expert_gate",), _fetch(
            source, prefix + "shared_expert_gate.weight", (1, hidden)).T


def _fused_experts(source: TensorSource, c: ModelConfig, prefix: str, path: tuple):
    """Every expert in two tensors under `prefix`, transformers 5's modules' own layout:
    `gate_up_proj` [E, 2 * inter, hidden] (gate's rows, then up's) and `down_proj` [E, hidden,
    inter] (Gemma 4's checkpoints, Qwen3.5-MoE's published ones)."""
    hidden, inter, experts = c.hidden_size, c.moe_intermediate_size, c.num_experts
    gate_up = _fetch(source, prefix + "gate_up_proj", (experts, 2 * inter, hidden))
    yield path + ("experts_gate_up",), np.ascontiguousarray(
        gate_up.reshape(experts, 2, inter, hidden).transpose(0, 3, 1, 2))
    down = _fetch(source, prefix + "down_proj", (experts, hidden, inter))
    yield path + ("experts_down",), np.ascontiguousarray(down.transpose(0, 2, 1))


def _gemma4_experts(source: TensorSource, c: ModelConfig, prefix: str, path: tuple):
    """Gemma 4's MoE block (model/moe.ExpertsBesideMlp): `router.proj` [E, hidden], its `scale`
    [hidden] and `per_expert_scale` [E]; its experts fused (`_fused_experts`); the three norms
    around it."""
    hidden, experts = c.hidden_size, c.num_experts
    yield path + ("router",), _fetch(source, prefix + "router.proj.weight", (experts, hidden)).T
    yield path + ("router_scale",), _fetch(source, prefix + "router.scale", (hidden,))
    yield path + ("per_expert_scale",), _fetch(source, prefix + "router.per_expert_scale",
                                               (experts,))
    yield from _fused_experts(source, c, prefix + "experts.", path)
    for ours, theirs in (("mlp_norm", "post_feedforward_layernorm_1"),
                         ("input_norm", "pre_feedforward_layernorm_2"),
                         ("output_norm", "post_feedforward_layernorm_2")):
        yield path + (ours, "scale"), _fetch(source, f"{prefix}{theirs}.weight", (hidden,))


def _rope_rows(c: ModelConfig, rows: np.ndarray) -> np.ndarray:
    """q's or k's rows [heads * head_dim, ...] (or a q/k norm's weight), each head's reordered
    so that rotating its halves is the checkpoint's RoPE, and q . k unchanged (both permuted
    alike): de-interleaved (its even rows, then its odd ones) where that RoPE rotates
    interleaved pairs (Llama 4); where it rotates a head's first rows alone (partial RoPE,
    Qwen3.5), those rows' halves at the head's halves (rope_config.partial_rope_rows)."""
    if c.rope_interleaved:
        order = interleaved_rope_rows(c.head_dim, c.head_dim)
    elif c.rope.partial_rotary != 1.0:
        order = partial_rope_rows(c.head_dim, c.rope.partial_rotary)
    else:
        return rows
    heads = rows.reshape(-1, c.head_dim, *rows.shape[1:])
    return np.ascontiguousarray(heads[:, order].reshape(rows.shape))


def _llama4_feed_forward(source: TensorSource, c: ModelConfig, i: int, prefix: str, path: tuple):
    """Llama 4's `feed_forward`: a dense MLP, or the router, the stacked experts (`gate_up_proj`
    [E, hidden, 2 * inter], gate's columns then up's; `down_proj` [E, inter, hidden]) and the
    ungated shared expert."""
    hidden, inter, experts = c.hidden_size, c.moe_intermediate_size, c.num_experts
    if not c.moe_layers[i]:
        yield from _mlp(source, prefix, c.intermediate_size, hidden, path)
        return
    yield path + ("router",), _fetch(source, prefix + "router.weight", (experts, hidden)).T
    gate_up = _fetch(source, prefix + "experts.gate_up_proj", (experts, hidden, 2 * inter))
    yield path + ("experts_gate_up",), gate_up.reshape(experts, hidden, 2, inter)
    yield path + ("experts_down",), _fetch(source, prefix + "experts.down_proj",
                                           (experts, inter, hidden))
    yield from _mlp(source, prefix + "shared_expert.", c.shared_expert_intermediate_size, hidden,
                    path + ("shared_expert",))


def _gpt_oss_experts(source: TensorSource, c: ModelConfig, prefix: str, path: tuple,
                     skip: frozenset = frozenset()):
    """gpt-oss's experts: stacked tensors `gate_up_proj [E, hidden, 2 * inter]`, its gate and up
    columns interleaved (gate 2i, up 2i + 1), and `down_proj [E, inter, hidden]`, each stored
    plain or as MXFP4 blocks and scales (weights/formats/mxfp4.py, decoded here into bfloat16, which
    holds every MXFP4 value exactly; those in `skip` are kept in MXFP4 by
    weights/kept_quantized/mxfp4_kept.py); biases on the router and both projections."""
    experts, hidden, inter = c.num_experts, c.hidden_size, c.moe_intermediate_size
    yield path + ("router",), _fetch(source, prefix + "router.weight", (experts, hidden)).T
    yield path + ("router_bias",), _fetch(source, prefix + "router.bias", (experts,))
    prefix += "experts."
    if path + ("experts_gate_up",) not in skip:
        gate_up = expert_matrix(source, prefix + "gate_up_proj", (experts, hidden, 2 * inter))
        yield path + ("experts_gate_up",), _deinterleave(gate_up.reshape(experts, hidden, inter,
                                                                         2))
    bias = _fetch(source, prefix + "gate_up_proj_bias", (experts, 2 * inter))
    yield path + ("experts_gate_up_bias",), _deinterleave(bias.reshape(experts, inter, 2))
    if path + ("experts_down",) not in skip:
        yield path + ("experts_down",), expert_matrix(source, prefix + "down_proj",
                                                      (experts, inter, hidden))
    yield path + ("experts_down_bias",), _fetch(source, prefix + "down_proj_bias", (experts, hidden))


def expert_matrix(source: TensorSource, name: str, shape: tuple[int, int, int]) -> np.ndarray:
    """gpt-oss's expert matrix `name` [E, in, out]: the one place that chooses between a plain
    `<name>` (read in its own dtype, refused if not float) and MXFP4 `<name>_blocks`/`_scales`
    (decoded into bfloat16, which holds every MXFP4 value exactly); the plain one first."""
    names = source.names()
    if name in names:
        return _fetch(source, name, shape)
    if f"{name}_blocks" in names or f"{name}_scales" in names:
        return read_expert_weight(source, name, shape, ml_dtypes.bfloat16)
    raise WeightError(f"checkpoint has neither {name!r} nor its MXFP4 {name + '_blocks'!r} "
                      f"(expected shape {list(shape)})")


def _deinterleave(pairs: np.ndarray) -> np.ndarray:
    """[..., inter, 2] (gate, up pairs) -> [..., 2, inter] (gate | up): our gate_up layout."""
    return np.ascontiguousarray(np.swapaxes(pairs, -1, -2))


def _fuse_qkv(q: np.ndarray, k: np.ndarray, v: np.ndarray, c: ModelConfig) -> np.ndarray:
    """[..., Hq*D], [..., Hkv*D], [..., Hkv*D] -> [..., Hkv, G + 2, D]: each kv head's group of
    query heads, then its k, then its v (query head h belongs to kv head h // G)."""
    lead = q.shape[:-1]
    q = q.reshape(*lead, c.num_kv_heads, c.queries_per_kv, c.head_dim)
    k = k.reshape(*lead, c.num_kv_heads, 1, c.head_dim)
    v = v.reshape(*lead, c.num_kv_heads, 1, c.head_dim)
    return np.concatenate([q, k, v], axis=-2)
