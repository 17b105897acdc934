"""Shared test setup: a persistent XLA compilation cache so reruns skip compiles, and --slow."""
import os

import pytest

# Must be set before jax compiles anything; the cache survives across CI runs on the same machine.
os.environ.setdefault("XLASERVE_CACHE_DIR", os.path.expanduser("~/.cache/xlaserve"))

import jax  # noqa: E402

jax.config.update("jax_compilation_cache_dir", os.path.join(os.environ["XLASERVE_CACHE_DIR"], "xla"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False, help="run slow tests too")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--slow"):
        return
    skip_slow = pytest.mark.skip(reason="slow: run with --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)
