"""The native CPU kernels' build: C++ sources compiled on first use with the host's compiler and
registered as XLA FFI custom calls, which jitted code calls.

XLA's CPU backend leaves two things slow that matter for serving: attention over a paged KV cache
(gathers and tiny batched matmuls; its kernel lives with the other attention implementations) and
matmuls of a few rows (2-32 rows at a third of the memory bandwidth; `gemm_cpu`). This module
builds them.

A library is compiled with -O3 -march=native into `~/.cache/xlaserve/kernels` (or
`$XLASERVE_CACHE_DIR/kernels`), named by a hash of its source, the headers beside it and the
shared ones, the flags, the compiler and the CPU, so an edit or another machine rebuilds it.
Where another user could write to that folder (cache_root.private_dir), it is not used: each
library is built afresh in a temporary folder and loaded from there. With no compiler (or a
failing one) `KernelUnavailable` is raised, and callers fall back to plain XLA.
`$XLASERVE_CPU_MARCH` builds every kernel for another -march than native (x86-64-v3: AVX2, no
AVX-512 or VNNI), to time the paths another CPU would take on this one.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax

from xlaserve.cache_root import private_dir, xlaserve_cache_dir

HEADER_DIR = Path(__file__).parent  # parallel.h and vectors.h, shared by every kernel
PACKAGE_DIR = HEADER_DIR.parent  # xlaserve/: a `Registration` names its source from here
_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp-simd", "-fno-math-errno",
          "-ffp-contract=fast"]


logger = logging.getLogger(__name__)


class KernelUnavailable(RuntimeError):
    """A native kernel could not be built or loaded here."""


def builds(load, instead: str) -> bool:
    """Whether `load` (a kernel module's build and registration) succeeds here; where it does
    not, one warning saying so and what runs `instead`."""
    try:
        load()
        return True
    except KernelUnavailable as error:
        logger.warning("%s: %s", instead, error)
        return False


@dataclasses.dataclass(frozen=True)
class Registration:
    """One `register` call, as another process makes it again (`again`): a program compiled here
    that calls the custom call needs its handler registered wherever it is loaded
    (runtime/compile/native_kernels.py)."""

    source: str  # relative to PACKAGE_DIR, so that a moved checkout finds it
    symbol: str
    target_name: str
    march: str | None  # as asked: None is the loading process's default_march()

    def again(self) -> ctypes.CDLL:
        return register(PACKAGE_DIR / self.source, self.symbol, self.target_name, self.march)


_REGISTERED: dict[str, Registration] = {}  # target name -> this process's registration of it


def registered() -> dict[str, Registration]:
    """{target name: its Registration} of every custom call `register` made in this process."""
    return dict(_REGISTERED)


def cache_dir() -> Path:
    return Path(xlaserve_cache_dir()) / "kernels"


@functools.cache
def cpu_signature() -> str:
    """What -march=native depends on: the machine and its CPU flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return platform.machine() + flags


def _compile(compiler: str, source: Path, library: Path, march: str) -> None:
    library.parent.mkdir(parents=True, exist_ok=True)
    # Compile to a temporary name and rename: processes building at once never load half a file.
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        partial = Path(tmp) / library.name
        command = [compiler, *_FLAGS, f"-march={march}", f"-I{jax.ffi.include_dir()}",
                   f"-I{HEADER_DIR}", str(source), "-o", str(partial)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise KernelUnavailable(f"compiling {source.name} failed:\n{' '.join(command)}\n"
                                    f"{result.stderr[-4000:]}")
        os.replace(partial, library)


def default_march() -> str:
    return os.environ.get("XLASERVE_CPU_MARCH") or "native"


@functools.cache
def register(source: Path, symbol: str, target_name: str, march: str | None = None) -> ctypes.CDLL:
    """Builds `source` (once per source, flags and CPU), registers its handler `symbol` as the
    CPU custom call `target_name`, and returns the library (for its other exported functions).
    `march`: the -march the library is built for; another than "native" (x86-64-v3: AVX2 without
    AVX-512 or VNNI; x86-64-v2: no AVX2) lets tests run a kernel's other paths on this CPU;
    None: $XLASERVE_CPU_MARCH or native."""
    registration = Registration(os.path.relpath(source, PACKAGE_DIR), symbol, target_name, march)
    march = march or default_march()
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise KernelUnavailable("no C++ compiler found (set $CXX)")
    headers = sorted(set(HEADER_DIR.glob("*.h")) | set(source.parent.glob("*.h")))
    key = hashlib.sha256(b"\0".join([
        source.read_bytes(), *(h.read_bytes() for h in headers), " ".join(_FLAGS).encode(),
        march.encode(), compiler.encode(), cpu_signature().encode(), jax.ffi.include_dir().encode()])).hexdigest()
    name = f"{source.stem}-{key[:20]}.so"
    cached = private_dir(cache_dir())
    if cached is None:  # built where no one else writes; a loaded library needs its file no more
        with tempfile.TemporaryDirectory(prefix="xlaserve-kernels-") as folder:
            loaded, handler = _build_and_load(compiler, source, Path(folder) / name, symbol,
                                              march)
    else:
        loaded, handler = _build_and_load(compiler, source, cached / name, symbol, march)
    jax.ffi.register_ffi_target(target_name, jax.ffi.pycapsule(handler), platform="cpu")
    _REGISTERED[target_name] = registration
    return loaded


def _build_and_load(compiler: str, source: Path, library: Path, symbol: str, march: str):
    """(the library, its function `symbol`), compiled first unless `library` exists."""
    if not library.exists():
        _compile(compiler, source, library, march)
    try:
        loaded = ctypes.cdll.LoadLibrary(str(library))
        return loaded, getattr(loaded, symbol)
    except (OSError, AttributeError) as error:
        raise KernelUnavailable(f"loading {library} failed: {error}") from error
