"""tests/compile_outcomes.py: a TPU program compiled once is read back the second time with what
the compile gave, and a changed program, other compile options or other devices compile again."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tests import compile_outcomes
from tests.compile_targets import devices


def _lowered(mesh, scale: float):
    sharding = NamedSharding(mesh, P(None, "tensor"))
    weights = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=sharding)
    rows = jax.ShapeDtypeStruct((8, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    step = jax.jit(lambda w, x: jax.nn.gelu(x @ w) * scale, donate_argnums=())
    with jax.set_mesh(mesh):
        return step.trace(weights, rows).lower()


def test_a_tpu_compile_is_read_back_the_second_time_and_recompiled_when_anything_changes(
        tmp_path, monkeypatch):
    monkeypatch.setenv("XLASERVE_CACHE_DIR", str(tmp_path))
    _, v6e = devices("v6e:2x2")
    mesh = Mesh(np.array(v6e).reshape(1, 4), ("data", "tensor"))
    before = dict(compile_outcomes.counts)

    reordered = Mesh(np.array(v6e[::-1]).reshape(1, 4), ("data", "tensor"))
    variants = [(mesh, 2.0, None), (mesh, 2.0, None),  # the same program twice
                (mesh, 3.0, None),  # another constant: another program
                (mesh, 2.0, {"xla_tpu_enable_latency_hiding_scheduler": False}),
                (reordered, 2.0, None)]  # the same module on other devices
    compiled = [_lowered(m, scale).compile(options) for m, scale, options in variants]
    assert [isinstance(c, compile_outcomes.ReadBack) for c in compiled] == [
        False, True, False, False, False]
    first, again = compiled[:2]
    assert isinstance(first, jax.stages.Compiled)
    assert again.as_text() == first.as_text()
    assert again.cost_analysis() == first.cost_analysis()
    assert again.memory_analysis().temp_size_in_bytes == first.memory_analysis().temp_size_in_bytes
    assert again.input_formats == first.input_formats
    assert again.out_info.shape == first.out_info.shape  # not kept: compiled for real on demand
    assert compile_outcomes.counts["read back"] - before["read back"] == 1
    assert len(list((tmp_path / "compile-only").glob("*.pkl"))) == 4
