"""Shared test setup: a persistent XLA compilation cache so reruns skip compiles, the outcomes of
TPU and GPU compiles kept likewise (tests/compile_outcomes.py), CPU programs at LLVM -O0, --slow,
and the compile-only TPU/GPU packages (`make test` installs them into .venv/aot, outside the
serving environment) on the path, with JAX kept on the CPU."""
import atexit
import gc
import os
import shutil
import tempfile

import pytest
from jax._src import compiler as jax_compiler

from tests import compile_outcomes
from xlaserve.runtime.executor.aot import use_compile_only_packages
from xlaserve.runtime.compile.persistent_cache import enable_persistent_cache

use_compile_only_packages()  # before any backend starts
compile_outcomes.install()  # TPU and GPU programs compiled once, read back on warm runs

# Tiny random checkpoints of each family, made once per session for tests/model and tests/weights.
pytest_plugins = ["tests.checkpoint_fixtures"]

# Set before anything compiles; the cache survives across CI runs on the same machine.
enable_persistent_cache(os.environ.get("XLASERVE_TEST_CACHE_DIR"))

# The CPU programs of this process at LLVM's -O0: the same optimized HLO (XLA's HLO passes do not
# read the level; test_cpu_programs_at_o0.py checks it on a model's step), only the machine code
# less optimized. Compiling is most of a cold run: tests/engine/test_tree_drafting.py and
# test_speculative_decoding.py from an empty cache took 306 s at the default level and 202 s at
# -O0 (backend compiles 239 -> 133 s), warm 77 -> 70 s (2-core Zen 4, 2026-11-29). Servers and
# benchmarks a test starts in a process of their own compile as a user's do; so do the TPU and GPU
# programs compiled here for other targets.
_get_compile_options = jax_compiler.get_compile_options


def _cpu_programs_at_o0(*args, backend=None, **kwargs):
    options = _get_compile_options(*args, backend=backend, **kwargs)
    if backend is not None and backend.platform == "cpu":
        options.executable_build_options.debug_options.xla_backend_optimization_level = 0
    return options


jax_compiler.get_compile_options = _cpu_programs_at_o0

# Converted models (weights/conversion_cache.py), of this process and the servers it starts, go to
# a folder of this session, never the user's cache (unless XLASERVE_CONVERSION_CACHE_DIR is set).
if not os.environ.get("XLASERVE_CONVERSION_CACHE_DIR"):
    os.environ["XLASERVE_CONVERSION_CACHE_DIR"] = tempfile.mkdtemp(prefix="xlaserve-converted-")
    atexit.register(shutil.rmtree, os.environ["XLASERVE_CONVERSION_CACHE_DIR"], True)

# Serving steps compile as they always did, through JAX's cache: the executable cache compiles
# afresh on each miss (runtime/compile/executable_cache.py), which every change of xlaserve makes, so it
# stays off for this process and the servers it starts, but in tests/executor/test_executable_cache.py.
os.environ.setdefault("XLASERVE_EXECUTABLE_CACHE", "0")


# Every compiled CPU program holds three memory mappings (its code and data), and the kernel allows
# a process 65,530 (vm.max_map_count); past it XLA dies (SIGSEGV or abort). The engines a test
# module drops sit in reference cycles, which only Python's rare full collection frees: one
# worker of `make test` held 56,754 mappings (2026-11-29); tests/engine/test_speculative_decoding.py
# alone left 19,295, 1,336 after a gc.collect(). So after a module that added many since the last
# full collection, one more (not after every module over a bound: the kernels' jitted programs
# stay alive, and rightly, so it ran after nearly every module).
MAPPINGS_GROWTH_BEFORE_COLLECT = 8_000
_mappings_after_collect = [0]


def _mappings() -> int:
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:  # not Linux
        return 0


@pytest.fixture(autouse=True, scope="module")
def _collect_dropped_engines():
    yield
    if _mappings() > _mappings_after_collect[0] + MAPPINGS_GROWTH_BEFORE_COLLECT:
        gc.collect()
        _mappings_after_collect[0] = _mappings()


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False, help="run slow tests too")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--slow"):
        return
    skip_slow = pytest.mark.skip(reason="slow: run with --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)
