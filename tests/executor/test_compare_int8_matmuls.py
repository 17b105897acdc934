"""benchmarks/compare_int8_matmuls.py (issue 32, item 3): weight-only int8 against W8A8 for one
Llama-3.1-8B gate_up matmul compiled for H100 and TPU v6e without the hardware. Pins what the
table's recommendation rests on: the dots the compiled programs really run, and the predicted
decode and prefill times against bfloat16's."""
import pytest

from benchmarks.compare_int8_matmuls import predict, relative_errors
from tests.compile_targets import devices

K, N = 4096, 28672  # gate_up


@pytest.mark.parametrize("target,topology", [("h100", "h100"), ("v6e", "v6e:2x2")])
def test_w8a8_runs_an_int8_dot_and_halves_prefill_where_weight_only_int8_halves_decode(target,
                                                                                       topology):
    devices(topology)  # skips where the compile-only package is absent
    decode = {f: predict(target, f, 8, K, N) for f in ("bf16", "int8", "w8a8")}
    prefill = {f: predict(target, f, 4096, K, N) for f in ("bf16", "int8", "w8a8")}
    # Weight-only: the int8 weight goes into a bfloat16 dot (converted inside the GEMM on H100,
    # a mixed-type convolution on TPU), never copied out as bfloat16; W8A8: both operands s8.
    assert all("bf16" in types and "s8" in types for types, _ in prefill["int8"]["dots"])
    assert prefill["w8a8"]["dots"] and all(
        types.replace("^T", "") == "s8 x s8" for types, _ in prefill["w8a8"]["dots"])
    # Decode (8 tokens) reads the weight: both int8 forms move about half bfloat16's bytes.
    for formulation in ("int8", "w8a8"):
        ratio = decode[formulation]["seconds"] / decode["bf16"]["seconds"]
        assert 0.45 < ratio < 0.55, (formulation, ratio)
    # Prefill (4096 tokens) is compute-bound: weight-only runs at bfloat16's rate, W8A8 at int8's.
    assert prefill["int8"]["seconds"] == pytest.approx(prefill["bf16"]["seconds"], rel=0.01)
    assert prefill["w8a8"]["seconds"] == pytest.approx(prefill["bf16"]["seconds"] / 2, rel=0.01)


def test_w8a8_rounding_of_activations_costs_most_with_outlier_channels():
    errors = relative_errors(tokens=16, k=1024, n=256)
    for activations in ("gaussian", "outliers"):
        assert errors[(activations, "bf16")] < 1e-5
        assert errors[(activations, "int8")] < 1.5e-2
    assert errors[("gaussian", "w8a8")] > errors[("gaussian", "int8")]
    # A 20x channel sets every row's int8 step: the other channels keep ~3 bits.
    assert errors[("outliers", "w8a8")] > 3 * errors[("outliers", "int8")]
