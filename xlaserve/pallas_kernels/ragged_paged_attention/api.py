"""Picks the ragged paged attention implementation.

Every backend has the signature of `reference.ragged_paged_attention` (the specification):
- "reference": the pure-jnp version, on any platform;
- "cpu": `kernel_cpu` (C++ through XLA's FFI, built on first use), the CPU's fast path;
- "pallas": the Pallas TPU and GPU kernels (issue 6; not built yet).
"auto" takes the platform's kernel, and the reference where there is none or it cannot be built.

A kernel is a custom call that XLA's partitioner cannot split, so on a mesh with a "tensor" axis
it runs under `shard_map`, each device on its own kv heads (the cache is split by kv head too).
"""
from __future__ import annotations

import functools
import logging
from typing import Callable

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from xlaserve.pallas_kernels.ragged_paged_attention import kernel_cpu
from xlaserve.pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "reference", "cpu", "pallas")


def get_attention_fn(backend: str = "auto", mesh: Mesh | None = None) -> Callable:
    """The attention function for `backend` ("auto", "reference", "cpu" or "pallas")."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")
    platform = jax.default_backend()
    if backend == "auto":
        backend = "cpu" if platform == "cpu" and _cpu_kernel_builds() else "reference"
    if backend == "reference":
        return ragged_paged_attention
    if backend == "pallas":
        raise ValueError("the Pallas attention kernels are not built yet; "
                         "use --attention-backend reference")
    if platform != "cpu":
        raise ValueError(f"--attention-backend cpu runs on the CPU, not on {platform}")
    kernel_cpu.load()  # raises KernelUnavailable with the compiler's message
    return _split_by_kv_head(kernel_cpu.ragged_paged_attention, mesh)


@functools.cache
def _cpu_kernel_builds() -> bool:
    try:
        kernel_cpu.load()
        return True
    except kernel_cpu.KernelUnavailable as error:
        logger.warning("The CPU attention kernel is unavailable, using the slower jnp reference: %s",
                       error)
        return False


def _split_by_kv_head(kernel: Callable, mesh: Mesh | None) -> Callable:
    if mesh is None or mesh.shape.get("tensor", 1) == 1:
        return kernel
    heads = P(None, "tensor", None)  # q [T, Hq, D], k and v [T, Hkv, D]
    cache = P(None, None, "tensor", None)  # [pages, page_size, 2 * Hkv, D], K/V pairs per head
    metadata = P()

    @functools.wraps(kernel)
    def sharded(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
        body = functools.partial(kernel, **options)
        return jax.shard_map(body, mesh=mesh, in_specs=(heads, heads, heads, cache) + (metadata,) * 4,
                             out_specs=(heads, cache), check_vma=False)(
            q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs)

    return sharded
