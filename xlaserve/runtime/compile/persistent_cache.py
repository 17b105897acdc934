"""JAX's persistent compilation cache: a second start reuses the programs the first compiled."""
from __future__ import annotations

import os

import jax

from xlaserve.cache_root import private_dir, xlaserve_cache_dir


def enable_persistent_cache(cache_dir: str | None = None,
                            min_compile_seconds: float = 0.5) -> str | None:
    """Turns JAX's persistent compilation cache on in `cache_dir` (default: the `xla` folder of
    xlaserve's cache root); returns the folder, or None where another user could write to it
    (cache_root.private_dir): then it is not turned on, and programs compile afresh."""
    checked = private_dir(cache_dir or os.path.join(xlaserve_cache_dir(), "xla"))
    if checked is None:
        return None
    cache_dir = str(checked)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds)
    return cache_dir
