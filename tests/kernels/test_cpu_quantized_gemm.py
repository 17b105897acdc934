"""The CPU matmul over quantized weights (native/quantized_gemm_cpu.cc) against numpy in float64 on
the weights gguf.quants.dequantize gives (our i8_row: scale * values), for every format: each row
count the kernel splits differently (with AVX-512: 1-4 rows streamed, 5-31 through the decoded
buffer in 4-row tiles and their remainders, x large enough for runs of groups, 32+ through decoded
float32 panels in 6-row tiles and their remainders; without: 1-2 streamed, 3-4 the buffer, 5+
panels), N not a multiple of the tiles or panels, K of one block and of several (chunks of K added
into y), stacked layers; and the rows an embedding lookup reads, equal bit for bit to gguf's."""
import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.native import KernelUnavailable
from xlaserve.native import quantized_gemm_cpu as quantized

try:
    quantized.load()
except KernelUnavailable as error:  # no compiler here: the model dequantizes at load instead
    pytest.skip(f"the native quantized CPU GEMM does not build here: {error}",
                allow_module_level=True)

matmul = jax.jit(quantized.quantized_matmul, static_argnames=("fmt", "k", "layer"))
rows_of = jax.jit(quantized.quantized_rows, static_argnames=("fmt", "k", "layer"))
ROW_COUNTS = [1, 2, 3, 5, 7, 13, 31, 32, 100, 200]
# K per format: one block, several, and enough for two unequal chunks of K (the kernel decodes
# at most 1024 weights of a row at a time, 512 without AVX-512: 1056 is chunks of 544 and 512,
# 1280 of 768 and 512); for i8_row (no blocks) K that ends in part of a vector, in either chunk.
DEPTHS = {"q8_0": [32, 576, 1056], "q4_0": [32, 576, 1056], "q4_1": [32, 576, 1056],
          "q5_0": [32, 576, 1056], "q5_1": [32, 576, 1056], "q4_k": [256, 768, 1280],
          "q6_k": [256, 768, 1280], "i8_row": [1, 100, 577, 1100]}
CASES = [pytest.param(fmt, k, id=f"{fmt}-k{k}") for fmt, ks in DEPTHS.items() for k in ks]


def assert_matches_float64(y, x, weights) -> None:
    """y = x @ weights.T to float32 summation error: within 2e-5 of sum |x| |w| per output (one
    weight decoded wrong out of K would be off by ~1/K of it)."""
    x64, w64 = np.asarray(x, np.float64), np.asarray(weights, np.float64)
    expected = x64 @ w64.T
    bound = 2e-5 * (np.abs(x64) @ np.abs(w64).T) + 1e-30
    assert y.dtype == jnp.float32 and y.shape == expected.shape
    assert np.all(np.abs(np.asarray(y, np.float64) - expected) <= bound), (
        np.max(np.abs(np.asarray(y, np.float64) - expected) / bound))


@pytest.mark.parametrize("fmt,k", CASES)
def test_matmul_equals_float64_on_the_dequantized_weights(fmt, k):
    rng = np.random.default_rng(k)
    for n in (1, 19, 70):
        rows = quantized.random_rows(fmt, n, k, rng)
        weights = quantized.dequantize(rows, fmt, k)
        for m in ROW_COUNTS if n == 19 else (1, 5):
            x = rng.standard_normal((m, k)).astype(np.float32)
            assert_matches_float64(matmul(jnp.asarray(x), jnp.asarray(rows), fmt=fmt, k=k), x,
                                   weights)


@pytest.mark.parametrize("fmt", ["q8_0", "q5_0", "q5_1", "i8_row", "q4_k"])
@pytest.mark.parametrize("m,k", [(20, 14336), (300, 2048)], ids=["groups", "panels"])
def test_large_x_takes_runs_of_groups_or_panels_over_chunks_of_k(fmt, m, k):
    """With AVX-512, below 32 rows with M * K above the kernel's small-x bound (1 MB of x),
    threads take runs of groups with K in chunks; 300 rows take runs of panels (two, or three
    without AVX-512, the last part filled) with K in three depth blocks."""
    rng = np.random.default_rng(3)
    n = 45
    rows = quantized.random_rows(fmt, n, k, rng)
    x = rng.standard_normal((m, k)).astype(np.float32)
    assert_matches_float64(matmul(jnp.asarray(x), jnp.asarray(rows), fmt=fmt, k=k), x,
                           quantized.dequantize(rows, fmt, k))


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0,
                                   gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q5_0,
                                   gguf.GGMLQuantizationType.Q5_1], ids=lambda t: t.name)
def test_weights_quantized_by_gguf_multiply_as_dequantized(qtype):
    rng = np.random.default_rng(1)
    k, n = 576, 37
    dense = rng.standard_normal((n, k)).astype(np.float32)
    rows = gguf.quants.quantize(dense, qtype)
    fmt = qtype.name.lower()
    assert rows.shape == (n, quantized.row_bytes(fmt, k))
    weights = gguf.quants.dequantize(rows, qtype)
    assert np.max(np.abs(weights - dense)) < 0.5  # the file's weights, roughly
    x = rng.standard_normal((6, k)).astype(np.float32)
    assert_matches_float64(matmul(jnp.asarray(x), jnp.asarray(rows), fmt=fmt, k=k), x, weights)


def test_float16_scales_of_every_finite_kind_decode_as_gguf():
    """Zero, negative, subnormal and the largest float16 as Q8_0's d (CPUs without F16C convert
    them in software)."""
    rng = np.random.default_rng(9)
    rows = quantized.random_rows("q8_0", 6, 64, rng)
    blocks = rows.reshape(12, 34)
    halves = np.array([0.0, -0.0, -0.5, 2.0 ** -24, 3 * 2.0 ** -20, 65504.0, -65504.0, 1.0, 2.0,
                       -3.0, 0.1, 6.1e-5], np.float16)
    blocks[:, :2] = halves.view(np.uint8).reshape(12, 2)
    np.testing.assert_array_equal(
        rows_of(jnp.asarray(rows), jnp.arange(6), fmt="q8_0", k=64),
        quantized.dequantize(rows, "q8_0", 64))


@pytest.mark.parametrize("fmt", list(quantized.FORMATS))
def test_rows_are_the_dequantized_rows_bit_for_bit(fmt):
    rng = np.random.default_rng(2)
    k, n = DEPTHS[fmt][1], 50
    rows = quantized.random_rows(fmt, n, k, rng)
    ids = np.array([0, 49, 7, 7, 23, -1, -50, 60, -70], np.int32)
    expected = quantized.dequantize(rows, fmt, k)[np.asarray(jnp.arange(n)[ids])]  # jnp's rules
    np.testing.assert_array_equal(rows_of(jnp.asarray(rows), jnp.asarray(ids), fmt=fmt, k=k),
                                  expected)


@pytest.mark.parametrize("fmt", ["q4_1", "q5_0", "q5_1", "q6_k", "i8_row"])
def test_a_stack_of_layers_reads_the_given_layer(fmt):
    rng = np.random.default_rng(4)
    k, n = DEPTHS[fmt][1], 21
    stack = np.stack([quantized.random_rows(fmt, n, k, rng) for _ in range(3)])
    x = jnp.asarray(rng.standard_normal((3, k)).astype(np.float32))
    ids = jnp.asarray([3, 20, 0])
    for layer in (1, 2):
        np.testing.assert_array_equal(matmul(x, jnp.asarray(stack), fmt=fmt, k=k, layer=layer),
                                      matmul(x, jnp.asarray(stack[layer]), fmt=fmt, k=k))
        np.testing.assert_array_equal(
            rows_of(jnp.asarray(stack), ids, fmt=fmt, k=k, layer=layer),
            quantized.dequantize(stack[layer], fmt, k)[np.asarray(ids)])


def test_bfloat16_x_is_widened_to_float32():
    rng = np.random.default_rng(5)
    k, n = 64, 9
    rows = jnp.asarray(quantized.random_rows("q8_0", n, k, rng))
    x = jnp.asarray(rng.standard_normal((3, k)), jnp.bfloat16)
    np.testing.assert_array_equal(matmul(x, rows, fmt="q8_0", k=k),
                                  matmul(x.astype(jnp.float32), rows, fmt="q8_0", k=k))


def test_no_rows_of_x_give_no_rows_of_y():
    rows = jnp.asarray(quantized.random_rows("q4_0", 5, 32, np.random.default_rng(6)))
    assert matmul(jnp.zeros((0, 32), jnp.float32), rows, fmt="q4_0", k=32).shape == (0, 5)


def test_i8_rows_hold_the_scale_then_the_values():
    rng = np.random.default_rng(7)
    values = rng.integers(-128, 128, (2, 4, 10), dtype=np.int8)
    scales = rng.uniform(0.01, 1.0, (2, 4)).astype(np.float32)
    rows = np.asarray(quantized.i8_rows(jnp.asarray(values), jnp.asarray(scales)))
    assert rows.dtype == np.uint8 and rows.shape == (2, 4, quantized.row_bytes("i8_row", 10))
    np.testing.assert_array_equal(rows[..., :4].copy().view("<f4")[..., 0], scales)
    np.testing.assert_array_equal(rows[..., 4:].view(np.int8), values)
    np.testing.assert_array_equal(quantized.dequantize(rows[1], "i8_row", 10),
                                  scales[1, :, None] * values[1].astype(np.float32))


def test_row_bytes_follow_the_block_layouts():
    assert quantized.row_bytes("q8_0", 64) == 68
    assert quantized.row_bytes("q4_0", 64) == 36
    assert quantized.row_bytes("q4_1", 64) == 40
    assert quantized.row_bytes("q5_0", 64) == 44
    assert quantized.row_bytes("q5_1", 64) == 48
    assert quantized.row_bytes("q4_k", 512) == 288
    assert quantized.row_bytes("q6_k", 512) == 420
    assert quantized.row_bytes("i8_row", 7) == 11
    for fmt, (block, size) in quantized.FORMATS.items():
        if fmt != "i8_row":
            qtype = gguf.GGMLQuantizationType[fmt.upper()]
            assert gguf.GGML_QUANT_SIZES[qtype] == (block, size)


def test_refuses_unknown_formats_partial_blocks_and_mismatched_shapes():
    rows = jnp.asarray(quantized.random_rows("q4_k", 4, 256, np.random.default_rng(8)))
    x = jnp.ones((2, 256), jnp.float32)
    with pytest.raises(ValueError, match="unknown quantized weight format 'q5_k'"):
        quantized.quantized_matmul(x, rows, fmt="q5_k", k=256)
    with pytest.raises(ValueError, match="K=288 is not a positive multiple of 256"):
        quantized.row_bytes("q4_k", 288)
    with pytest.raises(ValueError, match=r"q6_k weights with K=256 are uint8 \[\(L,\) N, 210\]; "
                       r"got uint8 \(4, 144\)"):
        quantized.quantized_matmul(x, rows, fmt="q6_k", k=256)  # Q4_K's 144 bytes a row
    with pytest.raises(ValueError, match=r"uint8 \[\(L,\) N, 144\]; got int8"):
        quantized.quantized_matmul(x, rows.view(jnp.int8), fmt="q4_k", k=256)
    with pytest.raises(ValueError, match="layer 1 is out of range for 1"):
        quantized.quantized_matmul(x, rows, fmt="q4_k", k=256, layer=1)
    with pytest.raises(ValueError, match="layer 3 is out of range for 3"):
        quantized.quantized_rows(jnp.stack([rows] * 3), jnp.asarray([0]), fmt="q4_k", k=256,
                                 layer=3)
    with pytest.raises(ValueError, match=r"float32 or bfloat16 x \[M, 256\]"):
        quantized.quantized_matmul(jnp.ones((2, 512), jnp.float32), rows, fmt="q4_k", k=256)
    with pytest.raises(ValueError, match="integer ids"):
        quantized.quantized_rows(rows, jnp.asarray([0.0]), fmt="q4_k", k=256)
