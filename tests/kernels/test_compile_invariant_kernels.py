"""--enable-deterministic-inference's Pallas kernels compiled for their real targets without the
hardware (Mosaic for TPU v5e and v6e, Triton for an H100): the batch-invariant matmul at a
decode step's and a prefill's shapes, the LM heads of real vocabularies (tied, transposed; and
on TPU one no tile divides), the RMSNorms, and the attention kernels with fixed work items and
KV blocks (ragged_paged_attention/api.py's fixed_work_items). What they compute:
test_invariant_matmul_and_norm.py and test_batch_invariant_attention.py (interpreted)."""
import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from tests.compile_targets import compile_for, devices
from tests.kernels.test_compile_kernels import KERNELS, attention_args, one_device_mesh
from xlaserve.model.layers import Kernels
from xlaserve.pallas_kernels import invariant_matmul, invariant_norm
from xlaserve.runtime.executor import aot
from xlaserve.runtime.executor.kernels import deterministic_kernels

TARGETS = {"v5e:2x2": "tpu", "v6e:2x2": "tpu", "h100": "gpu"}
# (rows, K, N, transposed): SmolLM2-135M's decode gate_up, Llama-3.1-8B's prefill gate_up and
# tied-style LM head, Qwen2.5-0.5B's tied LM head, and a vocabulary of 32001 (TPU only)
MATMULS = [(1, 576, 3072, False), (512, 4096, 28672, False), (64, 4096, 128256, True),
           (8, 896, 151936, True), (64, 4096, 32001, True)]
NORMS = [(1, 576), (512, 4096), (64, 3584)]


def _target(target):
    platform, target_devices = devices(target)  # skips where the compile-only package is absent
    return platform, one_device_mesh(target_devices)


@pytest.mark.parametrize("target", TARGETS)
def test_the_invariant_matmul_compiles(target):
    platform, mesh = _target(target)
    at = lambda shape: aot.abstract(shape, jnp.dtype("bfloat16"), mesh, P())
    for rows, k, n, transposed in MATMULS:
        if invariant_matmul.supports(k, n, platform) is not None:
            continue
        matmul = jax.jit(functools.partial(invariant_matmul.invariant_matmul, platform=platform,
                                           transposed=transposed))
        hlo = compile_for(mesh, matmul, at((rows, k)),
                          at((n, k) if transposed else (k, n))).as_text()
        assert invariant_matmul.NAME in hlo and " dot(" not in hlo, (rows, k, n)


@pytest.mark.parametrize("target", TARGETS)
def test_the_invariant_norms_compile(target):
    platform, mesh = _target(target)
    at = lambda shape, dtype: aot.abstract(shape, jnp.dtype(dtype), mesh, P())
    for rows, hidden in NORMS:
        residual, delta, scale = (at((rows, hidden), "float32"), at((rows, hidden), "bfloat16"),
                                  at((hidden,), "bfloat16"))
        norm = jax.jit(functools.partial(invariant_norm.add_rms_norm, eps=1e-6,
                                         out_dtype=jnp.bfloat16, platform=platform))
        assert invariant_norm.NAME in compile_for(mesh, norm, residual, delta, scale).as_text()


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("batch", ["decode", "prefill"])
def test_the_attention_with_fixed_work_items_compiles(target, batch):
    platform, mesh = _target(target)
    attention = deterministic_kernels(Kernels(attention=KERNELS[platform]), platform).attention
    args = attention_args(mesh, "llama-3.1-8b", batch, 16, "bfloat16")
    kernel = jax.jit(attention, static_argnames=("sm_scale",), donate_argnames=("kv_cache",))
    compile_for(mesh, kernel, **args, sm_scale=0.125)
