"""Compiled serving steps on disk, keyed by what they are made from: a warm start loads them
instead of tracing and lowering the step again.

JAX's persistent compilation cache (runtime/compile/persistent_cache.py) is keyed by the lowered program, so a
start that hits it still traces and lowers every step first: for the default model's 10 programs,
3.4-4.7 s of a 13-14 s warm start, and running each once with padding rows another ~1.3 s
(2-core Zen 4). This cache is keyed by the program's ingredients instead: the source of the
xlaserve package; the versions of jax, jaxlib, its plugins, flax and numpy; the backend, its
devices and the host CPU's flags; the XLA flags; the caller's description (model config, dtype,
kernels); every argument's shape, dtype and sharding and the static arguments. An entry holds the
compiled executable (`jax.experimental.serialize_executable`); a hit deserializes it and nothing
is traced (the default model's 10 programs: 0.9-1.0 s on one thread, 0.57 s on two).

Why a miss compiles with JAX's persistent cache turned off: an executable JAX loaded from its
cache cannot be serialized again on the CPU; the copy lacks its compiled functions and fails when
called ("Function slice_bitcast_fusion.67 not found", JAX 0.10.2 and 0.11). So an entry is always
written from a fresh compile, once per change of xlaserve, JAX or the model.

An entry is `MAGIC | crc32 | length | pickle(executable, in_tree, out_tree, kernels)`, `kernels`
being the native CPU kernels the program calls, registered before it is deserialized (it fails
to load otherwise: runtime/compile/native_kernels.py), written to a temporary file and renamed;
one that does not check out is deleted and compiled again, never loaded. Entries unused for 30
days go when a new one is written.

`XLASERVE_EXECUTABLE_CACHE=0` (the tests set it; tests/executor/test_executable_cache.py turns it
back on) or `--disable-executable-cache` keeps JAX's own cache only.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import logging
import os
import pickle
import struct
import tempfile
import threading
import time
import types
import zlib
from importlib import metadata
from pathlib import Path
from typing import Callable

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache
from jax.experimental.serialize_executable import deserialize_and_load, serialize

from xlaserve.cache_root import private_dir
from xlaserve.native.build import cpu_signature
from xlaserve.runtime.compile.native_kernels import kernels_called, register_kernels

logger = logging.getLogger(__name__)

FORMAT = 2  # bump when an entry's layout or the key's recipe changes
MAGIC = b"XLSEXE\x00\x01"
_HEADER = struct.Struct("<8sIQ")  # magic, crc32 of the payload, payload length
SUFFIX = ".exe"
MAX_UNUSED_DAYS = 30
_TOGGLE = threading.Lock()  # one fresh compile at a time: it turns a process-wide setting off
_PACKAGE = Path(__file__).resolve().parents[2]  # xlaserve/: every file of it keys the entries
_PACKAGES = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "libtpu", "flax", "numpy")


def enabled_by_environment() -> bool:
    return os.environ.get("XLASERVE_EXECUTABLE_CACHE") != "0"


@functools.cache
def source_fingerprint() -> str:
    """A hash of every source file of the xlaserve package (Python and the native kernels'
    C++): any change of code may change a program, so any change makes new keys."""
    digest = hashlib.sha256()
    for path in sorted(_PACKAGE.rglob("*")):
        if path.suffix in (".py", ".cc", ".h") and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(_PACKAGE)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.cache
def _versions() -> str:
    """The packages' versions (~1 ms each to look up, so once per process)."""
    found = []
    for package in _PACKAGES:
        try:
            found.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            found.append(f"{package} absent")
    return ", ".join(found)


def describe(value, depth: int = 0) -> str:
    """A text that names a kernel (function, partial, closure) by what it is, not where it lives
    in memory, so that two processes with the same kernels give the same text."""
    if depth > 6:
        return "..."
    if isinstance(value, functools.partial):
        return (f"partial({describe(value.func, depth + 1)}, "
                f"{[describe(a, depth + 1) for a in value.args]}, "
                f"{ {k: describe(v, depth + 1) for k, v in sorted(value.keywords.items())} })")
    if isinstance(value, types.FunctionType):
        cells = [describe(contents, depth + 1) for contents in _cell_contents(value)
                 if contents is not value]
        return f"{value.__module__}.{value.__qualname__}{cells if cells else ''}"
    if isinstance(value, (types.BuiltinFunctionType, type)):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    if isinstance(value, jax.sharding.Mesh):
        return f"Mesh({dict(value.shape)}, {[d.id for d in value.devices.flat]})"
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}({[describe(v, depth + 1) for v in value]})"
    if hasattr(value, "__dataclass_fields__"):
        fields = {name: describe(getattr(value, name), depth + 1) for name in value.__dataclass_fields__}
        return f"{type(value).__qualname__}({fields})"
    return type(value).__qualname__


def _cell_contents(function) -> list:
    contents = []
    for cell in function.__closure__ or ():
        with contextlib.suppress(ValueError):  # a cell not filled yet
            contents.append(cell.cell_contents)
    return contents


def _argument_signature(args) -> str:
    leaves, treedef = jax.tree.flatten(args)
    parts = [str(treedef)]
    for leaf in leaves:
        sharding = getattr(leaf, "sharding", None)
        devices = [d.id for d in sharding.device_set] if sharding is not None else []
        # An array's layout (the weights' are XLA's choice on TPU and GPU: weight_args.py)
        layout = getattr(getattr(leaf, "format", None), "layout", None)
        parts.append(f"{tuple(leaf.shape)}:{leaf.dtype}:{sharding}:{sorted(devices)}:{layout}")
    return "\n".join(parts)


def program_key(name: str, description: str, args, kwargs) -> str:
    """The cache key of `name` compiled for `args` (arrays or jax.ShapeDtypeStruct with their
    shardings) and static `kwargs` (their reprs go in the key)."""
    backend = jax.devices()[0].client
    parts = [
        f"format {FORMAT}", name, description, source_fingerprint(),
        _versions(),
        f"{backend.platform} {backend.platform_version}",
        # The host's CPU: XLA's CPU code is built for its instruction set (a cache folder carried
        # to another machine, or a CI runner that moved to another CPU, must not run it).
        cpu_signature(),
        f"{[(d.id, d.device_kind, d.process_index) for d in jax.devices()]}",
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}",
        f"LIBTPU_INIT_ARGS={os.environ.get('LIBTPU_INIT_ARGS', '')}",
        f"x64 {jax.config.jax_enable_x64}, matmul precision "
        f"{jax.config.jax_default_matmul_precision}",
        _argument_signature(args), repr(sorted(kwargs.items())),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:40]


@contextlib.contextmanager
def _fresh_compiles():
    """JAX's persistent cache off inside: what it would load could not be stored (module doc).
    `reset_cache` makes JAX read the setting again (it is read once per process otherwise)."""
    with _TOGGLE:
        was_enabled = jax.config.jax_enable_compilation_cache
        jax.config.update("jax_enable_compilation_cache", False)
        jax_cache.reset_cache()
        try:
            yield
        finally:
            jax.config.update("jax_enable_compilation_cache", was_enabled)
            jax_cache.reset_cache()


def compile_on_threads(lowered: list, threads: int,
                       on_done: Callable[[], None] | None = None) -> list:
    """`.compile()` of each of `lowered` (jax Lowered), `threads` at a time (XLA compiles without
    the GIL); `on_done` is called as each finishes (a progress bar). Lowering stays with the
    caller, one at a time: it traces Python."""
    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
        futures = [pool.submit(program.compile) for program in lowered]
        for _ in concurrent.futures.as_completed(futures):
            if on_done is not None:
                on_done()
        return [future.result() for future in futures]


class ExecutableCache:
    @classmethod
    def open(cls, directory: str) -> "ExecutableCache | None":
        """The cache in `directory`, or None where another user could write to it (it would
        load their pickles): cache_root.private_dir has warned, every program compiles."""
        checked = private_dir(directory)
        return None if checked is None else cls(checked)

    def __init__(self, directory: str | Path):
        self.directory = Path(directory).expanduser()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.loaded = 0  # entries loaded by this process
        self.compiled = 0  # programs compiled (and stored) by this process
        self._count_lock = threading.Lock()

    def path(self, args, kwargs, *, name: str, description: str) -> Path:
        """Where the entry of `name` compiled for `args` (arrays or jax.ShapeDtypeStruct with
        their shardings) and static `kwargs` lives."""
        return self.directory / (program_key(name, description, args, kwargs) + SUFFIX)

    def load(self, path: Path, devices):
        """The executable stored at `path` for `devices` (the program's mesh devices, in the
        mesh's order, which is how jit assigns them), or None (absent, or corrupt: then deleted).
        Safe to call from several threads: deserializing releases the GIL (10 programs of the
        default model: 0.9-1.0 s on one thread, 0.57 s on two, 2-core Zen 4)."""
        compiled = self._load(path, devices)
        if compiled is not None:
            with self._count_lock:
                self.loaded += 1
        return compiled

    def compile_and_store(self, jitted, args, kwargs, path: Path):
        """`jitted.lower(*args, **kwargs).compile()`, compiled afresh and stored at `path`."""
        return self.compile_and_store_all(jitted, [(args, kwargs)], [path])[0]

    def compile_and_store_all(self, jitted, lowerings: list, paths: list[Path], threads: int = 1,
                              on_done: Callable[[], None] | None = None) -> list:
        """`compile_and_store` of each (args, kwargs) of `lowerings` and its path, compiled on
        `threads` threads (`compile_on_threads`)."""
        with _fresh_compiles():
            lowered = [jitted.lower(*args, **kwargs) for args, kwargs in lowerings]
            compiled = compile_on_threads(lowered, threads, on_done)
        for program, path in zip(compiled, paths, strict=True):
            self.compiled += 1
            try:
                executable, in_tree, out_tree = serialize(program)
                self._store(path, pickle.dumps(
                    (executable, in_tree, out_tree, kernels_called(program)), protocol=5))
            except (ValueError, NotImplementedError, OSError, pickle.PicklingError) as error:
                logger.warning("Could not store a compiled program in %s: %s", self.directory,
                               error)
        return compiled

    def _load(self, path: Path, devices):
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as error:
            logger.warning("Executable cache entry %s unreadable (%s); compiling", path, error)
            return None
        problem = "is corrupt or partial"
        if len(data) >= _HEADER.size:
            magic, crc, length = _HEADER.unpack_from(data)
            payload = memoryview(data)[_HEADER.size:]
            if magic == MAGIC and length == len(payload) and zlib.crc32(payload) == crc:
                try:
                    executable, in_tree, out_tree, kernels = pickle.loads(payload)
                    # XLA binds the custom calls to their handlers as it loads the program, and
                    # a warm start traces no step that would have registered them.
                    register_kernels(kernels)
                    # Without `devices`, every device of the backend: XLA aborts the process
                    # (a CHECK) for a program of a data parallel replica's 4 of 8 devices.
                    compiled = deserialize_and_load(executable, in_tree, out_tree,
                                                    execution_devices=list(devices))
                    os.utime(path)  # its last use, for pruning
                    return compiled
                except Exception as error:  # noqa: BLE001 - a bad entry is rebuilt, whatever broke
                    problem = f"does not load ({error})"
        logger.warning("Executable cache entry %s %s; compiling it again", path.name, problem)
        path.unlink(missing_ok=True)
        return None

    def _store(self, path: Path, payload: bytes) -> None:
        header = _HEADER.pack(MAGIC, zlib.crc32(payload), len(payload))
        fd, temporary = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(temporary, path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        self._prune()

    def _prune(self) -> None:
        cutoff = time.time() - MAX_UNUSED_DAYS * 86400
        for entry in self.directory.glob("*" + SUFFIX):
            with contextlib.suppress(OSError):
                if entry.stat().st_mtime < cutoff:
                    entry.unlink()
