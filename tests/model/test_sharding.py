"""Tensor parallel: weights land sharded by their partition specs, logits stay the same."""
import subprocess
import sys
import textwrap

from tests.tiny_models import make_tiny_checkpoint

SCRIPT = textwrap.dedent("""
    import sys
    import jax, numpy as np
    from jax.sharding import Mesh
    from flax import nnx
    from xlaserve.model.loader import load_model
    from xlaserve.executor.greedy import PagedBatch, make_forward
    from xlaserve.executor.kv_pool import init_kv_pool

    def logits(mesh):
        loaded = load_model(sys.argv[1], dtype="float32", mesh=mesh, skip_tokenizer_init=True,
                            progress=False)
        batch = PagedBatch(2, 2, 8)
        caches = init_kv_pool(loaded.config, batch.num_pages, 8, loaded.dtype, mesh)
        ids, pos, md, rows, _ = batch.step_inputs([[5, 6, 7, 8, 9], [10, 11, 12]], logits="all")
        out, caches = make_forward(loaded.model)(nnx.split(loaded.model)[1], ids, pos, caches, md, rows)
        return loaded, caches, np.asarray(out)

    devices = np.array(jax.devices())
    assert len(devices) == 8, devices
    _, _, single = logits(Mesh(devices[:1].reshape(1, 1), ("data", "tensor")))
    loaded, caches, split = logits(Mesh(devices[:4].reshape(2, 2), ("data", "tensor")))
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


def _run(script: str, directory) -> None:
    result = subprocess.run(
        [sys.executable, "-c", script, str(directory)], capture_output=True, text=True, timeout=600,
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
             "PATH": "/usr/bin:/bin", "TRANSFORMERS_VERBOSITY": "error"},
    )
    assert result.stdout.strip().endswith("ok"), result.stdout[-2000:] + result.stderr[-4000:]


def test_tensor_parallel_logits_equal_single_device(tmp_path):
    make_tiny_checkpoint(str(tmp_path), "qwen2")
    _run(SCRIPT, tmp_path)


def test_tensor_parallel_mixture_of_experts_logits_equal_single_device(tmp_path):
    """Qwen3-MoE's experts split on their intermediate axis, the grouped matmuls under XLA's
    partitioner, the same logits as one device."""
    make_tiny_checkpoint(str(tmp_path), "qwen3_moe")
    _run(SCRIPT.replace('    print("ok")', MOE_CHECKS + '    print("ok")').replace(
        "(64, 1, 4, 16)", "(64, 1, 4, 32)").replace("(5, 8, 2 * 16)", "(5, 8, 2 * 32)"), tmp_path)
