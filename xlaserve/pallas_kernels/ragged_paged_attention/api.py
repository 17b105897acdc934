"""Picks the ragged paged attention implementation.

Every backend has the signature of `reference.ragged_paged_attention`. The Pallas TPU and GPU
kernels plug in here; with "auto" they are chosen by `jax.default_backend()`, and the pure-jnp
reference serves the CPU (and every platform until those kernels exist).
"""
from typing import Callable

from xlaserve.pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention

BACKENDS = ("auto", "reference", "pallas")


def get_attention_fn(backend: str = "auto") -> Callable:
    """Returns the attention function for `backend`: "auto", "reference" or "pallas"."""
    if backend in ("auto", "reference"):
        return ragged_paged_attention
    if backend == "pallas":
        raise ValueError("the Pallas attention kernels are not built yet; "
                         "use --attention-backend reference")
    raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")
