"""Compile-only TPU and GPU devices for the tests (runtime/executor/aot.py), skipped with the reason where
the package that provides them is not installed (`make test` installs both into .venv/aot)."""
import functools
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from benchmarks.model_options import first_layers_config
from xlaserve.runtime.executor import aot

CONFIGS = Path(__file__).parents[1] / "benchmarks" / "configs"


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


HLO_TYPES = {"bfloat16": "bf16", "float32": "f32", "float8_e4m3fn": "f8e4m3fn",
             "float8_e5m2": "f8e5m2"}  # a dtype's name in HLO text


def cache_copies(hlo: str, shape, dtype) -> list[str]:
    """Instructions of a compiled program (its HLO text) that copy a whole array of the cache's
    shape: a relayout, or a copy XLA inserted for an in-place update it could not do in place."""
    name = HLO_TYPES[jnp.dtype(dtype).name]
    pattern = "= " + re.escape(f"{name}[{','.join(map(str, shape))}]") + r"\{[^}]*\} copy\("
    return [line.strip()[:200] for line in hlo.splitlines() if re.search(pattern, line)]


def compile_for(mesh, fn, *args, **kwargs):
    """`fn` (jitted) traced with abstract args, lowered and compiled for the mesh's devices."""
    with jax.set_mesh(mesh):
        return fn.trace(*args, **kwargs).lower().compile()


def first_layers(config: str, num_layers: int | None, directory: Path) -> str:
    """A model path for benchmarks/configs/`config` cut to its first `num_layers` decoder layers
    (None: the whole model, the path itself). Every layer of these models has the same shapes,
    so a step of a few compiles the same placement, donation and fusions as the whole model's,
    and takes the per-layer checks alike, in a fraction of the time (Llama-3.1-8B's v6e tp 4
    step: 19 s with 2 layers, 70 s with 32; Qwen3-30B-A3B's at ep 4: 9 s with 2, 33 s with 48;
    a 2-core Zen 5). The whole models stay under --slow."""
    if num_layers is None:
        return str(CONFIGS / config)
    whole = json.loads((CONFIGS / config / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(first_layers_config(whole, num_layers)))
    return str(directory)


def weight_bytes(program) -> int:
    """Bytes of a step program's weights (its first argument), whole (not per device)."""
    return sum(w.size * w.dtype.itemsize for w in jax.tree.leaves(program.args[0]))
