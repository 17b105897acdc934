"""A disk cache of converted models: a GGUF file is dequantized and its tokenizer built once, not on
every start.

Why: converting the default model (SmolLM2-135M, Q4_1) took ~13 s of every start on a 2-core
CPU, ~6.5 s since gguf_file reads GGUF faster: transformers parses the whole file for the config
and again for the tokenizer (and imports torch), gguf's reader once more for the tensors, then
they are dequantized. Its cache entry loads in ~1.3 s: 0.2 s to check it, 0.6 s for the
tokenizer (mostly importing transformers), 0.5 s to put the parameters on the device,
memory-mapped and already in our layout and dtype. Writing the entry adds ~1 s, once.

An entry is a directory `<root>/<key>/`:
- `params.safetensors`: every parameter as `weights.convert` yields it, in the target dtype,
  named by its path (`layers.3.attn.qkv`);
- `model_config.json`: the ModelConfig;
- the source's tokenizer as a Hugging Face tokenizer directory (`save_pretrained`), if it has one;
- `manifest.json`, written last: the key, the source, and each file's size and CRC-32.

The key hashes the source's resolved path, size and mtime_ns, the dtype, and the code and package
versions the conversion depends on. File identity rather than a content hash: it costs the same
for the default 98 MB file (whose CRC-32 would take 25 ms) and a 40 GB one (tens of seconds of
reading and hashing on every start), and rewriting a file changes its mtime. A copy of a file gets its own entry; entries of the same path
and dtype that a new one replaces are removed.

An entry is written in a temporary directory beside it and renamed into place, so a reader never
sees half of one. There is no fsync: every load checks each file's size and CRC-32 (0.13 s for
the default model's 0.54 GB in float32; SHA-256 took 0.30 s, and this guards against accidents,
not against someone who could edit the code as well), so an entry torn by a crash, truncated or
with a changed byte is removed and rebuilt, never loaded.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import struct
import tempfile
import time
import zlib
from pathlib import Path
from typing import Iterator

import numpy as np

from xlaserve.cache_root import private_dir, xlaserve_cache_dir
from xlaserve.model.config.model_config import ModelConfig
from xlaserve.weights.param_layout import SafetensorsSource

logger = logging.getLogger(__name__)

FORMAT = 1  # bump when an entry's layout changes
MANIFEST = "manifest.json"
PARAMS = "params.safetensors"
MODEL_CONFIG = "model_config.json"
TOKENIZER_FILE = "tokenizer_config.json"  # written by every Hugging Face tokenizer's save_pretrained
# What a conversion's output depends on besides the source file: these modules of xlaserve/model
# (transformer.py: the parameter tree it fills) and these packages (gguf reads the tensors,
# transformers and tokenizers build config and tokenizer). An edit converts again, once.
# The code a converted model depends on, by path under xlaserve/: a change to any makes new entries.
_CODE = ("model/config/model_config.py", "model/config/rope_config.py", "weights/param_layout.py",
         "weights/formats/gguf_file.py", "weights/kept_quantized/gguf_kept.py",
         "model/transformer.py", "weights/conversion_cache.py")
_PACKAGE = Path(__file__).resolve().parents[1]  # xlaserve/
_PACKAGES = ("gguf", "transformers", "tokenizers")
_SAFETENSORS_NAMES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_STALE_TEMP_SECONDS = 24 * 3600  # a temporary directory this old belongs to a crashed conversion


def default_root() -> str:
    """$XLASERVE_CONVERSION_CACHE_DIR (tests point it at a temporary folder), else the
    `converted` folder of xlaserve's cache root."""
    return (os.environ.get("XLASERVE_CONVERSION_CACHE_DIR")
            or os.path.join(xlaserve_cache_dir(), "converted"))


def param_name(path: tuple) -> str:
    return ".".join(str(part) for part in path)


def param_path(name: str) -> tuple:
    return tuple(int(part) if part.isdigit() else part for part in name.split("."))


@functools.cache
def _code_version() -> str:
    digest = hashlib.sha256()
    for name in _CODE:
        digest.update((_PACKAGE / name).read_bytes())
    for package in _PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            digest.update(f"{package}=={importlib.metadata.version(package)}".encode())
    return digest.hexdigest()


def source_identity(path: str) -> dict:
    real = os.path.realpath(path)
    stat = os.stat(real)
    return {"path": real, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _label(dtype, variant: str) -> str:
    """The dtype's name, and the variant of the conversion if any (gguf_kept.CACHE_VARIANT)."""
    return np.dtype(dtype).name + (f"+{variant}" if variant else "")


def entry_key(source: str, dtype, variant: str = "") -> str:
    what = {"format": FORMAT, "source": source_identity(source), "dtype": _label(dtype, variant),
            "code": _code_version()}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:24]


def _fingerprint(path: str) -> dict:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            crc = zlib.crc32(chunk, crc)
    return {"size": os.path.getsize(path), "crc32": crc}


@dataclasses.dataclass
class Entry:
    directory: str
    config: ModelConfig

    @property
    def has_tokenizer(self) -> bool:
        return os.path.isfile(os.path.join(self.directory, TOKENIZER_FILE))

    def tensors(self) -> Iterator[tuple[tuple, np.ndarray]]:
        """(parameter path, memory-mapped array) for every parameter."""
        source = SafetensorsSource(self.directory)
        for name in sorted(source.names()):
            yield param_path(name), source.get(name)


class ParamsWriter:
    """Streams parameters into `params.safetensors` (the documented layout: an 8-byte little-endian
    header size, the JSON header, the data), each at the offset the header gives it, so a model is
    never held twice in host memory (safetensors' own save_file takes them all at once). Writing
    the default model's 0.54 GB adds ~1 s to its conversion; a writer thread overlapping it with
    the conversion gained nothing measurable on 2 cores. Closed by leaving it as a context."""

    def __init__(self, directory: str, shapes: dict[tuple, tuple], dtype):
        self._dtype = np.dtype(dtype)
        self._header, offset = {}, 0
        for path, shape in shapes.items():
            size = int(np.prod(shape, dtype=np.int64)) * self._dtype.itemsize
            self._header[param_name(path)] = {"dtype": _SAFETENSORS_NAMES[self._dtype.name],
                                              "shape": list(shape),
                                              "data_offsets": [offset, offset + size]}
            offset += size
        blob = json.dumps(self._header).encode()
        blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
        self._base = 8 + len(blob)
        self._file = open(os.path.join(directory, PARAMS), "wb")
        self._file.write(struct.pack("<Q", len(blob)) + blob)
        self._file.truncate(self._base + offset)
        self._missing = set(self._header)

    def write(self, path: tuple, array: np.ndarray) -> None:
        name = param_name(path)
        info = self._header[name]
        data = np.ascontiguousarray(array, dtype=self._dtype)
        if list(data.shape) != info["shape"]:
            raise ValueError(f"parameter {name}: shape {data.shape}, expected {info['shape']}")
        self._file.seek(self._base + info["data_offsets"][0])
        self._file.write(memoryview(data.reshape(-1).view(np.uint8)))
        self._missing.discard(name)

    def __enter__(self) -> "ParamsWriter":
        return self

    def __exit__(self, error_type, *_) -> None:
        self._file.close()
        if error_type is None and self._missing:
            raise ValueError(f"parameters never written: {sorted(self._missing)}")


class ConversionCache:
    def __init__(self, root: str | None = None):
        self.root = os.path.expanduser(root or default_root())
        # Entries are loaded as they are (a tokenizer's files, the weights): a root another user
        # could write to is neither read nor written (cache_root.private_dir warned).
        self.usable = private_dir(self.root) is not None

    def entry_dir(self, source: str, dtype, variant: str = "") -> str:
        return os.path.join(self.root, entry_key(source, dtype, variant))

    def lookup(self, source: str, dtype, variant: str = "") -> Entry | None:
        """The valid entry for `source` converted to `dtype` (and `variant`), or None. An invalid
        one is removed."""
        key = entry_key(source, dtype, variant)
        directory = os.path.join(self.root, key)
        if not self.usable or not os.path.isdir(directory):
            return None
        try:
            problem = _problem(directory, key)
            if problem is None:
                with open(os.path.join(directory, MODEL_CONFIG)) as f:
                    return Entry(directory, ModelConfig.from_dict(json.load(f)))
        except (OSError, ValueError, KeyError, TypeError) as error:
            problem = f"unreadable: {error!r}"
        logger.warning("Conversion cache entry %s is invalid (%s); rebuilding it", directory, problem)
        _remove(directory)
        return None

    @contextlib.contextmanager
    def writing(self, source: str, dtype, config: ModelConfig,
                variant: str = "") -> Iterator[str | None]:
        """Yields a temporary directory for the caller to fill (ParamsWriter, tokenizer files);
        when the block ends without an error, the config and the manifest are added and the
        entry is published. Yields None where the cache cannot be written (a read-only home, a
        full disk) or is refused (`usable`): the caller converts without caching."""
        key = entry_key(source, dtype, variant)
        if not self.usable:
            yield None
            return
        try:
            temporary = tempfile.mkdtemp(prefix=f".{key}.", dir=self.root)
        except OSError as error:
            logger.warning("Conversion cache %s is not writable (%s); not caching", self.root, error)
            yield None
            return
        try:
            yield temporary
            self._publish(temporary, key, source, _label(dtype, variant), config)
        finally:
            shutil.rmtree(temporary, ignore_errors=True)  # gone already when published

    def _publish(self, temporary: str, key: str, source: str, label: str,
                 config: ModelConfig) -> None:
        try:
            with open(os.path.join(temporary, MODEL_CONFIG), "w") as f:
                json.dump(config.to_dict(), f, indent=1)
            files = {name: _fingerprint(os.path.join(temporary, name))
                     for name in sorted(os.listdir(temporary))}
            manifest = {"format": FORMAT, "key": key, "source": source_identity(source),
                        "dtype": label, "written": time.time(), "files": files}
            with open(os.path.join(temporary, MANIFEST), "w") as f:
                json.dump(manifest, f, indent=1)
            final = os.path.join(self.root, key)
            if os.path.isdir(final):  # an invalid entry, or another process published first
                if _problem(final, key) is None:
                    return
                _remove(final)
            os.rename(temporary, final)
        except OSError as error:  # a full disk, or another process renamed first: keep the model
            logger.warning("Could not write conversion cache entry %s: %s", key, error)
            return
        self._prune(keep=key, source=manifest["source"]["path"], dtype=manifest["dtype"])

    def _prune(self, keep: str, source: str, dtype: str) -> None:
        """Removes the entries this one replaces (same source path and dtype) and the temporary
        directories of crashed conversions."""
        for name in os.listdir(self.root):
            path = os.path.join(self.root, name)
            if name.startswith("."):
                with contextlib.suppress(OSError):
                    if time.time() - os.path.getmtime(path) > _STALE_TEMP_SECONDS:
                        shutil.rmtree(path, ignore_errors=True)
                continue
            if name == keep:
                continue
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                with open(os.path.join(path, MANIFEST)) as f:
                    manifest = json.load(f)
                if manifest["source"]["path"] == source and manifest["dtype"] == dtype:
                    _remove(path)


def _problem(directory: str, key: str) -> str | None:
    """Why the entry in `directory` must not be loaded, or None."""
    manifest_path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(manifest_path):
        return "no manifest: a partial entry"
    with open(manifest_path) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT or manifest.get("key") != key:
        return "written for another key or format"
    for name, expected in manifest["files"].items():
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            return f"{name} is missing"
        if os.path.getsize(path) != expected["size"]:
            return f"{name} has {os.path.getsize(path)} bytes, not {expected['size']}"
        if _fingerprint(path) != expected:
            return f"{name} fails its checksum"
    return None


def _remove(directory: str) -> None:
    """Moves `directory` out of the way first, so no reader finds half of it."""
    trash = f"{directory}.removed-{os.getpid()}-{time.monotonic_ns()}"
    parent, name = os.path.split(trash)
    trash = os.path.join(parent, "." + name)  # a temporary name: _prune sweeps it if this fails
    with contextlib.suppress(OSError):
        os.rename(directory, trash)
        shutil.rmtree(trash, ignore_errors=True)
