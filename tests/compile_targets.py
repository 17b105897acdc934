"""Compile-only TPU and GPU devices for the tests (executor/aot.py), skipped with the reason where
the package that provides them is not installed (`make test` installs both into .venv/aot)."""
import functools
import re

import jax
import jax.numpy as jnp
import pytest

from xlaserve.executor import aot


@functools.cache
def _devices(target: str):
    try:
        return aot.target_devices(target)
    except aot.TargetUnavailable as error:
        return str(error)


def devices(target: str):
    """(platform, devices) of `target` ("v5e:2x2", "v6e:2x2", "h100"), or the test skips."""
    found = _devices(target)
    if isinstance(found, str):
        pytest.skip(found)
    return found


def cache_copies(hlo: str, shape, dtype) -> list[str]:
    """Instructions of a compiled program (its HLO text) that copy a whole array of the cache's
    shape: a relayout, or a copy XLA inserted for an in-place update it could not do in place."""
    name = {"bfloat16": "bf16", "float32": "f32"}[jnp.dtype(dtype).name]
    pattern = "= " + re.escape(f"{name}[{','.join(map(str, shape))}]") + r"\{[^}]*\} copy\("
    return [line.strip()[:200] for line in hlo.splitlines() if re.search(pattern, line)]


def compile_for(mesh, fn, *args, **kwargs):
    """`fn` (jitted) traced with abstract args, lowered and compiled for the mesh's devices."""
    with jax.set_mesh(mesh):
        return fn.trace(*args, **kwargs).lower().compile()
