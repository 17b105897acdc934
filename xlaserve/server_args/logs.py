"""--log-level applied (`configure_logging`), by the entry points once the flags are parsed."""
from __future__ import annotations

import logging


def configure_logging(log_level: str) -> None:
    """The root logger at `log_level`, and JAX's own loggers at WARNING at least: at INFO they
    printed a start-up line for every backend JAX probes and fails ("Unable to initialize backend
    'tpu' ... Failed to open libtpu.so" on a CPU or GPU machine with libtpu installed) and two
    "Resetting cache" lines per precompiled program (runtime/compile/executable_cache.py toggles JAX's
    cache around each compile). `--log-level debug` shows them."""
    level = getattr(logging, log_level.upper())
    logging.basicConfig(level=level, format="[%(asctime)s] %(message)s",
                        datefmt="%Y-%m-%d %H:%M:%S")
    logging.getLogger("jax").setLevel(max(level, logging.WARNING))
