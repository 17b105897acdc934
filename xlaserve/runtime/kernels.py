"""The kernels a forward pass runs with (`transformer.Kernels`), picked for the platform: the
attention backend (see pallas_kernels/ragged_paged_attention/api.py) and, on a single CPU
device, the native few-row matmul for decode steps (xlaserve/native/matmul_cpu.cc) where it is
faster than XLA's dot on this machine: it was 2.4x faster for bfloat16 on an Intel Xeon with
AMX, and 3x slower for float32 on an AMD EPYC without AVX-512, so the choice is measured."""
from __future__ import annotations

import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from xlaserve.model.transformer import Kernels
from xlaserve.native import KernelUnavailable, matmul_cpu
from xlaserve.pallas_kernels.ragged_paged_attention.api import get_attention_fn

logger = logging.getLogger(__name__)


def kernels_for(attention_backend: str = "auto", mesh: Mesh | None = None, *,
                matmul_shape: tuple[int, int] | None = None, dtype=None) -> Kernels:
    """`matmul_shape` (K, N) and `dtype`: a weight of the model, to time the native few-row matmul
    against XLA's dot on (without them the native kernel is used whenever it builds)."""
    few_row_matmul = None
    # A custom call is not split by XLA's partitioner: on a mesh the dots stay XLA's.
    if jax.default_backend() == "cpu" and (mesh is None or mesh.size == 1) and _matmul_builds() and (
            matmul_shape is None or _native_matmul_is_faster(tuple(matmul_shape), np.dtype(dtype).name)):
        few_row_matmul = matmul_cpu.few_row_matmul
    return Kernels(attention=get_attention_fn(attention_backend, mesh),
                   few_row_matmul=few_row_matmul)


@functools.cache
def _matmul_builds() -> bool:
    try:
        matmul_cpu.load()
        return True
    except KernelUnavailable as error:
        logger.warning("The CPU few-row matmul kernel is unavailable; decode steps use XLA's "
                       "slower dots: %s", error)
        return False


@functools.cache
def _native_matmul_is_faster(shape: tuple[int, int], dtype: str) -> bool:
    """Times a 1-row product with both over weights of `shape` that together outgrow the caches
    (a decode step streams every weight from memory); best of three rounds each."""
    k, n = shape
    count = max(2, (96 << 20) // (k * n * np.dtype(dtype).itemsize))
    rng = np.random.default_rng(0)
    weights = [jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02, dtype) for _ in range(count)]
    x = jnp.ones((1, k), jnp.float32)
    native = jax.jit(matmul_cpu.few_row_matmul)
    xla = jax.jit(lambda x, w: jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32))

    def seconds(fn) -> float:
        jax.block_until_ready([fn(x, w) for w in weights[:2]])  # compile
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            jax.block_until_ready([fn(x, w) for w in weights])
            best = min(best, time.perf_counter() - start)
        return best / count

    native_s, xla_s = seconds(native), seconds(xla)
    logger.info("CPU few-row matmul, 1 x %d x %d %s: native %.3f ms, XLA %.3f ms: using %s", k, n,
                dtype, native_s * 1e3, xla_s * 1e3, "native" if native_s < xla_s else "XLA")
    return native_s < xla_s
