"""FP8 weights (model/weight_types/fp8_weights.py): `--quantization fp8`'s per-channel quantization,
the per-token activation quantization and the FP8 x FP8 matmul against float64 references within
e4m3's rounding (XLA's CPU backend runs FP8 dots exactly, in float32), the layout the values are
stored in, and the platforms that refuse the flag in one line."""
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tests.weights.fp8_writer import write_fp8_checkpoint
from tests.model.test_int8 import _weight  # standard normal, output column 3 zero
from tests.tiny_models import make_tiny_checkpoint
from xlaserve.model.weight_types.fp8_weights import (
    FP8_MAX, Fp8BlockMatrix, Fp8Matrix, abstract_fp8, check_fp8_platform, dequantize, float_weight,
    fp8_platform_problem, quantize_fp8, quantize_rows)
from xlaserve.model.layers import Kernels, linear
from xlaserve.weights.loader import load_model


def e4m3_half_ulp(value: np.ndarray) -> np.ndarray:
    """Half the spacing of float8_e4m3fn around |value| (3 mantissa bits; subnormals below 2^-6
    are spaced 2^-9): the most that rounding to nearest moves a value in range."""
    exponent = np.floor(np.log2(np.maximum(np.abs(value), 2.0 ** -6)))
    return 2.0 ** (exponent - 4)


@pytest.mark.parametrize("shape,contracted", [((96, 40), 1), ((4, 16, 40), 2), ((64, 2, 24), 1)])
def test_quantize_fp8_is_the_float64_per_channel_reference_within_e4m3_rounding(shape, contracted):
    w = _weight(shape)
    ours = quantize_fp8(jnp.asarray(w), contracted, jnp.bfloat16)
    out_shape, k_shape = shape[contracted:], shape[:contracted]
    # Stored K-major: the output axes first, the contracted ones last.
    assert ours.values.dtype == jnp.float8_e4m3fn and ours.values.shape == out_shape + k_shape
    assert ours.scales.dtype == jnp.float32 and ours.scales.shape == out_shape
    assert ours.shape == shape and ours.contracted == contracted and ours.compute_dtype == "bfloat16"
    w64 = w.astype(np.float64)
    scales = np.abs(w64).max(axis=tuple(range(contracted))) / 448
    np.testing.assert_allclose(np.asarray(ours.scales), scales, rtol=1e-7, atol=0)
    values = np.moveaxis(np.asarray(ours.values, np.float64).reshape(*out_shape, -1), -1, 0)
    quotient = w64.reshape(values.shape) / np.where(scales > 0, scales, 1.0)
    assert (np.abs(values - quotient) <= e4m3_half_ulp(quotient) * (1 + 1e-6)).all()
    assert np.abs(values).max() == FP8_MAX  # every nonzero column reaches +-448
    assert not values[..., 3].any() and np.asarray(ours.scales).reshape(-1)[3] == 0
    # dequantize: the float32 weight [K..., N...] those values and scales stand for.
    np.testing.assert_allclose(np.asarray(dequantize(ours), np.float64),
                               values.reshape(shape) * np.asarray(ours.scales, np.float64), rtol=1e-7)


def test_quantize_rows_scales_each_row_to_448_and_leaves_a_row_of_zeros_at_scale_1():
    x = np.random.default_rng(1).standard_normal((6, 200)).astype(np.float32) * 3
    x[2] = 0.0
    values, scales = quantize_rows(jnp.asarray(x, jnp.bfloat16))
    x64 = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64)
    expected = np.abs(x64).max(axis=1) / 448
    expected[2] = 1.0
    np.testing.assert_allclose(np.asarray(scales), expected, rtol=1e-7)
    quotient = x64 / expected[:, None]
    values = np.asarray(values, np.float64)
    assert (np.abs(values - quotient) <= e4m3_half_ulp(quotient) * (1 + 1e-6)).all()
    assert not values[2].any() and (np.abs(values).max(axis=1)[[0, 1, 3, 4, 5]] == FP8_MAX).all()


@pytest.mark.parametrize("contracted,out", [(1, (3, 40)), (2, (48,))])
def test_linear_with_fp8_weights_is_the_float64_product_of_the_fp8_operands(contracted, out):
    """linear -> fp8_matmul: x quantized per token, the FP8 x FP8 dot in float32, both scales;
    against float64 on the same FP8 operands (float32 accumulation error only), and against the
    unquantized float64 product within both operands' e4m3 rounding."""
    k_shape = (256,) if contracted == 1 else (4, 64)
    w = _weight((*k_shape, *out), seed=2)
    weight = quantize_fp8(jnp.asarray(w), contracted, jnp.bfloat16)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((7, 256)), jnp.float32)
    y = linear(x, weight, Kernels(attention=None))
    assert y.dtype == jnp.float32 and y.shape == (7, *out)
    x_fp8, x_scales = quantize_rows(x)
    x64 = np.asarray(x_fp8, np.float64) * np.asarray(x_scales, np.float64)[:, None]
    w64 = np.asarray(dequantize(weight), np.float64).reshape(256, -1)
    expected = (x64 @ w64).reshape(7, *out)
    bound = 1e-6 * (np.abs(x64) @ np.abs(w64)).reshape(7, *out)
    assert (np.abs(np.asarray(y, np.float64) - expected) <= bound + 1e-12).all()
    # Each operand is off by at most half an e4m3 step of its scaled value, times its scale.
    x_exact, w_exact = np.asarray(x, np.float64), w.astype(np.float64).reshape(256, -1)
    x_scale = np.asarray(x_scales, np.float64)[:, None]
    w_scale = np.asarray(weight.scales, np.float64).reshape(1, -1)
    x_error = e4m3_half_ulp(x_exact / x_scale) * x_scale
    w_error = e4m3_half_ulp(w_exact / np.where(w_scale > 0, w_scale, 1)) * w_scale
    rounding = np.abs(x_exact) @ w_error + x_error @ np.abs(w_exact) + x_error @ w_error
    error = np.abs(np.asarray(y, np.float64).reshape(7, -1) - x_exact @ w_exact)
    assert (error <= rounding * (1 + 1e-5) + 1e-9).all()


def test_a_block_scaled_weight_dequantizes_each_k_block_with_its_own_column_scales():
    rng = np.random.default_rng(4)
    values = rng.standard_normal((2, 24, 80)).astype(ml_dtypes.float8_e4m3fn)  # [N..., K]
    scales = rng.uniform(0.5, 2, (3, 2, 24)).astype(np.float32)  # K blocks of 32: 32, 32, 16
    matrix = Fp8BlockMatrix(jnp.asarray(values), jnp.asarray(scales), "bfloat16", 32)
    assert matrix.shape == (80, 2, 24) and matrix.contracted == 1
    got = np.asarray(dequantize(matrix))
    for k in (0, 31, 32, 70, 79):
        np.testing.assert_array_equal(got[k], values[:, :, k].astype(np.float32) * scales[k // 32])
    with pytest.raises(ValueError, match="block FP8 kernel"):
        linear(jnp.ones((2, 80)), matrix, Kernels(attention=None))  # no kernel on this platform


def test_abstract_fp8_moves_the_partition_spec_with_the_axes():
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1), ("tensor",))
    o_proj = jax.ShapeDtypeStruct((32, 128, 4096), jnp.bfloat16,
                                  sharding=NamedSharding(mesh, P("tensor")))
    per_channel = abstract_fp8(o_proj, 2)
    assert per_channel.values.shape == (4096, 32, 128)
    assert per_channel.values.sharding.spec == P(None, "tensor", None)
    assert per_channel.scales.shape == (4096,) and per_channel.scales.sharding.spec == P(None)
    block = abstract_fp8(o_proj, 2, block_k=128)
    assert isinstance(block, Fp8BlockMatrix) and block.scales.shape == (32, 4096)
    assert block.block_k == 128 and isinstance(per_channel, Fp8Matrix)
    for matrix in (per_channel, block):  # the float weight each stands for
        weight = float_weight(matrix)
        assert (weight.shape, weight.dtype) == (o_proj.shape, o_proj.dtype)
        assert weight.sharding.is_equivalent_to(o_proj.sharding, 3)


@pytest.mark.parametrize("device,named", [
    (types.SimpleNamespace(platform="cpu", device_kind="cpu"), "CPU (cpu)"),
    (types.SimpleNamespace(platform="tpu", device_kind="TPU v6 lite"), "TPU (TPU v6 lite)"),
    (types.SimpleNamespace(platform="gpu", device_kind="NVIDIA A100-SXM4-80GB",
                           compute_capability="8.0"), "A100-SXM4-80GB (compute capability 8.0)"),
])
def test_fp8_is_refused_in_one_line_where_there_is_no_fp8_matmul(device, named):
    with pytest.raises(ValueError) as error:
        check_fp8_platform(device)
    message = str(error.value)
    assert "\n" not in message and named in message
    assert "compute capability 8.9+ (H100" in message and "--quantization int8" in message


@pytest.mark.parametrize("capability", ["8.9", "9.0", "10.0"])
def test_gpus_of_compute_capability_8_9_and_up_have_fp8_matmuls(capability):
    device = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3",
                                   compute_capability=capability)
    assert fp8_platform_problem(device) is None


def test_the_loader_refuses_quantization_fp8_on_the_cpu_before_reading_weights(tmp_path):
    plain = str(tmp_path / "plain")
    make_tiny_checkpoint(plain, "llama")
    for load_format in ("auto", "dummy"):
        with pytest.raises(ValueError) as error:
            load_model(plain, skip_tokenizer_init=True, progress=False, quantization="fp8",
                       load_format=load_format)
        assert "\n" not in str(error.value)
        assert str(error.value).startswith("--quantization fp8 needs FP8 matmuls, which CPU (cpu)")
    # An FP8 checkpoint needs no flag: on the CPU it is dequantized at load, as before.
    fp8 = str(tmp_path / "fp8")
    write_fp8_checkpoint(plain, fp8, lambda name: "channel",
                         {"quant_method": "fp8", "weight_block_size": None})
    loaded = load_model(fp8, dtype="float32", skip_tokenizer_init=True, progress=False)
    assert loaded.model.layers[0].attn.qkv.get_value().dtype == jnp.float32
