"""Weights handed over in memory rather than read from files, for updates while serving
(runtime/engine/weight_updates.py): a trainer's parameters as a Flax NNX state of xlaserve's own
model, or as named tensors under the checkpoint's Hugging Face names (torch, NumPy or JAX
arrays, or safetensors files' bytes, which is what an HTTP body carries). Each becomes a model of
the served config on the serving mesh, by `place_model`, which casts and quantizes as loading
does (`--quantization int8` re-quantizes on the device).

An NNX state's jax.Arrays never leave the devices: each is cast and put on its serving
sharding by XLA (resharded where the trainer's mesh differs). Named tensors go through
`convert()`, which fuses and transposes them on the host, as loading a checkpoint does."""
from __future__ import annotations

import json
import struct

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from xlaserve.model.config.model_config import ModelConfig
from xlaserve.weights.param_layout import SafetensorsSource, WeightError, convert, with_decoder_names
from xlaserve.weights.placement import expected_parameters, place_model
from xlaserve.weights.vision_layout import with_vision_language_names

# A safetensors header is JSON of at most this many bytes (the format's own limit is 100 MB;
# a named-tensor file's header is ~100 bytes a tensor).
MAX_HEADER_BYTES = 16 << 20
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}


class NamedTensors:
    """A TensorSource (formats/tensor_source.py) over {Hugging Face name: array}."""

    def __init__(self, tensors: dict):
        self._tensors = tensors

    def names(self) -> set[str]:
        return set(self._tensors)

    def get(self, name: str) -> np.ndarray:
        return host_array(self._tensors[name])


class _Reading:
    """A TensorSource that notes the names read from it."""

    def __init__(self, source):
        self.source, self.read = source, set()

    def names(self) -> set[str]:
        return self.source.names()

    def get(self, name: str) -> np.ndarray:
        self.read.add(name)
        return self.source.get(name)


class TensorBuckets:
    """A trainer's named tensors sent over several calls (SGLang's update_weights_from_tensor
    in buckets: verl sends a model as buckets of a few hundred MB), held on the host until they
    hold every tensor the served model is built from: then they are one update, so a model of
    mixed steps is never served. Which tensors those are is read once from the served
    safetensors checkpoint (a pass of `convert` over it); a model served from elsewhere (GGUF,
    Orbax, dummy weights) takes every tensor in one call. Names `convert` does not read are
    dropped, as loading a checkpoint drops them."""

    def __init__(self):
        self._needed: tuple[str, set[str] | None] | None = None  # (source path, names)
        self._held: dict = {}

    def add(self, config: ModelConfig, source_path: str, tensors: dict) -> tuple[dict | None, str]:
        """(every tensor, once they are all here, else None; what is still awaited)."""
        needed = self._needed_for(config, source_path)
        if needed is None:
            return tensors, ""
        self._held.update({n: host_array(t) for n, t in tensors.items() if n in needed})
        missing = sorted(needed - set(self._held))
        if not missing:
            complete, self._held = self._held, {}
            return complete, ""
        return None, (f"held {len(self._held)} of the {len(needed)} tensors: the weights change "
                      f"once every one has arrived ({missing[0]!r} and {len(missing) - 1} more)")

    def clear(self) -> None:
        self._held = {}

    def _needed_for(self, config: ModelConfig, source_path: str) -> set[str] | None:
        if self._needed is None or self._needed[0] != source_path:
            names = None
            try:
                source = with_decoder_names(with_vision_language_names(
                    SafetensorsSource(source_path)))
            except (FileNotFoundError, NotADirectoryError, OSError):
                source = None
            if source is not None:
                reading = _Reading(source)
                for _ in convert(config, reading):
                    pass
                names = reading.read
            self._needed, self._held = (source_path, names), {}
        return self._needed[1]


def host_array(value) -> np.ndarray:
    """A NumPy array of a torch tensor (bfloat16 kept, by its bits), a jax.Array or an array."""
    if type(value).__module__.startswith("torch"):
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":
            import torch
            return value.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return value.numpy()
    return np.asarray(value)


def safetensors_tensors(data: bytes) -> dict[str, np.ndarray]:
    """The float tensors of one safetensors file's bytes (the documented layout: an 8-byte
    little-endian header size, a JSON header, the data). WeightError for anything else: a
    pickle (SGLang's MultiprocessingSerializer, which would run code on load) is refused, not
    read."""
    if len(data) < 10 or data[:1] == b"\x80":
        raise WeightError("serialized_named_tensors: each entry must be a safetensors file "
                          "(base64 over HTTP); pickled tensors run code when read and are "
                          "not accepted")
    (size,) = struct.unpack("<Q", data[:8])
    if size > min(MAX_HEADER_BYTES, len(data) - 8):
        raise WeightError(f"serialized_named_tensors: a safetensors header of {size} bytes "
                          f"in {len(data)}")
    try:
        header = json.loads(data[8:8 + size])
    except ValueError:
        raise WeightError("serialized_named_tensors: the safetensors header is not JSON") from None
    if not isinstance(header, dict):
        raise WeightError("serialized_named_tensors: the safetensors header is not an object")
    header.pop("__metadata__", None)
    body = memoryview(data)[8 + size:]
    tensors = {}
    for name, info in header.items():
        try:
            dtype = _DTYPES[info["dtype"]]
            start, end = (int(x) for x in info["data_offsets"])
            shape = tuple(int(x) for x in info["shape"])
        except (KeyError, TypeError, ValueError):
            raise WeightError(f"serialized_named_tensors: tensor {name!r}: a float dtype "
                              f"({', '.join(_DTYPES)}), data_offsets and shape are needed") from None
        count = int(np.prod(shape, dtype=np.int64))
        if not 0 <= start <= end <= len(body) or end - start != count * np.dtype(dtype).itemsize:
            raise WeightError(f"serialized_named_tensors: tensor {name!r}: its data_offsets "
                              f"[{start}, {end}] do not hold shape {list(shape)} of {info['dtype']}")
        tensors[name] = np.frombuffer(body[start:end], dtype).reshape(shape)
    return tensors


def model_from_tensors(config: ModelConfig, tensors: dict, *, dtype, mesh,
                       quantization: str | None):
    """The served model (`config`, on `mesh`) from every tensor of a checkpoint, by its Hugging
    Face names; WeightError names a missing or misshapen one."""
    return place_model(config, convert(config, with_decoder_names(NamedTensors(tensors))),
                       dtype=dtype, mesh=mesh, progress=False,
                       abstract=expected_parameters(config, dtype, mesh, quantization))


def model_from_state(config: ModelConfig, state, *, dtype, mesh, quantization: str | None):
    """The served model from an NNX state (or module) of xlaserve's model of the same config,
    float weights (a trainer's); its arrays stay on the devices (`place_model`)."""
    if isinstance(state, nnx.Module):
        state = nnx.state(state)
    pairs = [(path, variable.get_value() if hasattr(variable, "get_value") else variable)
             for path, variable in nnx.to_flat_state(state)]
    _, expected = abstract = expected_parameters(config, dtype, mesh, quantization)
    if extra := [p for p, _ in pairs if p not in expected]:
        raise WeightError(f"the state's parameter {'.'.join(map(str, extra[0]))} is not one of "
                          f"{config.architecture}'s (a state of another model or config)")
    for path, value in pairs:
        if not isinstance(value, (jax.Array, np.ndarray)):
            raise WeightError(f"parameter {'.'.join(map(str, path))}: a jax.Array or NumPy "
                              f"array, not {type(value).__name__}")
    return place_model(config, iter(pairs), dtype=dtype, mesh=mesh, progress=False,
                       abstract=abstract)
