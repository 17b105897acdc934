"""The CPU split of the fused qkv projection with RoPE (C++ through XLA's FFI) against
`transformer.qkv_rope_xla`: float32 and bfloat16 outputs, GQA groups of 1 to 4, head dims whose
half is and is not a multiple of the vector width, and token counts that do not fill an item."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.model.layers import qkv_rope_xla
from xlaserve.model.rope import rope_cos_sin
from tests.kernels.rounding import assert_close_to_xla
from xlaserve.native import KernelUnavailable, qkv_rope_cpu

try:
    qkv_rope_cpu.load()
except KernelUnavailable as error:  # no compiler here: the model runs on XLA's fusions
    pytest.skip(f"the native CPU RoPE does not build here: {error}", allow_module_level=True)


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("tokens,kv_heads,group,d", [(1, 3, 3, 64), (7, 2, 4, 128), (5, 4, 1, 40),
                                                     (130, 1, 2, 32), (0, 2, 2, 64)],
                         ids=["decode_row", "gqa4_d128", "mha_d40", "many_tokens", "no_tokens"])
def test_equals_xla(tokens, kv_heads, group, d, out_dtype):
    rng = np.random.default_rng(tokens + d)
    qkv = jnp.asarray(rng.standard_normal((tokens, kv_heads, group + 2, d)) * 2, jnp.float32)
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, d, 2) / d))
    cos, sin = rope_cos_sin(inv_freq, rng.integers(0, 4000, tokens).astype(np.int32))
    actual = jax.jit(qkv_rope_cpu.qkv_rope, static_argnums=3)(qkv, cos, sin, out_dtype)
    expected = qkv_rope_xla(qkv, jnp.asarray(cos), jnp.asarray(sin), out_dtype)
    for a, e in zip(actual, expected, strict=True):
        assert_close_to_xla(a, e, out_dtype, f32_rtol=1e-6, atol=1e-5)

def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="qkv_rope"):
        qkv_rope_cpu.qkv_rope(jnp.zeros((4, 2, 3, 64)), jnp.zeros((4, 16)), jnp.zeros((4, 16)))
