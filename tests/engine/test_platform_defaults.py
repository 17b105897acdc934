"""The hardware-dependent flags (issue 33 item 5): CPU keeps its measured defaults, TPU/GPU take
SGLang's per-GPU choices, and the KV pool of an 80 GB H100 comes out near SGLang's ~54 GB."""
from pathlib import Path

import jax.numpy as jnp
import pytest

from tests.compile_targets import devices
from xlaserve.server_args import ServerArgs, platform_defaults
from xlaserve.runtime.executor.kv_pool import bytes_per_token, num_pages_for
from xlaserve.weights.loader import read_config

LLAMA_8B = str(Path(__file__).parents[2] / "benchmarks" / "configs" / "llama-3.1-8b")
GIB = 2**30
H100_BYTES = 79.6 * GIB  # what an H100 80GB's runtime reports as its memory
LLAMA_8B_WEIGHT_BYTES = 16.06e9


class FakeDevice:
    """A device that answers memory_stats() as XLA's GPU client does."""

    platform = "gpu"

    def __init__(self, bytes_limit: float, bytes_in_use: float = 0):
        self.stats = {"bytes_limit": int(bytes_limit), "bytes_in_use": int(bytes_in_use)}

    def memory_stats(self):
        return self.stats


def test_cpu_keeps_the_defaults_measured_on_cpus():
    assert platform_defaults.defaults_for("cpu", None) == {
        "max_running_requests": 64, "chunked_prefill_size": 256, "max_prefill_tokens": 512,
        "mem_fraction_static": 0.1}


def test_accelerators_take_sglangs_prefill_piece_by_device_memory():
    h100 = platform_defaults.defaults_for("gpu", int(0.95 * H100_BYTES))
    assert h100 == {"max_running_requests": 256, "chunked_prefill_size": 8192,
                    "max_prefill_tokens": 8192, "mem_fraction_static": 0.9}
    assert platform_defaults.defaults_for("gpu", 22 * GIB)["chunked_prefill_size"] == 2048
    # v6e (32 GB of HBM a chip) and compile-only targets (no memory to ask about): 8192.
    assert platform_defaults.defaults_for("tpu", 31 * GIB)["chunked_prefill_size"] == 2048
    assert platform_defaults.defaults_for("tpu", None)["chunked_prefill_size"] == 8192


def test_resolve_fills_only_the_flags_the_user_left_unset():
    args, names = platform_defaults.resolve(
        ServerArgs(max_running_requests=32, mem_fraction_static=0.5), "gpu",
        FakeDevice(0.95 * H100_BYTES))
    assert (args.max_running_requests, args.mem_fraction_static) == (32, 0.5)
    assert (args.chunked_prefill_size, args.max_prefill_tokens) == (8192, 8192)
    assert names == ["chunked_prefill_size", "max_prefill_tokens"]
    again, names = platform_defaults.resolve(args, "gpu", FakeDevice(0.95 * H100_BYTES))
    assert again == args and names == []


def test_gpu_client_memory_is_raised_only_where_the_user_left_it(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    platform_defaults.prepare_gpu_memory()
    import os
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.95"
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    platform_defaults.prepare_gpu_memory()
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"


def test_an_h100_gives_the_kv_pool_what_sglang_gives_it():
    config, _ = read_config(LLAMA_8B, load_format="dummy")
    page_bytes = bytes_per_token(config, jnp.bfloat16, "gpu") * 16

    def kv_gb(device, fraction):
        pages = num_pages_for(config, jnp.bfloat16, 16, max_total_tokens=None,
                              mem_fraction_static=fraction, device=device)
        return pages * page_bytes / 1e9

    # Before: JAX's 75% pool, 0.85 of what was free after the weights: ~37 GB.
    before = kv_gb(FakeDevice(0.75 * H100_BYTES, LLAMA_8B_WEIGHT_BYTES), 0.85)
    after = kv_gb(FakeDevice(0.95 * H100_BYTES, LLAMA_8B_WEIGHT_BYTES), 0.9)
    expected = (0.95 * 0.9 * H100_BYTES - LLAMA_8B_WEIGHT_BYTES) / 1e9  # 57.0
    assert 30 < before < 45, before
    assert 0.96 * expected < after <= expected, (after, expected)  # rounded down by < 1/32
    # The steps' temporaries keep what the fraction leaves (0.1 of XLA's pool, ~7.6 GiB), more
    # than the 3.36 GiB Llama-3.1-8B's 8192-token step compiled for an H100 needs.
    assert expected * 1e9 + LLAMA_8B_WEIGHT_BYTES < 0.95 * H100_BYTES - 3.5 * GIB


def test_weights_over_the_fraction_leave_the_smallest_pool_not_a_negative_one():
    config, _ = read_config(LLAMA_8B, load_format="dummy")
    pages = num_pages_for(config, jnp.bfloat16, 16, max_total_tokens=None,
                          mem_fraction_static=0.2, device=FakeDevice(20 * GIB, 18 * GIB))
    assert pages == 2


@pytest.mark.parametrize("target", ["h100", "v6e:2x2"])
def test_compile_only_targets_get_the_accelerator_buckets(target):
    devices(target)  # skips where the compile-only package is absent
    from xlaserve.runtime.executor import aot

    tp = 4 if target.startswith("v6e") else 1
    _, shapes, description = aot.server_step(target, ServerArgs(model_path=LLAMA_8B, tp_size=tp))
    tokens, seqs, _ = shapes[-1]
    assert (tokens, seqs) == (8192, 256), description  # a whole prompt piece; 256 requests


def test_a_gpu_decodes_more_requests_where_its_kv_pool_holds_them():
    config, _ = read_config(LLAMA_8B, load_format="dummy")
    for device_bytes in (H100_BYTES, 139 * GIB):  # an 8B model's pool on an H100 and an H200
        pool_tokens = 16 * num_pages_for(config, jnp.bfloat16, 16, max_total_tokens=None,
                                         mem_fraction_static=0.9,
                                         device=FakeDevice(0.95 * device_bytes,
                                                           LLAMA_8B_WEIGHT_BYTES))
        assert platform_defaults.running_requests_for_pool("gpu", pool_tokens) == 256
    # A pool of 2048 tokens for each of 512 requests (a small model's) takes 512, no more.
    assert platform_defaults.running_requests_for_pool("gpu", 512 * 2048) == 512
    assert platform_defaults.running_requests_for_pool("gpu", 512 * 2048 - 1) == 256
    assert platform_defaults.running_requests_for_pool("gpu", 10**9) == 512
    assert platform_defaults.running_requests_for_pool("tpu", 10**9) == 256  # the SMEM page table
