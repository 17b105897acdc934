"""Tensor and expert parallel: weights land sharded by their partition specs, logits stay the same."""
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest

from tests.tiny_models import make_tiny_checkpoint
from xlaserve.model.sharding import check_split, serving_mesh

ROOT = Path(__file__).resolve().parents[2]  # the scripts import tests.greedy_driver from there

SCRIPT = textwrap.dedent("""
    import sys
    import jax, numpy as np
    from jax.sharding import Mesh
    from xlaserve.model.sharding import MESH_AXES
    from flax import nnx
    from xlaserve.weights.loader import load_model
    from tests.greedy_driver import PagedBatch, make_forward
    from xlaserve.runtime.executor.kv_pool import init_kv_pool

    def logits(mesh, **forward_options):
        loaded = load_model(sys.argv[1], dtype="float32", mesh=mesh, skip_tokenizer_init=True,
                            progress=False)
        batch = PagedBatch(2, 2, 8)
        caches = init_kv_pool(loaded.config, batch.num_pages, 8, loaded.dtype, mesh)
        ids, pos, md, rows, _ = batch.step_inputs([[5, 6, 7, 8, 9], [10, 11, 12]], logits="all")
        forward = make_forward(loaded.model, **forward_options)
        out, caches = forward(nnx.split(loaded.model)[1], ids, pos, caches, md, rows)
        return loaded, caches, np.asarray(out)

    devices = np.array(jax.devices())
    assert len(devices) == 8, devices
    _, _, single = logits(Mesh(devices[:1].reshape(1, 1, 1), MESH_AXES))
    # Two data-parallel rows (the weights replicated on each) of two tensor-parallel devices.
    loaded, caches, split = logits(Mesh(devices[:4].reshape(2, 1, 2), MESH_AXES))
    np.testing.assert_allclose(split, single, atol=1e-5, rtol=0)
    qkv = loaded.model.layers[0].attn.qkv.get_value()
    # [hidden, kv_heads, group + 2, head_dim]: each device holds one kv head with its query heads.
    assert {s.data.shape for s in qkv.addressable_shards} == {(64, 1, 4, 16)}, qkv.sharding
    # The cache is stored flat, [pages, page_size, 2 * kv_heads * head_dim]: one head's K|V each.
    assert {s.data.shape for s in caches[0].addressable_shards} == {(5, 8, 2 * 16)}
    embedding = loaded.model.embedding.get_value()
    assert {s.data.shape for s in embedding.addressable_shards} == {(256, 64)}
    print("ok")
""")


MOE_CHECKS = textwrap.dedent("""
    experts = loaded.model.layers[0].mlp.experts_gate_up.get_value()
    # [experts, hidden, 2, moe_intermediate]: every expert, half of its intermediate axis each.
    assert {s.data.shape for s in experts.addressable_shards} == {(8, 64, 2, 24)}, experts.sharding
""")


EXPERT_PARALLEL = textwrap.dedent("""
    # (ep, tp): whole experts per device (4 of 8, 2 of 8), and experts over 2 x width over 2.
    for ep, tp, expert_shard in [(2, 2, (4, 64, 2, 48)), (4, 4, (2, 64, 2, 48)),
                                 (2, 4, (4, 64, 2, 24))]:
        mesh = Mesh(devices[:tp].reshape(1, ep, tp // ep), MESH_AXES)
        loaded, _, split = logits(mesh)
        np.testing.assert_allclose(split, single, atol=1e-5, rtol=0)
        experts = loaded.model.layers[0].mlp.experts_gate_up.get_value()
        assert {s.data.shape for s in experts.addressable_shards} == {expert_shard}, (ep, tp)
        down = loaded.model.layers[0].mlp.experts_down.get_value()
        assert {s.data.shape for s in down.addressable_shards} == {
            (expert_shard[0], expert_shard[3], 64)}, (ep, tp)
""")


def _run(script: str, directory) -> None:
    result = subprocess.run(
        [sys.executable, "-c", script, str(directory)], capture_output=True, text=True, timeout=600,
        cwd=ROOT,
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
             "PATH": "/usr/bin:/bin", "TRANSFORMERS_VERBOSITY": "error"},
    )
    assert result.stdout.strip().endswith("ok"), result.stdout[-2000:] + result.stderr[-4000:]


def test_tensor_parallel_logits_equal_single_device(tmp_path):
    make_tiny_checkpoint(str(tmp_path), "qwen2")
    _run(SCRIPT, tmp_path)


def test_tensor_parallel_mixture_of_experts_logits_equal_single_device(tmp_path):
    """Qwen3-MoE's experts split on their intermediate axis, the grouped matmuls under shard_map
    (moe.expert_parallel with an expert axis of 1), the same logits as one device."""
    make_tiny_checkpoint(str(tmp_path), "qwen3_moe")
    _run(SCRIPT.replace('    print("ok")', MOE_CHECKS + '    print("ok")').replace(
        "(64, 1, 4, 16)", "(64, 1, 4, 32)").replace("(5, 8, 2 * 16)", "(5, 8, 2 * 32)"), tmp_path)


def test_expert_parallel_logits_equal_single_device(tmp_path):
    """--ep-size 2 and 4, alone and with the tensor axis (ep 2 x tp 4): each device runs its own
    experts on the tokens routed to them, and the logits equal one device's."""
    make_tiny_checkpoint(str(tmp_path), "qwen3_moe", num_key_value_heads=4)
    script = SCRIPT[:SCRIPT.index("# Two data-parallel rows")] + EXPERT_PARALLEL + 'print("ok")\n'
    _run(script, tmp_path)


def test_gpt_oss_expert_parallel_logits_equal_single_device(tmp_path):
    """gpt-oss under --ep-size 4 and 2 (x tp 2): the gate|up bias split with its experts, the
    down bias added once, the sinks split with the query heads."""
    make_tiny_checkpoint(str(tmp_path), "gpt_oss", num_key_value_heads=4)
    script = SCRIPT[:SCRIPT.index("# Two data-parallel rows")] + textwrap.dedent("""
        for ep, tp in [(4, 4), (2, 4)]:
            _, _, split = logits(Mesh(devices[:tp].reshape(1, ep, tp // ep), MESH_AXES))
            np.testing.assert_allclose(split, single, atol=1e-5, rtol=0)
        print("ok")
    """)
    _run(script, tmp_path)


def test_ep_size_must_divide_tp_size_and_the_experts():
    with pytest.raises(ValueError, match="--ep-size 3 must divide --tp-size 4"):
        serving_mesh(jax.devices(), 4, 3)
    with pytest.raises(ValueError, match="--tp-size 2 needs that many devices; found 1"):
        serving_mesh(jax.devices(), 2, 2)
    mesh = serving_mesh(jax.devices(), 1, 1)
    assert dict(mesh.shape) == {"data": 1, "expert": 1, "tensor": 1}
    check_split(_config(num_experts=8), mesh)  # one group holds every expert

    check_split(_config(num_experts=16, num_kv_heads=8), EightDevices())
    with pytest.raises(ValueError, match="--ep-size 8 does not divide the model's 60 experts"):
        check_split(_config(num_experts=60, num_kv_heads=8), EightDevices())


class EightDevices:  # only the mesh's shape is read
    shape = {"data": 1, "expert": 8, "tensor": 1}


def _config(**fields):
    from xlaserve.model.config.rope_config import RopeConfig
    from xlaserve.model.config.model_config import ModelConfig

    base = dict(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=64,
                intermediate_size=64, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=8,
                rms_norm_eps=1e-6, rope=RopeConfig(), max_position_embeddings=64)
    if fields.get("num_experts"):
        fields.setdefault("num_experts_per_tok", 1)
    return ModelConfig(**{**base, **fields})


REPLICATED_SCRIPT = SCRIPT[:SCRIPT.index("# Two data-parallel rows")] + textwrap.dedent("""
    # tp 4 over 2 KV heads (gemma4: its full layer's 2 beside the sliding layer's 4): each head
    # on two devices, with half of its query heads each.
    loaded, caches, split = logits(Mesh(devices[:4].reshape(1, 1, 4), MESH_AXES))
    np.testing.assert_allclose(split, single, atol=1e-5, rtol=0)
    c = loaded.config
    assert c.kv_replicas[-1] == 2 and c.layer(len(c.kv_replicas) - 1).num_kv_heads == 4
    full = caches[-1]  # [pages, page_size, 2 * 4 * head_dim]: one copy's K|V a device
    assert {s.data.shape[-1] for s in full.addressable_shards} == {full.shape[-1] // 4}
    print("ok")
""")


@pytest.mark.parametrize("family", ["qwen2", "gemma4"])
def test_more_devices_than_kv_heads_copy_each_head_and_give_one_devices_logits(family, tmp_path):
    """--tp-size 4 over 2 KV heads (Qwen2's every layer; Gemma 4's full layer beside a sliding
    layer of 4): each KV head copied onto two devices at load, its query heads split between
    them, the same logits as one device."""
    make_tiny_checkpoint(str(tmp_path), family)
    _run(REPLICATED_SCRIPT, tmp_path)


def test_kv_heads_are_copied_only_where_whole_heads_and_query_groups_allow():
    from xlaserve.model.config.layer_shapes import replicate_kv_heads

    config = _config()  # 8 query heads over 2 KV heads
    assert replicate_kv_heads(config, 2) is config
    copied = replicate_kv_heads(config, 8)  # 4 copies of each, one query head a device
    assert (copied.num_kv_heads, copied.kv_replicas, copied.queries_per_kv) == (8, (4, 4), 1)
    for tp_size in (3, 16):  # 3: not whole heads; 16: more copies than a head's 4 query heads
        with pytest.raises(ValueError, match=f"--tp-size {tp_size} does not split layer 0's 2"):
            replicate_kv_heads(config, tp_size)
    uneven = replicate_kv_heads(_config(num_kv_heads=8, layer_heads=((8, 8), (2, 8))), 4)
    assert uneven.layer_heads == ((8, 8), (4, 8)) and uneven.kv_replicas == (1, 2)


def test_tp_size_must_divide_every_layers_kv_heads():
    """Attention is split by KV head: a layer with fewer KV heads than devices (Gemma 4's full
    layers have 2 or 4 beside the sliding layers' 8 or 16) stops start-up naming it."""
    check_split(_config(num_kv_heads=8), EightDevices())
    with pytest.raises(ValueError, match="--tp-size 8 does not divide layer 0's 2 KV heads"):
        check_split(_config(), EightDevices())
    uneven = _config(num_kv_heads=8, layer_heads=((8, 8), (4, 8)))
    with pytest.raises(ValueError, match="--tp-size 8 does not divide layer 1's 4 KV heads"):
        check_split(uneven, EightDevices())


def test_deepseek_v3_tensor_and_expert_parallel_logits_equal_single_device(tmp_path):
    """DeepSeek-V3's multi-head latent attention with its heads split over tp 2 and 4 (the latent
    cache whole on every device) and its experts over --ep-size 2: one device's logits; so does
    the expanded form (its two parts under shard_map by head) over tp 4."""
    make_tiny_checkpoint(str(tmp_path), "deepseek_v3")
    script = SCRIPT[:SCRIPT.index("# Two data-parallel rows")] + textwrap.dedent("""
        for ep, tp in [(1, 2), (1, 4), (2, 4)]:
            loaded, caches, split = logits(Mesh(devices[:tp].reshape(1, ep, tp // ep), MESH_AXES))
            np.testing.assert_allclose(split, single, atol=1e-5, rtol=0)
            w_uk = loaded.model.layers[0].attn.w_uk.get_value()  # [heads, nope, kv_lora]
            assert {s.data.shape for s in w_uk.addressable_shards} == {(4 // tp, 8, 16)}
            # [pages, page_size, kv_lora + rope]: every device holds every row.
            assert {s.data.shape for s in caches[0].addressable_shards} == {(5, 8, 24)}
        _, _, expanded = logits(Mesh(devices[:4].reshape(1, 1, 4), MESH_AXES),
                                mla_expanded_prefill_tokens=1)
        np.testing.assert_allclose(expanded, single, atol=1e-5, rtol=0)
        print("ok")
    """)
    _run(script, tmp_path)
