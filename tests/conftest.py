"""Shared test setup: a persistent XLA compilation cache so reruns skip compiles, --slow, and the
compile-only TPU/GPU packages (`make test` installs them into .venv/aot, outside the serving
environment) on the path, with JAX kept on the CPU."""
import os

import pytest

from xlaserve.runtime.aot import use_compile_only_packages
from xlaserve.runtime.compilation import enable_persistent_cache

use_compile_only_packages()  # before any backend starts

# Set before anything compiles; the cache survives across CI runs on the same machine.
enable_persistent_cache(os.environ.get("XLASERVE_TEST_CACHE_DIR"))


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False, help="run slow tests too")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--slow"):
        return
    skip_slow = pytest.mark.skip(reason="slow: run with --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)
