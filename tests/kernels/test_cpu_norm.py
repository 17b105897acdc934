"""The CPU RMSNorm (C++ through XLA's FFI) against `layers.rms_norm` (XLA): with and without
the residual add in front, float32 and bfloat16 scales and outputs, hidden sizes that are and are
not a multiple of the vector width, row counts that do and do not fill a work item, and the
bfloat16 rounding of special values."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.model.layers import add_rms_norm_xla, rms_norm_xla
from tests.kernels.rounding import assert_close_to_xla
from xlaserve.native import KernelUnavailable, norm_cpu

try:
    norm_cpu.load()
except KernelUnavailable as error:  # no compiler here: the model runs on XLA's norms
    pytest.skip(f"the native CPU RMSNorm does not build here: {error}", allow_module_level=True)

EPS = 1e-5
DTYPES = [pytest.param(jnp.float32, id="f32"), pytest.param(jnp.bfloat16, id="bf16")]
SHAPES = [pytest.param(1, 576, id="one_row"), pytest.param(13, 576, id="rows_not_a_multiple_of_8"),
          pytest.param(128, 64, id="decode_rows"), pytest.param(5, 37, id="hidden_tail"),
          pytest.param(0, 64, id="no_rows")]


def _inputs(rows, hidden, scale_dtype, seed=0):
    rng = np.random.default_rng(seed + rows * hidden)
    x = jnp.asarray(rng.standard_normal((rows, hidden)) * 3, jnp.float32)
    delta = jnp.asarray(rng.standard_normal((rows, hidden)), jnp.float32)
    scale = jnp.asarray(1 + 0.3 * rng.standard_normal(hidden), scale_dtype)
    return x, delta, scale


def _close(actual, expected, out_dtype):
    assert_close_to_xla(actual, expected, out_dtype, f32_rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("rows,hidden", SHAPES)
@pytest.mark.parametrize("scale_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_rms_norm_equals_xla(rows, hidden, scale_dtype, out_dtype):
    x, _, scale = _inputs(rows, hidden, scale_dtype)
    actual = jax.jit(norm_cpu.rms_norm, static_argnums=(2, 3))(x, scale, EPS, out_dtype)
    _close(actual, rms_norm_xla(x, scale, EPS, out_dtype), out_dtype)


@pytest.mark.parametrize("rows,hidden", SHAPES)
@pytest.mark.parametrize("scale_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_add_rms_norm_returns_the_sum_and_its_norm(rows, hidden, scale_dtype, out_dtype):
    x, delta, scale = _inputs(rows, hidden, scale_dtype)
    total, normed = jax.jit(norm_cpu.add_rms_norm, static_argnums=(3, 4))(x, delta, scale, EPS,
                                                                          out_dtype)
    expected_total, expected_normed = add_rms_norm_xla(x, delta, scale, EPS, out_dtype)
    np.testing.assert_array_equal(np.asarray(total), np.asarray(expected_total))  # one f32 add
    _close(normed, expected_normed, out_dtype)


def test_the_sum_reuses_the_residual_buffer_when_it_is_donated():
    x, delta, scale = _inputs(16, 64, jnp.float32)
    step = jax.jit(lambda x, d, s: norm_cpu.add_rms_norm(x, d, s, EPS), donate_argnums=0)
    expected = np.asarray(x) + np.asarray(delta)
    total, _ = step(x, delta, scale)
    np.testing.assert_array_equal(np.asarray(total), expected)
    assert x.is_deleted()


def test_bfloat16_output_rounds_to_nearest_even_and_keeps_specials():
    # A row of +-1 has an rms of exactly 1, so the output is scale * x rounded to bfloat16: ties go
    # to even, NaN stays NaN, infinities and the largest floats round as XLA's convert does.
    # (No subnormals: XLA's CPU threads flush them to zero, and so do the kernel's.)
    scale = np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -9, 1 + 2 ** -8 + 2 ** -20, np.inf,
                      np.nan, 3.4e38, -3.4e38, 1e-30, -0.0, 65504.0, 0.1, 1.0, 2.0, 7.0, 1e-3],
                     np.float32)
    x = np.tile(np.array([1.0, -1.0], np.float32), 8)[None, :]
    out = norm_cpu.rms_norm(jnp.asarray(x), jnp.asarray(scale), 0.0, jnp.bfloat16)
    expected = jnp.asarray(scale * x[0]).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(out[0], np.float32), np.asarray(expected, np.float32))


def test_bad_shapes_are_refused():
    x, delta, scale = _inputs(4, 64, jnp.float32)
    with pytest.raises(ValueError, match="scale"):
        norm_cpu.rms_norm(x, scale[:32], EPS)
    with pytest.raises(ValueError, match="delta"):
        norm_cpu.add_rms_norm(x, delta[:2], scale, EPS)
