"""The CPU SwiGLU (C++ through XLA's FFI) against XLA's `silu(gate) * up`: float32 and bfloat16
outputs, widths that are and are not a multiple of the vector width, large gates of either sign
(the sigmoid must neither overflow nor lose its tail), and row counts that do not fill an item."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.model.layers import swiglu_xla
from tests.kernels.rounding import assert_close_to_xla
from xlaserve.native import KernelUnavailable, swiglu_cpu

try:
    swiglu_cpu.load()
except KernelUnavailable as error:  # no compiler here: the model runs on XLA's fusion
    pytest.skip(f"the native CPU SwiGLU does not build here: {error}", allow_module_level=True)


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows,width", [(1, 1536), (7, 37), (128, 64), (0, 16)],
                         ids=["one_row", "width_tail", "decode_rows", "no_rows"])
def test_equals_xla(rows, width, out_dtype):
    rng = np.random.default_rng(rows + width)
    gate_up = jnp.asarray(rng.standard_normal((rows, 2, width)) * 4, jnp.float32)
    actual = jax.jit(swiglu_cpu.swiglu, static_argnums=1)(gate_up, out_dtype)
    expected = swiglu_xla(gate_up, out_dtype)
    assert actual.shape == (rows, width)
    assert_close_to_xla(actual, expected, out_dtype, f32_rtol=4e-6, atol=1e-30)

def test_extreme_gates_saturate_like_silu():
    gates = np.array([-1000.0, -88.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 88.0, 1000.0, 3e38, -3e38,
                      np.inf, -np.inf, 5.0, -5.0, 0.5], np.float32)
    gate_up = jnp.asarray(np.stack([gates, np.ones_like(gates)])[None])
    actual = np.asarray(swiglu_cpu.swiglu(gate_up))[0]
    expected = np.asarray(swiglu_xla(gate_up, jnp.float32))[0]
    finite = np.isfinite(expected)
    np.testing.assert_allclose(actual[finite], expected[finite], rtol=4e-6, atol=1e-30)
    assert np.all(actual[gates == np.inf] == np.inf)
    assert actual[0] == 0.0 and actual[1] == 0.0 and actual[10] == 0.0  # silu(-big) -> -0


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="gate_up"):
        swiglu_cpu.swiglu(jnp.zeros((4, 3, 8)))
