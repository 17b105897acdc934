"""The kernels a forward pass runs with (`transformer.Kernels`), picked for the platform: the
attention backend (see pallas_kernels/ragged_paged_attention/api.py) and, on a single CPU
device, the native few-row matmul for decode steps (xlaserve/native/matmul_cpu.cc)."""
from __future__ import annotations

import functools
import logging

import jax
from jax.sharding import Mesh

from xlaserve.model.transformer import Kernels
from xlaserve.native import KernelUnavailable, matmul_cpu
from xlaserve.pallas_kernels.ragged_paged_attention.api import get_attention_fn

logger = logging.getLogger(__name__)


def kernels_for(attention_backend: str = "auto", mesh: Mesh | None = None) -> Kernels:
    few_row_matmul = None
    # A custom call is not split by XLA's partitioner: on a mesh the dots stay XLA's.
    if jax.default_backend() == "cpu" and (mesh is None or mesh.size == 1) and _matmul_builds():
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
