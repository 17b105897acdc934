"""The serving step with an FP8 KV cache (--kv-cache-dtype, model/fp8_kv_cache.py) compiled for
one H100 and for TPU v6e (2x2, tensor parallel over 4 chips) without the hardware
(runtime/executor/aot.py): Llama-3.1-8B's first 2 layers and DeepSeek-V2-Lite's latent cache.
Every layer's cache is FP8 (half the bytes of bfloat16 for the same pages), donated and written
in place, never copied; on TPU pages hold whole FP8 sublane tiles (32 rows)."""
import json
from pathlib import Path

import jax.numpy as jnp
import pytest

from tests.compile_targets import cache_copies, devices, first_layers
from xlaserve.runtime.executor import aot
from xlaserve.runtime.sampling.step_needs import PLAIN
from xlaserve.server_args import ServerArgs

CONFIGS = Path(__file__).parents[2] / "benchmarks" / "configs"


def check_fp8_caches(program, description, compiled, tp_size, fp8):
    caches = program.args[1]
    assert {cache.dtype for cache in caches} == {jnp.dtype(fp8)}, description
    assert f"{jnp.dtype(fp8).name} KV cache" in description
    hlo = compiled.as_text()
    cache = caches[0]
    local = cache.sharding.shard_shape(cache.shape)
    assert not cache_copies(hlo, local, cache.dtype), "a KV cache is copied"
    assert hlo.splitlines()[0].count("may-alias") >= len(caches) + 2, description


@pytest.mark.parametrize("target,tp_size,fp8", [
    ("h100", 1, "float8_e4m3fn"),
    ("v6e:2x2", 4, "float8_e5m2")])
def test_llama_8b_step_with_an_fp8_kv_cache_compiles(target, tp_size, fp8, tmp_path):
    """Llama-3.1-8B's first 2 layers served over an FP8 cache, compiled for the target: a decode
    bucket and the largest prefill bucket, each through XLA's TPU or GPU compiler on the CPU. The
    plain variant (greedy rows): the sampler's parts read the logits, not the caches, and compile
    with every part in test_compile_step.py (the v6e pair took 38.7 s with them, 2026-11-28)."""
    devices(target)  # skips where the compile-only package is absent
    name = {"float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}[fp8]
    args = ServerArgs(model_path=first_layers("llama-3.1-8b", 2, tmp_path), tp_size=tp_size,
                      max_running_requests=64, max_prefill_tokens=512, kv_cache_dtype=name)
    program, shapes, description = aot.server_step(target, args)
    if target.startswith("v6e"):  # whole FP8 sublane tiles (64 here: a 128K-token page table)
        assert program.page_size % 32 == 0, description
    for shape in (shapes[0], shapes[-1]):  # a decode bucket and the largest prefill one
        check_fp8_caches(program, description, program.compile(*shape, PLAIN), tp_size, fp8)


def test_deepseek_latent_step_with_an_fp8_cache_compiles_on_v6e(tmp_path):
    devices("v6e:2x2")
    config = json.loads((CONFIGS / "deepseek-v2-lite" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    args = ServerArgs(model_path=str(tmp_path), tp_size=4, max_running_requests=64,
                      max_prefill_tokens=512, context_length=8192, kv_cache_dtype="fp8_e4m3")
    program, shapes, description = aot.server_step(target := "v6e:2x2", args)
    assert program.args[1][0].shape[2] == 640, description  # lane-padded latent rows
    check_fp8_caches(program, f"{target}: {description}", program.compile(*shapes[0]), 4,
                     "float8_e4m3fn")
