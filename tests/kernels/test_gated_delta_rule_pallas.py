"""The Pallas gated delta rule (pallas_kernels/linear_attention/kernel_tpu.py, kernel_gpu.py; issue
76): interpreted on this CPU against the float64 reference over a ragged step (on one device,
and split by head over a mesh of two as kernels_for runs them under tp), and compiled for
their real targets (Mosaic for TPU v6e, Triton for an H100) at Qwen3-Next's head sizes, the state
pool updated in place."""
import re
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from tests.compile_targets import cache_copies, compile_for, devices
from tests.kernels.test_compile_kernels import one_device_mesh
from tests.kernels.test_gated_delta_rule import DV, check_a_ragged_step
from xlaserve.pallas_kernels.linear_attention import kernel_gpu, kernel_tpu
from xlaserve.runtime.executor import aot

# Small blocks, so that the step's 40 rows span several: sequences cross block edges, share a
# block, and the last block holds padding rows only (TPU); the GPU's state splits in two.
INTERPRETED = {"tpu": lambda *args: kernel_tpu.gated_delta_rule(*args, interpret=True,
                                                                block_rows=8),
               "gpu": lambda *args: kernel_gpu.gated_delta_rule(*args, interpret=True,
                                                                value_block=DV // 2)}


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_the_pallas_kernel_is_the_reference_over_a_ragged_step(platform):
    """A fresh prompt, a decode row and a prompt's later chunk (both from their slots), padding
    rows and two padding sequences, jitted and interpreted, against the float64 reference; the
    other slots untouched."""
    check_a_ragged_step(INTERPRETED[platform], 40)


SPLIT_SCRIPT = """
import functools
import jax
from tests.kernels.test_gated_delta_rule import check_a_ragged_step
from xlaserve.model.sharding import serving_mesh
from xlaserve.pallas_kernels.linear_attention import kernel_gpu, kernel_tpu
from xlaserve.runtime.executor.kernels import split_by_value_head

mesh = serving_mesh(jax.devices()[:2], 2)
for rule in (functools.partial(kernel_tpu.gated_delta_rule, interpret=True, block_rows=8),
             functools.partial(kernel_gpu.gated_delta_rule, interpret=True)):
    check_a_ragged_step(split_by_value_head(rule, mesh), 40)
print("ok")
"""


def test_the_kernels_split_by_head_over_a_mesh_are_the_reference():
    """kernels_for's shard_map over the heads (tp 2 of 2 key heads, 4 value heads: each device
    one key head and its two value heads, half the pool) gives the reference's step; in a
    process of two CPU devices."""
    result = subprocess.run(
        [sys.executable, "-c", SPLIT_SCRIPT], capture_output=True, text=True, timeout=600,
        cwd=Path(__file__).parents[2],
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
             "PATH": "/usr/bin:/bin"})
    assert result.stdout.strip().endswith("ok"), result.stdout[-2000:] + result.stderr[-4000:]


def test_shapes_that_do_not_fit_are_refused_by_name():
    with pytest.raises(ValueError, match="power-of-two value head dim"):
        kernel_gpu.check_shapes(128, 96)
    with pytest.raises(ValueError, match="MiB of VMEM"):
        kernel_tpu.check_vmem(32, 16, 64, 256, 256)
    kernel_tpu.check_vmem(32, 16, 32, 128, 128)  # Qwen3-Next on one device fits


# Qwen3-Next's linear layers on one device: 16 key heads, 32 value heads of 128 x 128; a 512-row
# step of 64 sequences, a pool of 129 slots (64 requests' and their copies', and the idle slot).
ROWS, SEQS, SLOTS, KEY_HEADS, VALUE_HEADS, HEAD_DIM = 512, 64, 129, 16, 32, 128
COMPILED = {"tpu": kernel_tpu.gated_delta_rule, "gpu": kernel_gpu.gated_delta_rule}


@pytest.mark.parametrize("target", ["v6e:2x2", "h100"])
def test_the_pallas_kernel_compiles_with_the_pool_in_place(target):
    """Mosaic or Triton accept the kernel at the real head sizes, and the pool (271 MB) is
    aliased in -> out with no copy of it in the program."""
    platform, target_devices = devices(target)
    mesh = one_device_mesh(target_devices)
    at = lambda shape, dtype: aot.abstract(shape, jnp.dtype(dtype), mesh, P())
    pool_shape = (SLOTS, VALUE_HEADS, HEAD_DIM, HEAD_DIM)
    args = [at((ROWS, KEY_HEADS, HEAD_DIM), "bfloat16"), at((ROWS, KEY_HEADS, HEAD_DIM), "bfloat16"),
            at((ROWS, VALUE_HEADS, HEAD_DIM), "bfloat16"), at((ROWS, VALUE_HEADS), "float32"),
            at((ROWS, VALUE_HEADS), "float32"), at(pool_shape, "float32"), at((SEQS,), "int32"),
            at((SEQS,), "int32"), at((SEQS + 1,), "int32"), at((1,), "int32")]
    started = time.perf_counter()
    compiled = compile_for(mesh, jax.jit(COMPILED[platform], donate_argnums=(5,)), *args)
    seconds = time.perf_counter() - started
    hlo = compiled.as_text()
    assert "input_output_alias={ {1}: (5," in hlo.splitlines()[0], "the pool is not in place"
    assert not cache_copies(hlo, pool_shape, jnp.float32), "the pool is copied"
    assert len(rule_kernel_calls(hlo)) == 1
    memory = compiled.memory_analysis()
    print(f"{target}: compiled in {seconds:.1f} s, {memory.temp_size_in_bytes} temporary bytes")


def rule_kernel_calls(hlo: str) -> list[str]:
    """The compiled program's calls of the Pallas gated delta rule (Mosaic's or Triton's custom
    call, its pallas_call named "gated_delta_rule")."""
    return [line for line in hlo.splitlines()
            if re.search(r'custom_call_target="(tpu_custom_call|__gpu\$xla\.gpu\.triton)"', line)
            and 'gated_delta_rule/pallas_call"' in line]
