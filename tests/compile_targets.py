"""Compile-only TPU and GPU devices for the tests (runtime/aot.py), skipped with the reason where
the package that provides them is not installed (`make test` installs both into .venv/aot)."""
import functools

import jax
import pytest

from xlaserve.runtime import aot


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


def compile_for(mesh, fn, *args, **kwargs):
    """`fn` (jitted) traced with abstract args, lowered and compiled for the mesh's devices."""
    with jax.set_mesh(mesh):
        return fn.trace(*args, **kwargs).lower().compile()
