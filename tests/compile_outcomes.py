"""What compiling a TPU or GPU program here gave, kept on disk, so that a warm run of the suite
reads it back instead of compiling the same program again.

Why: the real-size TPU and H100 compiles were half of `make test`'s first part (1,180 of its
2,499 test-seconds, 2026-11-29, a 2-core Zen 4), and JAX's persistent cache cannot help: it
writes programs compiled without their device, but reading one back fails ("PjRtCompiler must
be constructed with a Client to call DeserializeLoadedExecutable"). What those tests look at is
the compile's outcome: the optimized HLO (`as_text`), `memory_analysis`, `cost_analysis` and the
layouts XLA chose for the inputs (`input_formats`). Those are kept, under a key of everything
the compile depends on: the lowered module with its shardings, the devices, the
compile options asked for, the XLA and libtpu flags, the JAX config that reaches the compile
options, and the versions of JAX, jaxlib, the target's plugin and its compilers. A change to
any of them (an edit of the model or a kernel, another libtpu) compiles again, so a test fails
on a warm run where it fails on a cold one. Source locations are not in the key: an edit that
moves lines but not the program reads the outcome back (a first key with them recompiled the 8B
steps after every edit of the model's files), so a read-back HLO's metadata may name the lines
of the first compile; no test reads them.

A kept outcome is only written after reading it back gave what the compile gave (the formats
are rebuilt from the lowering's shardings: where that does not give the compiled ones, they are
not kept). Anything else a test asks of a read-back program (`out_info`, serializing it)
compiles it then, for real. CPU programs are not kept here: JAX's own cache loads those.
`XLASERVE_TEST_COMPILE_OUTCOMES=0` turns this off (every program compiled).
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import pickle
import tempfile
import types
import zlib
from pathlib import Path

import jax
import jaxlib
from jax import tree_util
from jax._src.layout import Format

_PLATFORMS = ("tpu", "gpu", "cuda", "rocm")  # "gpu": the compile-only client of a CUDA target
_MEMORY_FIELDS = ("alias_size_in_bytes", "argument_size_in_bytes", "generated_code_size_in_bytes",
                  "host_alias_size_in_bytes", "host_argument_size_in_bytes",
                  "host_generated_code_size_in_bytes", "host_output_size_in_bytes",
                  "host_temp_size_in_bytes", "output_size_in_bytes", "peak_memory_in_bytes",
                  "temp_size_in_bytes", "total_allocation_bytes")
_ENVIRONMENT = ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "TPU_LIBRARY_PATH")
_CONFIG = ("jax_use_shardy_partitioner", "jax_optimization_level", "jax_memory_fitting_level",
           "jax_enable_x64", "jax_default_matmul_precision")
counts = {"read back": 0, "compiled": 0}


@functools.cache
def _versions() -> str:
    """JAX's, jaxlib's and every installed package that brings a compiler for another target."""
    prefixes = ("libtpu", "jax-cuda", "jax_cuda", "nvidia-", "jax-rocm")
    names = sorted(f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions()
                   if (d.metadata["Name"] or "").lower().startswith(prefixes))
    return "\n".join([jax.__version__, jaxlib.__version__, *names])


def _key(lowered, compiler_options, device_assignment) -> str:
    lowering = lowered._lowering
    args = lowering.compile_args
    parts = [lowered.as_text(), _versions(), args["backend"].platform_version,
             repr(sorted((compiler_options or {}).items())), repr(device_assignment),
             repr(getattr(lowering, "_device_list", None)), repr(args["in_shardings"]),
             repr(args["out_shardings"]), repr(args.get("in_layouts")),
             repr(args.get("out_layouts")),
             *(f"{name}={os.environ.get(name)}" for name in _ENVIRONMENT),
             *(f"{name}={getattr(jax.config, name, None)}" for name in _CONFIG)]
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()


def _folder() -> Path | None:
    from xlaserve.cache_root import private_dir, xlaserve_cache_dir

    return private_dir(os.path.join(xlaserve_cache_dir(), "compile-only"))


class ReadBack:
    """A compile's kept outcome, standing in for the `jax.stages.Compiled` it came from."""

    def __init__(self, lowered, record: dict, compile_real):
        self._lowered, self._record, self._compile_real = lowered, record, compile_real
        self._real = None

    def as_text(self) -> str:
        return self._record["as_text"]

    def memory_analysis(self):
        return types.SimpleNamespace(**self._record["memory"])

    def cost_analysis(self):
        return self._record["cost"]

    @property
    def input_formats(self):
        sources = self._record.get("input_shardings")
        if sources is None:
            return self._compiled().input_formats
        shardings = self._lowered._lowering.compile_args["in_shardings"]
        flat = [Format(layout, None if source is None else shardings[source])
                for layout, source in zip(self._record["input_layouts"], sources)]
        return tree_util.tree_unflatten(self._lowered.in_tree, flat)

    def _compiled(self):
        if self._real is None:
            self._real = self._compile_real()
        return self._real

    def __getattr__(self, name):  # anything not kept: the program, compiled now
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._compiled(), name)


def _record(lowered, compiled) -> dict:
    memory = compiled.memory_analysis()
    record = {"as_text": compiled.as_text(), "cost": compiled.cost_analysis(),
              "memory": {name: getattr(memory, name) for name in _MEMORY_FIELDS}}
    formats = tree_util.tree_leaves(compiled.input_formats, is_leaf=lambda x: x is None)
    shardings = list(lowered._lowering.compile_args["in_shardings"])
    sources = []  # per input, the index of its sharding among the lowering's (None: none)
    for fmt in formats:
        sharding = getattr(fmt, "sharding", None)  # an input XLA dropped has none
        source = None if sharding is None else next(
            (i for i, s in enumerate(shardings) if s == sharding), -1)
        if source == -1:
            return record  # a sharding the lowering does not name: formats compiled on demand
        sources.append(source)
    record["input_layouts"] = [getattr(f, "layout", None) for f in formats]
    record["input_shardings"] = sources
    return record


def _reads_back(data: bytes, record: dict, lowered, compiled) -> bool:
    """Whether `data` (the stored bytes of `record`) read back give what `compiled` gave: the
    kept values whole, the input formats rebuilt from the lowering's shardings."""
    try:
        read_back = ReadBack(lowered, pickle.loads(zlib.decompress(data)), None)
        return (read_back._record == record
                and ("input_shardings" not in record
                     or read_back.input_formats == compiled.input_formats))
    except Exception:  # noqa: BLE001 - a record that cannot be read back is not kept
        return False


def install() -> None:
    """Wraps `jax.stages.Lowered.compile` for the programs of other targets than the CPU."""
    if os.environ.get("XLASERVE_TEST_COMPILE_OUTCOMES", "1") == "0":
        return
    compile_lowered = jax.stages.Lowered.compile

    def compile(self, compiler_options=None, *, device_assignment=None):
        real = functools.partial(compile_lowered, self, compiler_options,
                                 device_assignment=device_assignment)
        try:
            platform = self._lowering.compile_args["backend"].platform
        except (AttributeError, KeyError, TypeError):  # a lowering of another kind
            platform = "cpu"
        folder = _folder() if platform in _PLATFORMS else None
        if folder is None:
            return real()
        path = folder / f"{_key(self, compiler_options, device_assignment)}.pkl"
        try:
            record = pickle.loads(zlib.decompress(path.read_bytes()))
        except (OSError, zlib.error, pickle.UnpicklingError, EOFError, AttributeError,
                ImportError):
            record = None
        if record is not None:
            counts["read back"] += 1
            return ReadBack(self, record, real)
        compiled = real()
        counts["compiled"] += 1
        record = _record(self, compiled)
        data = zlib.compress(pickle.dumps(record), 1)  # HLO text: ~10x
        if _reads_back(data, record, self, compiled):
            with tempfile.NamedTemporaryFile(dir=folder, delete=False) as partial:
                partial.write(data)
            os.replace(partial.name, path)  # whole or not at all, for the other worker
        return compiled

    jax.stages.Lowered.compile = compile
