"""The LoRA product in both forms (model/lora.py): the masked form (every slot multiplied, the
others' columns masked) and the grouped form (rows sorted by adapter, the native grouped GEMM over
packed slots), each against x @ A_s.T @ B_s.T per row in numpy, for every fused projection, with
rows of no adapter (zeros), adapters in any order and a slot nobody uses."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from xlaserve.model.lora import PROJECTIONS, LoraSpec, lora_batch, module_shapes, slot_shapes
from xlaserve.native import gemm_cpu
from xlaserve.native.build import KernelUnavailable
from xlaserve.weights.loader import read_config
from tests.tiny_models import make_tiny_checkpoint

RANK, SLOTS = 4, 3
TOKEN_ADAPTERS = [2, 0, 1, 2, 0, 0, 1, 2, 2]  # 0: none; slot 2 (adapter 3) holds nobody's rows


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("lora_product"))
    make_tiny_checkpoint(directory, "llama")
    return read_config(directory)[0]


def random_adapters(config, rng):
    """{(slot, module): (A [r, K], B [N, r])} for every slot and module, scaled."""
    return {(slot, module): (rng.standard_normal((RANK, k)).astype(np.float32),
                             rng.standard_normal((int(np.prod(axes)), RANK)).astype(np.float32))
            for slot in range(SLOTS) for module, (k, axes) in module_shapes(config).items()}


def slot_arrays(config, spec, adapters):
    """Layer 0's slot arrays in slot_shapes' order, each layer the same."""
    arrays = []
    for name, shape, _ in slot_shapes(config, spec):
        _, _, part, kind = name.split(".")
        if kind == "a":
            modules = spec.projections()[part]
            per_slot = [np.concatenate([adapters[(s, m)][0].T for m in modules], axis=1)
                        for s in range(SLOTS)]  # [K, modules * r]
        else:
            per_slot = [adapters[(s, part)][1].T for s in range(SLOTS)]  # [r, N]
        if spec.grouped:
            value = jnp.stack([gemm_cpu.pack_columns(jnp.asarray(v), bf16_pairs=False)
                               for v in per_slot])
        elif kind == "a":
            value = jnp.asarray(np.concatenate(per_slot, axis=1))
        else:
            value = jnp.asarray(np.concatenate(per_slot, axis=0))
        assert value.shape == shape, name
        arrays.append(value)
    return arrays


@pytest.mark.parametrize("grouped,dtype", [(False, "float32"), (True, "float32"),
                                           (False, "bfloat16"), (True, "bfloat16")],
                         ids=["masked", "grouped", "masked-bf16", "grouped-bf16"])
def test_each_row_adds_its_own_adapters_product_in_both_forms(config, grouped, dtype):
    if grouped:
        try:
            gemm_cpu.load()
        except KernelUnavailable as error:
            pytest.skip(f"the native GEMM does not build here: {error}")
    rng = np.random.default_rng(0)
    adapters = random_adapters(config, rng)
    if dtype == "bfloat16":  # the slots hold them rounded
        adapters = {key: tuple(np.asarray(jnp.asarray(m, jnp.bfloat16).astype(jnp.float32))
                               for m in pair) for key, pair in adapters.items()}
    spec = LoraSpec(SLOTS, RANK, tuple(module_shapes(config)), grouped=grouped)
    arrays = [a.astype(dtype) for a in slot_arrays(config, spec, adapters)]
    tokens = len(TOKEN_ADAPTERS)
    slot_adapters = jnp.asarray(TOKEN_ADAPTERS, jnp.int32)  # one request slot per token
    batch = lora_batch(spec, config.num_layers, arrays, slot_adapters,
                       jnp.arange(tokens, dtype=jnp.int32), skip_idle=True, dtype=dtype,
                       grouped_matmul=gemm_cpu.packed_grouped_matmul if grouped else None)
    layer = batch.layer(1)
    c = config
    widths = {"qkv": c.hidden_size, "o_proj": c.num_heads * c.head_dim,
              "gate_up": c.hidden_size, "down": c.intermediate_size}
    axes = {"qkv": (c.num_kv_heads, c.queries_per_kv + 2, c.head_dim),
            "o_proj": (c.hidden_size,), "gate_up": (2, c.intermediate_size),
            "down": (c.hidden_size,)}
    for projection, width in widths.items():
        x = rng.standard_normal((tokens, width)).astype(np.float32)
        if dtype == "bfloat16":  # what the step multiplies: x and the slots rounded
            x = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
        delta = np.asarray(jax.jit(lambda x: layer.delta(projection, x, axes[projection]))(x))
        expected = np.zeros((tokens, *axes[projection]), np.float32)
        for row, adapter in enumerate(TOKEN_ADAPTERS):
            if adapter == 0:
                continue
            ups = {m: x[row] @ adapters[(adapter - 1, m)][0].T @ adapters[(adapter - 1, m)][1].T
                   for m in PROJECTIONS[projection]}
            if projection == "qkv":
                kv, group, d = c.num_kv_heads, c.queries_per_kv, c.head_dim
                expected[row] = np.concatenate([ups["q_proj"].reshape(kv, group, d),
                                                ups["k_proj"].reshape(kv, 1, d),
                                                ups["v_proj"].reshape(kv, 1, d)], axis=1)
            elif projection == "gate_up":
                expected[row] = np.stack([ups["gate_proj"], ups["up_proj"]])
            else:
                expected[row] = ups[{"o_proj": "o_proj", "down": "down_proj"}[projection]]
        # bfloat16: the shrink's output is rounded before the expand (~3 significant digits)
        atol = 1e-4 if dtype == "float32" else 1e-2 * np.abs(expected).max()
        np.testing.assert_allclose(delta, expected, rtol=1e-4 if dtype == "float32" else 2e-2,
                                   atol=atol, err_msg=projection)
        assert np.all(delta[np.asarray(TOKEN_ADAPTERS) == 0] == 0), projection


def test_slots_written_in_the_layouts_the_weights_were_stored_in(config):
    """On TPU the step's weights, LoRA slots included, are stored in the layouts XLA chose
    (precompile.choose_weight_layouts) and their old buffers freed: the slots adopt the stored
    arrays, and writes and the adapter table keep those layouts, never a relayout per step. The
    CPU's chosen layouts are the default ones, so the test stores them column-major itself."""
    from jax.experimental.layout import Format, Layout

    from xlaserve.model.sharding import serving_mesh
    from xlaserve.runtime.executor.lora_slots import LoraSlots
    from xlaserve.weights.lora_adapter import LoraAdapter

    spec = LoraSpec(SLOTS, RANK, tuple(module_shapes(config)))
    slots = LoraSlots(spec, config, jnp.float32, serving_mesh(jax.devices()[:1], 1), 5, 0)
    stored = []
    for array in slots.args():  # as weight_args.stored_in does: copy, free the old buffer
        order = tuple(range(array.ndim))  # column-major: the default reversed
        copy = jax.device_put(array, Format(Layout(major_to_minor=order), array.sharding))
        array.delete()
        stored.append(copy)
    layouts = [array.format.layout for array in stored]
    slots.adopt(stored)
    rng = np.random.default_rng(1)
    a = rng.standard_normal((config.hidden_size, RANK)).astype(np.float32)
    b = rng.standard_normal((RANK, *module_shapes(config)["v_proj"][1])).astype(np.float32)
    slots.compile()
    slots.write(1, LoraAdapter("x", "/x", RANK, ("v_proj",), {(1, "v_proj"): (a, b)}))
    slots.assign([3], [2])
    assert [array.format.layout for array in slots.args()] == layouts
    names = [name for name, _, _ in slot_shapes(config, spec)]
    qkv_a = np.asarray(slots.arrays[names.index("layers.1.qkv.a")])  # [K, slots * 3 * rank]
    v_columns = slice((1 * 3 + 2) * RANK, (1 * 3 + 3) * RANK)  # slot 1, v (third module)
    np.testing.assert_array_equal(qkv_a[:, v_columns], a)
    assert not np.any(np.delete(qkv_a, np.arange(v_columns.start, v_columns.stop), axis=1))
    v_b = np.asarray(slots.arrays[names.index("layers.1.v_proj.b")])  # [slots * rank, N]
    np.testing.assert_array_equal(v_b[RANK:2 * RANK], b.reshape(RANK, -1))
    np.testing.assert_array_equal(np.asarray(slots.slot_adapters), [0, 0, 0, 2, 0])
