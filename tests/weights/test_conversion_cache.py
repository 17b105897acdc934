"""The conversion cache (weights/conversion_cache.py): a GGUF file converted once loads from its entry
with the same weights and tokenizer; a damaged entry is rebuilt, never loaded; the key follows the
source file and the dtype. Every cache lives in a tmp_path, never the user's ~/.cache."""
import argparse
import json
import logging
import os

import gguf
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from xlaserve.weights import conversion_cache
from xlaserve.weights.conversion_cache import MANIFEST, PARAMS, entry_key
from xlaserve.weights.loader import default_model_file, load_model
from xlaserve.server_args import ServerArgs

from .gguf_writer import write_llama_gguf
from .test_gguf_loading import _tiny_llama


@pytest.fixture(scope="module")
def tiny_model():
    return _tiny_llama(64)


@pytest.fixture
def gguf_path(tmp_path, tiny_model):
    path = str(tmp_path / "tiny.gguf")
    write_llama_gguf(path, tiny_model, gguf.GGMLQuantizationType.Q8_0)
    return path


def _load(path, cache_dir, caplog, **kwargs):
    """(loaded model, the loader's log lines) for one load, dequantized (XLA's dots: the
    conversion these tests are about; a kept-quantized load caches its float parameters only,
    tests/weights/test_gguf_kept.py)."""
    kwargs.setdefault("matmul_backend", "xla")
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="xlaserve.weights"):  # DEBUG: the cache's paths
        loaded = load_model(path, skip_tokenizer_init=kwargs.pop("skip_tokenizer_init", True),
                            progress=False, conversion_cache_dir=str(cache_dir), **kwargs)
    return loaded, caplog.text


def _weights(loaded) -> dict:
    return {path: np.asarray(v.get_value())
            for path, v in nnx.to_flat_state(nnx.state(loaded.model))}


def _assert_same_weights(a, b):
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for path in wa:
        assert wa[path].dtype == wb[path].dtype, path
        np.testing.assert_array_equal(wa[path], wb[path], err_msg=str(path))


def _entries(cache_dir) -> list[str]:
    return sorted(n for n in os.listdir(cache_dir) if not n.startswith("."))


def test_second_load_reads_the_cache_and_gives_the_same_weights_as_a_conversion(
        gguf_path, tmp_path, caplog):
    cache_dir = tmp_path / "cache"
    first, log = _load(gguf_path, cache_dir, caplog)
    assert "Converted GGUF" in log and "cached in" in log
    second, log = _load(gguf_path, cache_dir, caplog)
    assert "Loaded converted weights from cache" in log and "Converted" not in log
    # INFO names the file; where the entry is on this machine is a DEBUG line.
    info = "".join(r.getMessage() for r in caplog.records if r.levelno >= logging.INFO)
    assert str(cache_dir) not in info
    assert f"Conversion cache entry of {gguf_path}: {cache_dir}" in log
    assert second.config == first.config and second.source == gguf_path
    _assert_same_weights(first, second)
    uncached, _ = _load(gguf_path, cache_dir, caplog, conversion_cache=False)
    _assert_same_weights(uncached, second)


def test_entry_weights_are_a_standard_safetensors_file(gguf_path, tmp_path, caplog):
    cache_dir = tmp_path / "cache"
    loaded, _ = _load(gguf_path, cache_dir, caplog)
    [entry] = _entries(cache_dir)
    tensors = safetensors.numpy.load_file(str(cache_dir / entry / PARAMS))
    weights = _weights(loaded)
    assert {conversion_cache.param_path(name) for name in tensors} == set(weights)
    for name, array in tensors.items():
        np.testing.assert_array_equal(array, weights[conversion_cache.param_path(name)])


def _drop_manifest(entry):
    os.remove(entry / MANIFEST)


def _truncate_params(entry):
    with open(entry / PARAMS, "r+b") as f:
        f.truncate(os.path.getsize(entry / PARAMS) - 4)


def _change_a_byte(entry):
    with open(entry / PARAMS, "r+b") as f:
        f.seek(os.path.getsize(entry / PARAMS) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def _change_the_config(entry):
    config = json.loads((entry / "model_config.json").read_text())
    config["rms_norm_eps"] *= 2
    (entry / "model_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("damage", [_drop_manifest, _truncate_params, _change_a_byte,
                                    _change_the_config], ids=lambda f: f.__name__.strip("_"))
def test_damaged_entry_is_detected_and_rebuilt_not_loaded(gguf_path, tmp_path, caplog, damage):
    cache_dir = tmp_path / "cache"
    first, _ = _load(gguf_path, cache_dir, caplog)
    [entry] = _entries(cache_dir)
    damage(cache_dir / entry)
    rebuilt, log = _load(gguf_path, cache_dir, caplog)
    assert "is invalid" in log and "rebuilding" in log and "Converted GGUF" in log
    assert "Loaded converted weights" not in log
    assert rebuilt.config == first.config
    _assert_same_weights(first, rebuilt)
    again, log = _load(gguf_path, cache_dir, caplog)  # the rebuilt entry is whole
    assert "Loaded converted weights from cache" in log and "invalid" not in log
    _assert_same_weights(first, again)


def test_disabled_cache_neither_reads_nor_writes_entries(gguf_path, tmp_path, caplog):
    cache_dir = tmp_path / "cache"
    _, log = _load(gguf_path, cache_dir, caplog, conversion_cache=False)
    assert "conversion cache disabled" in log and not cache_dir.exists()
    _load(gguf_path, cache_dir, caplog)
    _, log = _load(gguf_path, cache_dir, caplog, conversion_cache=False)
    assert "Converted GGUF" in log and "Loaded converted weights" not in log


def test_disable_conversion_cache_flag_reaches_server_args():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert "--disable-conversion-cache" in parser.format_help()
    args = ServerArgs.from_cli_args(parser.parse_args(
        ["--disable-conversion-cache", "--conversion-cache-dir", "/tmp/somewhere"]))
    assert args.disable_conversion_cache and args.conversion_cache_dir == "/tmp/somewhere"
    assert not ServerArgs().disable_conversion_cache


def test_changed_source_file_gets_a_new_entry_with_its_own_weights(
        gguf_path, tmp_path, caplog, tiny_model):
    cache_dir = tmp_path / "cache"
    _load(gguf_path, cache_dir, caplog)
    [old_entry] = _entries(cache_dir)
    write_llama_gguf(gguf_path, tiny_model, gguf.GGMLQuantizationType.F32)  # new size and mtime
    changed, log = _load(gguf_path, cache_dir, caplog)
    assert "Converted GGUF" in log
    [new_entry] = _entries(cache_dir)  # the entry it replaces is gone
    assert new_entry != old_entry
    _assert_same_weights(changed, _load(gguf_path, cache_dir, caplog, conversion_cache=False)[0])


def test_key_follows_size_mtime_and_dtype(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"x" * 100)
    key = entry_key(str(path), np.float32)
    assert entry_key(str(path), np.float32) == key
    assert entry_key(str(tmp_path / "." / "model.gguf"), np.float32) == key  # the resolved path
    assert entry_key(str(path), "bfloat16") != key
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1000))
    touched = entry_key(str(path), np.float32)
    assert touched != key
    path.write_bytes(b"x" * 101)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1000))
    assert entry_key(str(path), np.float32) not in (key, touched)


def test_another_dtype_gets_its_own_entry(gguf_path, tmp_path, caplog):
    cache_dir = tmp_path / "cache"
    f32, _ = _load(gguf_path, cache_dir, caplog, dtype="float32")
    bf16, log = _load(gguf_path, cache_dir, caplog, dtype="bfloat16")
    assert "Converted GGUF" in log
    entries = _entries(cache_dir)
    assert len(entries) == 2
    sizes = sorted(os.path.getsize(cache_dir / e / PARAMS) for e in entries)
    assert sizes[0] < 0.6 * sizes[1]  # 2 bytes a value against 4
    _, log = _load(gguf_path, cache_dir, caplog, dtype="float32")
    assert "Loaded converted weights" in log
    for path, array in _weights(bf16).items():
        assert array.dtype.name == "bfloat16"
        np.testing.assert_array_equal(array, _weights(f32)[path].astype(array.dtype))


def test_unwritable_cache_still_loads_the_model(gguf_path, tmp_path, caplog):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    loaded, log = _load(gguf_path, not_a_folder, caplog)
    assert "not writable" in log and "not cached" in log
    assert loaded.config.num_layers == 2


def test_default_model_tokenizer_and_weights_from_the_cache_equal_the_conversion(tmp_path, caplog):
    """The one test on the default model (a real tokenizer with a chat template)."""
    cache_dir = tmp_path / "cache"
    converted, log = _load(None, cache_dir, caplog, skip_tokenizer_init=False)
    assert "Converted GGUF" in log
    cached, log = _load(None, cache_dir, caplog, skip_tokenizer_init=False)
    assert "Loaded converted weights from cache" in log
    assert cached.source == converted.source == default_model_file()
    assert cached.config == converted.config
    _assert_same_weights(converted, cached)
    a, b = converted.tokenizer, cached.tokenizer
    texts = ["The capital of France is", "  spaces\tand\nnewlines ", "émoji 🤗 and 中文",
             "<|im_start|>user\nhi<|im_end|>", ""]
    for text in texts:
        assert a.encode(text) == b.encode(text), text
        assert a(text)["input_ids"] == b(text)["input_ids"], text
    ids = a.encode(texts[2] + texts[3])
    assert a.decode(ids) == b.decode(ids)
    assert a.decode(ids, skip_special_tokens=True) == b.decode(ids, skip_special_tokens=True)
    assert (a.eos_token_id, a.bos_token_id, a.pad_token_id, len(a)) == \
        (b.eos_token_id, b.bos_token_id, b.pad_token_id, len(b))
    assert a.all_special_tokens == b.all_special_tokens
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert a.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        b.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_fast_gguf_reader_reads_what_ggufs_own_reader_reads(gguf_path):
    """gguf_file's reader (a plain view of the memory map, 3x faster) changes no field or tensor."""
    from xlaserve.weights.formats.gguf_file import _fast_reader, load_hf_config

    original = gguf.GGUFReader
    load_hf_config(gguf_path)  # transformers' reads get the fast reader only meanwhile
    assert gguf.GGUFReader is original
    own, fast = gguf.GGUFReader(gguf_path), _fast_reader()(gguf_path)
    assert list(own.fields) == list(fast.fields)
    assert all(own.fields[k].contents() == fast.fields[k].contents() for k in own.fields)
    assert [(t.name, t.tensor_type) for t in own.tensors] == [(t.name, t.tensor_type) for t in fast.tensors]
    for a, b in zip(own.tensors, fast.tensors):
        np.testing.assert_array_equal(a.data, b.data)
