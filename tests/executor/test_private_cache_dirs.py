"""Cache folders hold what the process runs or unpickles, so each goes through
cache_root.private_dir: created 0700, and one that another user could write to is neither read
nor written (JAX's compilation cache, the executable cache, converted models, native kernels)."""
import logging
import os
import shutil

import jax
import numpy as np
import pytest

from xlaserve import cache_root
from xlaserve.cache_root import private_dir
from xlaserve.weights.conversion_cache import ConversionCache
from xlaserve.runtime.compile.persistent_cache import enable_persistent_cache
from xlaserve.runtime.compile.executable_cache import ExecutableCache


@pytest.fixture
def shared(tmp_path):
    """A folder everyone may write to, as /tmp is, or a group folder a careless chmod made."""
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(0o777)
    return folder


def test_a_new_folder_is_created_for_its_owner_only(tmp_path):
    created = private_dir(tmp_path / "a" / "b")
    assert created == tmp_path / "a" / "b" and created.stat().st_mode & 0o777 == 0o700


def test_a_folder_others_can_write_to_or_owned_by_another_user_is_refused(tmp_path, shared, caplog,
                                                                          monkeypatch):
    with caplog.at_level(logging.WARNING, logger="xlaserve.cache_root"):
        assert private_dir(shared) is None
    assert "writable by other users" in caplog.text
    group = tmp_path / "group"
    group.mkdir()
    group.chmod(0o770)
    assert private_dir(group) is None
    mine = tmp_path / "mine"
    mine.mkdir()
    mine.chmod(0o755)  # readable by others is fine: only writing plants code
    assert private_dir(mine) == mine
    uid = os.getuid()
    monkeypatch.setattr(cache_root.os, "getuid", lambda: uid + 1)
    assert private_dir(mine) is None


def test_jax_compilation_cache_is_not_turned_on_in_a_shared_folder(shared):
    before = jax.config.jax_compilation_cache_dir
    try:
        assert enable_persistent_cache(str(shared)) is None
        assert jax.config.jax_compilation_cache_dir == before
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_the_executable_cache_refuses_a_shared_folder(shared, tmp_path):
    assert ExecutableCache.open(str(shared)) is None
    opened = ExecutableCache.open(str(tmp_path / "executables"))
    assert opened is not None and opened.directory.stat().st_mode & 0o777 == 0o700


def test_converted_models_are_neither_written_nor_read_in_a_shared_folder(shared):
    cache = ConversionCache(str(shared))
    with cache.writing(__file__, np.float32, config=None) as directory:  # nothing to publish
        assert directory is None
    assert cache.lookup(__file__, np.float32) is None and os.listdir(shared) == []


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="no C++ compiler")
def test_native_kernels_are_built_afresh_outside_a_shared_folder(shared, tmp_path, monkeypatch):
    from xlaserve.native import build

    source = tmp_path / "probe_cpu.cc"
    source.write_text('extern "C" int xlaserve_probe() { return 7; }\n')
    monkeypatch.setattr(build, "cache_dir", lambda: shared)
    # Not an FFI handler: registered for real, XLA would call it when the CPU backend starts.
    monkeypatch.setattr(build.jax.ffi, "register_ffi_target", lambda *args, **kwargs: None)
    library = build.register(source, "xlaserve_probe", "xlaserve_private_dir_probe")
    assert library.xlaserve_probe() == 7
    assert os.listdir(shared) == []
