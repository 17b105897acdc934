"""The experts' grouped matmul over MXFP4 weights decoded inside the GPU kernel
(pallas_kernels/grouped_matmul_mxfp4.py): in interpret mode against the float64 product of x and
the weights as the loader decodes them (weights/formats/mxfp4.py, transformers' values bit for bit),
and compiled for an H100 at gpt-oss's expert shapes."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from tests.compile_targets import compile_for, devices
from tests.kernels.grouped_reference import grouped_reference
from xlaserve.pallas_kernels import grouped_matmul_mxfp4 as mxfp4
from xlaserve.pallas_kernels.grouped_matmul_gpu import block_rows, max_visits
from xlaserve.runtime.executor import aot
from xlaserve.weights.formats.mxfp4 import FP4_VALUES, decode_mxfp4


def random_experts(rng, experts, k, n, low=118, high=131):
    """blocks uint8 [E, N, K/32, 16] (every code), scales uint8 [E, N, K/32] in [low, high)."""
    blocks = rng.integers(0, 256, (experts, n, k // 32, 16), dtype=np.uint8)
    scales = rng.integers(low, high, (experts, n, k // 32), dtype=np.uint8)
    return blocks, scales


def test_e2m1_codes_and_e8m0_scales_decode_to_the_loaders_values():
    codes = jnp.arange(16, dtype=jnp.int32)
    np.testing.assert_array_equal(np.asarray(mxfp4.decode_e2m1(codes)), FP4_VALUES)
    scale_bytes = jnp.arange(1, 255, dtype=jnp.int32)
    expected = 2.0 ** (np.arange(1, 255) - 127.0)
    np.testing.assert_array_equal(np.asarray(mxfp4.scale_values(scale_bytes)),
                                  expected.astype(np.float32))


@pytest.mark.parametrize("group_sizes,block_k", [
    ([9, 30, 0, 1, 20, 2], 64),  # 62 of 70 rows: the rest zero; several visits of a group
    ([70, 0, 0, 0, 0, 0], 128),  # every row in one expert
    ([0, 0, 0, 0, 0, 5], 64),  # the last expert only
], ids=["ragged", "all_first", "last_only"])
def test_each_rows_expert_is_its_mxfp4_weights_as_the_loader_decodes_them(group_sizes, block_k):
    rng = np.random.default_rng(sum(group_sizes))
    experts, k, n = 6, 256, 48
    x = rng.standard_normal((70, k)).astype(np.float32)
    blocks, scales = random_experts(rng, experts, k, n)
    weights = decode_mxfp4(blocks, scales, np.float32)  # [E, K, N]
    sizes = np.array(group_sizes, np.int32)
    rounded_x = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
    expected = grouped_reference(rounded_x, weights, sizes)
    kernel = jax.jit(functools.partial(mxfp4.grouped_matmul_mxfp4, block_m=16, block_n=16,
                                       block_k=block_k, interpret=True))
    got = np.asarray(kernel(x, jnp.asarray(blocks), jnp.asarray(scales), sizes))
    assert got.shape == (70, n) and got.dtype == np.float32
    scale = np.abs(expected).max()
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * scale)
    assert not got[sizes.sum():].any()


def test_bfloat16_output_is_the_float32_accumulation_rounded_once():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((40, 128)).astype(np.float32)
    blocks, scales = random_experts(rng, 4, 128, 32)
    sizes = np.array([10, 0, 25, 3], np.int32)
    kernel = functools.partial(mxfp4.grouped_matmul_mxfp4, interpret=True)
    f32 = jax.jit(kernel)(x, blocks, scales, sizes)
    bf16 = jax.jit(functools.partial(kernel, out_dtype=jnp.bfloat16))(x, blocks, scales, sizes)
    np.testing.assert_array_equal(np.asarray(bf16.astype(jnp.float32)),
                                  np.asarray(f32.astype(jnp.bfloat16).astype(jnp.float32)))


def test_shapes_the_kernel_cannot_take_are_refused():
    assert mxfp4.supports(2880, 5760) is None  # gpt-oss's gate_up (K = hidden 2880)
    assert "multiple of 64" in mxfp4.supports(720, 5760)  # gpt-oss-120b's down at tp 4: K = 720
    blocks = jnp.zeros((2, 32, 2, 16), jnp.uint8)
    with pytest.raises(ValueError, match="do not make"):
        mxfp4.grouped_matmul_mxfp4(jnp.zeros((8, 96)), blocks, jnp.zeros((2, 32, 2), jnp.uint8),
                                   jnp.array([4, 4], jnp.int32), interpret=True)


@pytest.mark.parametrize("rows,k,n,experts", [
    (8, 2880, 5760, 32),  # gpt-oss-20b gate_up, batch 1
    (1024, 2880, 2880, 32),  # its down, 256 rows x top 4
    (2048, 2880, 5760, 128),  # gpt-oss-120b gate_up, 512 rows x top 4
], ids=["20b-gate-up-b1", "20b-down-256", "120b-gate-up-512"])
def test_the_mxfp4_kernel_compiles_for_an_h100(rows, k, n, experts):
    _, target = devices("h100")
    mesh = Mesh(np.array(target[:1]), ("device",))
    compiled = compile_for(
        mesh, jax.jit(functools.partial(mxfp4.grouped_matmul_mxfp4, out_dtype=jnp.bfloat16)),
        aot.abstract((rows, k), jnp.bfloat16, mesh),
        aot.abstract((experts, n, k // 32, 16), jnp.uint8, mesh),
        aot.abstract((experts, n, k // 32), jnp.uint8, mesh),
        aot.abstract((experts,), jnp.int32, mesh))
    hlo = compiled.as_text()
    block_m = block_rows(rows, experts)
    assert f'name = "{mxfp4.NAME}_m{block_m}"' in hlo
    assert f"grid_y = {max_visits(rows, experts, block_m)} " in hlo
    assert not re.search(r"= \S+ (dot|convolution)\(", hlo)


@pytest.mark.parametrize("first_expert", [0, 4])
def test_experts_kept_in_mxfp4_give_the_decoded_experts_output(first_expert):
    # run_experts (model/moe.py) with gate_up and down as Mxfp4Experts, multiplied by the kernel
    # (interpreted), against the same experts decoded to bfloat16 through the CPU's tiled loop;
    # with first_expert 4, half the pairs are other devices' experts (expert parallelism).
    from xlaserve.model.grouped_matmul import grouped_matmul_tiled
    from xlaserve.model.layers import Kernels
    from xlaserve.model.moe import run_experts
    from xlaserve.model.weight_types.mxfp4_experts import Mxfp4Experts
    from xlaserve.pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention

    rng = np.random.default_rng(first_expert + 11)
    tokens, top_k, hidden, inter, experts = 24, 3, 64, 64, 4
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.float32)
    chosen = jnp.asarray(np.stack([rng.choice(8, top_k, replace=False) for _ in range(tokens)]))
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (tokens, top_k)), jnp.float32)
    gate_up_blocks, gate_up_scales = random_experts(rng, experts, hidden, 2 * inter, 122, 127)
    down_blocks, down_scales = random_experts(rng, experts, inter, hidden, 122, 127)
    kept = {"experts_gate_up": Mxfp4Experts(
                jnp.asarray(gate_up_blocks.reshape(experts, 2, inter, hidden // 32, 16)),
                jnp.asarray(gate_up_scales.reshape(experts, 2, inter, hidden // 32))),
            "experts_down": Mxfp4Experts(jnp.asarray(down_blocks), jnp.asarray(down_scales))}
    assert kept["experts_gate_up"].shape == (experts, hidden, 2, inter)
    assert kept["experts_down"].shape == (experts, inter, hidden)
    decoded = {
        "experts_gate_up": jnp.asarray(decode_mxfp4(gate_up_blocks, gate_up_scales, jnp.bfloat16)
                                       .reshape(experts, hidden, 2, inter)),
        "experts_down": jnp.asarray(decode_mxfp4(down_blocks, down_scales, jnp.bfloat16))}

    def experts_with(expert_weights, **kernels):
        kernels = Kernels(attention=ragged_paged_attention, **kernels)
        return jax.jit(lambda *a: run_experts(*a, kernels, kernels.swiglu, first_expert))(
            x, weights, chosen, expert_weights)

    got = experts_with(kept, mxfp4_grouped_matmul=functools.partial(
        mxfp4.grouped_matmul_mxfp4, interpret=True))
    expected = experts_with(decoded, grouped_matmul=grouped_matmul_tiled)
    scale = float(jnp.max(jnp.abs(expected)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=0, atol=2e-3 * scale)
    with pytest.raises(ValueError, match="on GPU only"):
        experts_with(kept, grouped_matmul=grouped_matmul_tiled)


def test_mxfp4_experts_shard_as_the_float_experts_do():
    # Experts over "expert", the intermediate axis over "tensor": gate_up's I (its blocks' third
    # axis), down's I / 32 groups; one spec axis per array axis, at most.
    from xlaserve.model.weight_types.mxfp4_experts import partition_specs
    from xlaserve.model.sharding import PARTITION_SPECS

    gate_up, down = partition_specs("experts_gate_up"), partition_specs("experts_down")
    assert gate_up.blocks[2] == gate_up.scales[2] == PARTITION_SPECS["experts_gate_up"][3]
    assert down.blocks[2] == down.scales[2] == PARTITION_SPECS["experts_down"][1]
    assert len(gate_up.blocks) <= 5 and len(down.blocks) <= 4
    with pytest.raises(ValueError, match="router"):
        partition_specs("router")
