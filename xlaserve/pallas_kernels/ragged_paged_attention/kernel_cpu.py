"""Ragged paged attention on the CPU: `kernel_cpu.cc` as an XLA FFI custom call.

Same signature and semantics as `reference.ragged_paged_attention` (the specification), at memory
speed: the jnp reference runs on XLA's CPU backend as gathers, transposes and tiny batched matmuls
(3 ms per layer for 64 decoding sequences of 100 tokens, where reading their KV takes 0.5 ms).

The C++ source is compiled on first use with the host's compiler (`$CXX`, else `c++`) for the
host's instruction set, into `~/.cache/xlaserve/kernels` (or `$XLASERVE_CACHE_DIR/kernels`), named
by a hash of the source, the flags and the CPU, so an edit or another machine rebuilds it. Without
a compiler `KernelUnavailable` is raised and `api.py` falls back to the reference.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import numpy as np

TARGET_NAME = "xlaserve_ragged_paged_attention_cpu"
_SOURCE = Path(__file__).with_name("kernel_cpu.cc")
_FLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fopenmp-simd",
          "-fno-math-errno"]


class KernelUnavailable(RuntimeError):
    """The CPU kernel could not be built or loaded here."""


def cache_dir() -> Path:
    root = os.environ.get("XLASERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                "xlaserve")
    return Path(root) / "kernels"


def _cpu_signature() -> str:
    """What -march=native depends on: the machine and its CPU flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return platform.machine() + flags


def _build(compiler: str, library: Path) -> None:
    library.parent.mkdir(parents=True, exist_ok=True)
    # Compile to a temporary name and rename: processes building at once never load half a file.
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        partial = Path(tmp) / library.name
        command = [compiler, *_FLAGS, f"-I{jax.ffi.include_dir()}", str(_SOURCE), "-o", str(partial)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise KernelUnavailable(f"compiling the CPU attention kernel failed:\n{' '.join(command)}\n"
                                    f"{result.stderr[-4000:]}")
        os.replace(partial, library)


@functools.cache
def load() -> None:
    """Builds (once per source, flags and CPU) and registers the custom call target."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise KernelUnavailable("no C++ compiler found (set $CXX)")
    key = hashlib.sha256(b"\0".join([_SOURCE.read_bytes(), " ".join(_FLAGS).encode(),
                                     compiler.encode(), _cpu_signature().encode(),
                                     jax.ffi.include_dir().encode()])).hexdigest()[:20]
    library = cache_dir() / f"ragged_paged_attention_cpu-{key}.so"
    if not library.exists():
        _build(compiler, library)
    try:
        handler = ctypes.cdll.LoadLibrary(str(library)).XlaserveRaggedPagedAttention
    except (OSError, AttributeError) as error:
        raise KernelUnavailable(f"loading {library} failed: {error}") from error
    jax.ffi.register_ffi_target(TARGET_NAME, jax.ffi.pycapsule(handler), platform="cpu")


def ragged_paged_attention(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                           sm_scale, sliding_window=None, soft_cap=None):
    """See `reference.ragged_paged_attention`; returns (out, kv_cache), the cache updated in place
    (the custom call's cache output aliases its input)."""
    load()
    if q.dtype not in (np.float32, jax.numpy.bfloat16) or kv_cache.dtype != q.dtype:
        raise ValueError("the CPU attention kernel takes q and a KV cache of one dtype, float32 or "
                         f"bfloat16; got {q.dtype} and {kv_cache.dtype}")
    call = jax.ffi.ffi_call(
        TARGET_NAME,
        (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype)),
        input_output_aliases={3: 1},
    )
    as_i32 = functools.partial(jax.numpy.asarray, dtype=np.int32)
    return call(q, k.astype(q.dtype), v.astype(q.dtype), kv_cache, as_i32(kv_lens),
                as_i32(page_indices), as_i32(cu_q_lens), as_i32(num_seqs),
                sm_scale=np.float32(sm_scale), sliding_window=np.int32(sliding_window or 0),
                soft_cap=np.float32(soft_cap or 0.0))
