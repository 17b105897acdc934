"""How close a native kernel's output must be to XLA's for the same math: float32 to a few ulps;
bfloat16 to one rounding step (float32 sums in another order, or a last-bit difference in exp,
may round a value the other way), with most values equal."""
import jax.numpy as jnp
import numpy as np


def assert_close_to_xla(actual, expected, out_dtype, f32_rtol: float, atol: float) -> None:
    assert actual.dtype == jnp.dtype(out_dtype) and actual.shape == expected.shape
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    if out_dtype == jnp.bfloat16:
        np.testing.assert_allclose(actual, expected, rtol=2 ** -7, atol=atol)
        assert actual.size == 0 or np.mean(actual == expected) > 0.97
    else:
        np.testing.assert_allclose(actual, expected, rtol=f32_rtol, atol=atol)
