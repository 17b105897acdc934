"""JAX's persistent compilation cache: a second start reuses the programs the first compiled."""
from __future__ import annotations

import os

import jax

DEFAULT_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "xlaserve", "xla")


def enable_persistent_cache(cache_dir: str | None = None, min_compile_seconds: float = 0.5) -> str:
    cache_dir = os.path.expanduser(cache_dir or DEFAULT_CACHE_DIR)
    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds)
    return cache_dir
