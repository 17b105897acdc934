"""The CPU's Q8 GEMM (native/q8_gemm_cpu.cc: x quantized per block, integer dot products as
llama.cpp's) against ggml's dot products written in numpy (ggml_q8_reference.py), for every GGUF
format it takes (and --quantization int8's i8_row rows, W8A8), in the file's layout and the
interleaved "x8" one: each row count its tiles split differently (8, 4, 2 and 1 rows with
AVX-512), x with blocks of zeros, K of one block and several, stacked layers; x quantized exactly as ggml quantizes it (ties to even, the float16 d
and s); its AVX2 path (x86-64-v3, no VNNI) and portable one (x86-64-v2) built and run here; the
x8 layout's round trip and its rows for an embedding lookup."""
import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.native import KernelUnavailable
from xlaserve.native import quantized_gemm_cpu as quantized

from .ggml_q8_reference import half, q8_matmul, quantize_blocks32

try:
    quantized.load_q8()
except KernelUnavailable as error:  # no compiler here: GGUF models take float32 activations
    pytest.skip(f"the Q8 CPU GEMM does not build here: {error}", allow_module_level=True)

matmul = jax.jit(quantized.quantized_matmul,
                 static_argnames=("fmt", "k", "layer", "activations", "march"))
BLOCKS32 = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]
LAYOUTS = [(fmt, fmt) for fmt in BLOCKS32] + [(fmt + "x8", fmt) for fmt in BLOCKS32] + [
    ("q4_k", "q4_k"), ("q6_k", "q6_k"), ("i8_rowx8", "i8_row")]  # i8_row: W8A8, int8's rows
ROW_COUNTS = [1, 2, 3, 8, 13, 64]
# The float32 sums of the products in another order than numpy's float64: within 1e-6 of the
# sum of the scaled |products| (one product off by one is ~1e-4 of it at K = 576).
TOLERANCE = 1e-6


def _rows(layout: str, fmt: str, n: int, k: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """(GGUF rows, the same in `layout`)."""
    rows = quantized.random_rows(fmt, n, k, rng)
    return rows, quantized.interleave_x8(rows, fmt) if layout != fmt else rows


def _x(m: int, k: int, rng) -> np.ndarray:
    x = (rng.standard_normal((m, k)) * rng.uniform(0.01, 10, (m, 1))).astype(np.float32)
    x[m // 2, :32] = 0  # a block of zeros (d = 0)
    return x


def assert_matches_ggml(y, x, rows, fmt) -> None:
    expected, bound = q8_matmul(x, rows, fmt)
    error = np.abs(np.asarray(y, np.float64) - expected)
    assert y.dtype == jnp.float32 and y.shape == expected.shape
    assert np.all(error <= TOLERANCE * bound + 1e-30), np.max(error / (bound + 1e-30))


@pytest.mark.parametrize("layout,fmt", LAYOUTS, ids=[layout for layout, _ in LAYOUTS])
def test_q8_matmul_equals_ggmls_integer_dot_products(layout, fmt):
    rng = np.random.default_rng(len(layout))
    for k in ((256, 768) if fmt in ("q4_k", "q6_k") else (32, 576)):
        rows, laid_out = _rows(layout, fmt, 40, k, rng)
        for m in ROW_COUNTS:
            x = _x(m, k, rng)
            y = matmul(jnp.asarray(x), jnp.asarray(laid_out), fmt=layout, k=k, activations="q8")
            assert_matches_ggml(y, x, rows, fmt)


@pytest.mark.parametrize("x8", [False, True], ids=["file-layout", "x8"])
def test_x_is_quantized_as_ggml_quantizes_it(x8):
    """Q8_0 weights of one 1 per output (d = 1) give x's quantized values times its float16 d,
    exactly (one product each); Q4_1 weights of d = 0, m = 1 give Q8_1's s. Ties go to even:
    with amax = 127 / 8 every x = (j + 0.5) / 8 is one (x * 127 / amax = j + 0.5)."""
    k, rng = 64, np.random.default_rng(0)
    x = rng.standard_normal((4, k)).astype(np.float32)
    x[1, :31] = (np.arange(31) - 14.5) / 8
    x[1, 31] = 127 / 8
    x[2] = 0
    rows = np.zeros((k, 2, 34), np.uint8)
    rows[:, :, 0:2] = np.array([1.0], np.float16).view(np.uint8)
    for j in range(k):
        rows[j, j // 32, 2 + j % 32] = 1
    rows = rows.reshape(k, 68)
    y = np.asarray(matmul(jnp.asarray(x), jnp.asarray(
        quantized.interleave_x8(rows, "q8_0") if x8 else rows), fmt="q8_0x8" if x8 else "q8_0",
        k=k, activations="q8"))
    q, d, s = quantize_blocks32(x)
    np.testing.assert_array_equal(y, (q * d[..., None]).reshape(4, k))
    np.testing.assert_array_equal(q[1, 0, :31], 2 * np.round((np.arange(31) - 14.5) / 2))
    minimum = np.zeros((8, 2, 20), np.uint8)
    minimum[:, :, 2:4] = np.array([1.0], np.float16).view(np.uint8)
    minimum = minimum.reshape(8, 40)
    sums = np.asarray(matmul(jnp.asarray(x), jnp.asarray(
        quantized.interleave_x8(minimum, "q4_1") if x8 else minimum),
        fmt="q4_1x8" if x8 else "q4_1", k=k, activations="q8"))
    np.testing.assert_array_equal(sums, np.repeat(s.sum(-1, dtype=np.float32)[:, None], 8, 1))
    np.testing.assert_array_equal(half(s), s)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 builds")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64-v2"], ids=["avx2", "portable"])
def test_the_avx2_and_portable_paths_give_ggmls_sums(march):
    rng = np.random.default_rng(7)
    for layout, fmt in LAYOUTS:
        k = 512
        rows, laid_out = _rows(layout, fmt, 16, k, rng)
        x = _x(13, k, rng)
        y = matmul(jnp.asarray(x), jnp.asarray(laid_out), fmt=layout, k=k, activations="q8",
                   march=march)
        assert_matches_ggml(y, x, rows, fmt)


@pytest.mark.parametrize("fmt", [*BLOCKS32, "i8_row"])
def test_the_x8_layout_keeps_the_bytes_and_reads_rows_as_the_file(fmt):
    rng = np.random.default_rng(3)
    rows = quantized.random_rows(fmt, 24, 96, rng)
    interleaved = quantized.interleave_x8(rows, fmt)
    assert interleaved.shape == rows.shape and not np.array_equal(interleaved, rows)
    assert np.array_equal(np.sort(interleaved, axis=None), np.sort(rows, axis=None))
    np.testing.assert_array_equal(quantized.deinterleave_x8(interleaved, fmt), rows)
    np.testing.assert_array_equal(
        np.asarray(quantized.deinterleave_x8(jnp.asarray(interleaved), fmt, jnp)), rows)
    np.testing.assert_array_equal(quantized.dequantize(interleaved, fmt + "x8", 96),
                                  quantized.dequantize(rows, fmt, 96))
    ids = jnp.asarray([0, 7, 8, 23, -1, 99], jnp.int32)  # -1 the last, 99 clamped
    lookup = jax.jit(quantized.quantized_rows, static_argnames=("fmt", "k", "layer"))
    np.testing.assert_array_equal(
        np.asarray(lookup(jnp.asarray(interleaved), ids, fmt=fmt + "x8", k=96)),
        np.asarray(lookup(jnp.asarray(rows), ids, fmt=fmt, k=96)))


def test_a_stack_of_layers_reads_the_given_layer():
    rng = np.random.default_rng(5)
    layers = [quantized.random_rows("q4_1", 16, 64, rng) for _ in range(3)]
    stack = quantized.interleave_x8(np.stack(layers), "q4_1")
    x = _x(3, 64, rng)
    for layer in range(3):
        y = matmul(jnp.asarray(x), jnp.asarray(stack), fmt="q4_1x8", k=64, layer=layer,
                   activations="q8")
        assert_matches_ggml(y, x, layers[layer], "q4_1")


def test_refusals():
    rows = quantized.random_rows("q4_0", 16, 64, np.random.default_rng(0))
    x = jnp.ones((1, 64), jnp.float32)
    with pytest.raises(ValueError, match="q8 activations only"):
        quantized.quantized_matmul(x, jnp.asarray(quantized.interleave_x8(rows, "q4_0")),
                                   fmt="q4_0x8", k=64)
    with pytest.raises(ValueError, match="interleaved layout .i8_rowx8. only"):
        quantized.quantized_matmul(x, jnp.zeros((2, 68), jnp.uint8), fmt="i8_row", k=64,
                                   activations="q8")
    with pytest.raises(ValueError, match="not one of"):
        quantized.quantized_matmul(x, jnp.asarray(rows), fmt="q4_0", k=64, activations="int4")
    with pytest.raises(ValueError, match="groups of 8"):
        quantized.interleave_x8(rows[:12], "q4_0")
