"""AWQ and GPTQ checkpoints (xlaserve/weights/formats/awq_gptq.py): weights dequantized exactly (a
float64 reference of (q - z) * s rounded once into the serving dtype), AutoAWQ's nibble order,
GPTQ's v1 zeros-minus-one and act-order g_idx, tiny Llamas and Qwen3-MoEs (every expert packed, the
router float) that give transformers' logits and greedy tokens on the dequantized weights, and every
variant we do not decode refused in one line.

transformers 5.24 loads AWQ and GPTQ only through gptqmodel (AwqQuantizer/GptqHfQuantizer
.validate_environment), which is not installed here, so the reference is transformers running
the dequantized weights as a plain checkpoint."""
import logging

import ml_dtypes
import numpy as np
import pytest
import torch

from tests.weights.awq_gptq_writer import (act_order_g_idx, pack_awq, pack_gptq, quantize, reference,
                                         write_checkpoint)
from tests.weights.dict_source import DictSource
from tests.weights.fp8_writer import write_dequantized_checkpoint
from tests.weights.test_fp8 import _params, assert_gives_transformers_logits_and_greedy_tokens
from tests.tiny_models import make_tiny_checkpoint
from xlaserve.weights.formats.awq_gptq import (PackedIntError, PackedIntSource, dequantize_awq,
                                               dequantize_gptq)
from xlaserve.weights.formats.quantization import check_quantization_config
from xlaserve.weights.param_layout import SafetensorsSource


DTYPES = {"float32": (np.float32, np.uint32), "bfloat16": (ml_dtypes.bfloat16, np.uint16),
          "float16": (np.float16, np.uint16)}
# As AutoAWQ writes it into config.json (TheBloke's and Qwen's -AWQ models), and as GPTQModel /
# AutoGPTQ do (Qwen2.5-7B-Instruct-GPTQ-Int4: sym, desc_act false, v1 format).
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True,
        "checkpoint_format": "gptq", "damp_percent": 0.01, "true_sequential": True}


def _codes(rows, out, groups, bits, seed=0):
    """Random codes, zeros over the whole range (0 and 2^bits - 1 included: v1 wraps them) and
    float16 scales."""
    rng = np.random.default_rng(seed)
    maxq = (1 << bits) - 1
    zeros = rng.integers(0, maxq + 1, (groups, out))
    zeros[0, :2] = 0, maxq
    return (rng.integers(0, maxq + 1, (rows, out)).astype(np.uint8), zeros,
            rng.normal(0, 0.02, (groups, out)).astype(np.float16))


def _bits_equal(ours, expected64, dtype_name):
    dtype, bits = DTYPES[dtype_name]
    assert ours.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(ours.view(bits), expected64.astype(dtype).view(bits))


def test_awq_nibble_order_is_autoawqs():
    """AutoAWQ `awq/utils/packing_utils.py`: AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7], so output
    columns 0..7 holding codes 0..7 pack to nibbles 0, 2, 4, 6, 1, 3, 5, 7 (low to high), the
    word 0x75316420. (Our decoder was also checked bit for bit against AutoAWQ 0.2.9's own
    `dequantize_gemm` on a 256x96 matrix, a one-off: AutoAWQ is not a test dependency.)"""
    codes = np.arange(8, dtype=np.uint8)[None]
    qweight, _ = pack_awq(codes, np.zeros((1, 8), np.int64))
    assert qweight.view(np.uint32)[0, 0] == 0x75316420
    ours = dequantize_awq(qweight, qweight[:1], np.ones((1, 8), np.float16), 1, np.float32)
    np.testing.assert_array_equal(ours, np.zeros((1, 8)))  # zeros equal to the codes
    ours = dequantize_awq(qweight, np.zeros((1, 1), np.int32), np.ones((1, 8), np.float16), 1, np.float32)
    np.testing.assert_array_equal(ours, codes.astype(np.float32))


def test_gptq_codes_are_sequential_and_v1_zeros_are_stored_minus_one():
    """GPTQModel `PackableQuantLinear.pack`: qweight word r holds rows 8r + j in bits 4j; qzeros
    the same along the columns; the v1 format (AutoGPTQ) stores z - 1, wrapped to 4 bits."""
    codes = np.arange(8, dtype=np.uint8)[:, None]
    zeros = np.array([[8, 0, 15, 1, 2, 3, 4, 5]])
    qweight, qzeros_v1 = pack_gptq(codes, zeros, 4, v1=True)
    assert qweight.view(np.uint32)[0, 0] == 0x76543210
    assert qzeros_v1.view(np.uint32)[0, 0] == 0x43210EF7  # 7, 15, 14, 0, 1, 2, 3, 4 from the low nibble
    ones = np.ones((1, 1), np.float16)
    for v1, qzeros in ((True, qzeros_v1), (False, pack_gptq(codes, zeros, 4, v1=False)[1])):
        ours = dequantize_gptq(qweight, qzeros, ones, None, 4, -1, v1, np.float32)
        np.testing.assert_array_equal(ours[:, 0], np.arange(8) - 8)  # column 0's zero is 8


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("group_size", [32, -1])
def test_awq_dequantize_is_the_float64_reference_rounded_once(dtype_name, group_size):
    rows, out = 128, 48
    groups = 1 if group_size == -1 else rows // group_size
    codes, zeros, scales = _codes(rows, out, groups, 4)
    qweight, qzeros = pack_awq(codes, zeros)
    ours = dequantize_awq(qweight, qzeros, scales, group_size, DTYPES[dtype_name][0])
    g_idx = np.arange(rows) // (rows if group_size == -1 else group_size)
    _bits_equal(ours, reference(codes, zeros, scales, g_idx), dtype_name)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("bits, group_size, act_order, v1", [
    (4, 32, False, True), (4, 32, True, True), (4, -1, False, False), (4, 64, True, False),
    (8, 32, True, True), (8, 32, False, False), (2, 16, False, True)])
def test_gptq_dequantize_is_the_float64_reference_rounded_once(dtype_name, bits, group_size, act_order, v1):
    rows, out = 128, 48
    size = rows if group_size == -1 else group_size
    groups = rows // size
    g_idx = (act_order_g_idx(rows, size, np.random.default_rng(1)) if act_order
             else (np.arange(rows) // size).astype(np.int32))
    codes, zeros, scales = _codes(rows, out, groups, bits)
    qweight, qzeros = pack_gptq(codes, zeros, bits, v1)
    ours = dequantize_gptq(qweight, qzeros, scales, g_idx if act_order or v1 else None, bits,
                           group_size, v1, DTYPES[dtype_name][0])
    _bits_equal(ours, reference(codes, zeros, scales, g_idx), dtype_name)


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_matmul_with_the_dequantized_weights_is_the_float64_one_within_its_rounding(dtype_name):
    rows, out = 256, 64
    weight = np.random.default_rng(2).normal(0, 0.05, (rows, out))
    g_idx = (np.arange(rows) // 64).astype(np.int32)
    codes, zeros, scales = quantize(weight, g_idx, 4, 4, sym=False)
    qweight, qzeros = pack_awq(codes, zeros)
    ours = dequantize_awq(qweight, qzeros, scales, 64, DTYPES[dtype_name][0]).astype(np.float64)
    exact = reference(codes, zeros, scales, g_idx)
    assert np.abs(exact - weight).max() < scales.astype(np.float64).max()  # the writer quantizes
    x = np.random.default_rng(3).normal(0, 1, (8, rows))
    eps = float(ml_dtypes.finfo(DTYPES[dtype_name][0]).eps)
    bound = np.abs(x) @ np.abs(exact) * eps / 2  # each weight rounded once, by at most half an ulp
    assert (np.abs(x @ ours - x @ exact) <= bound).all()
    assert not np.array_equal(ours, exact)  # the rounding is real: this bound is the one that holds


def test_packed_int_source_presents_weights_and_hides_the_packed_tensors():
    codes, zeros, scales = _codes(64, 16, 2, 4)
    qweight, qzeros = pack_gptq(codes, zeros, 4, v1=True)
    norm = np.ones(16, np.float32)
    source = PackedIntSource(DictSource({
        "a.qweight": qweight, "a.qzeros": qzeros, "a.scales": scales, "a.bias": norm,
        "a.g_idx": (np.arange(64) // 32).astype(np.int32), "norm.weight": norm}),
        "gptq", GPTQ, np.float32)
    assert source.names() == {"a.weight", "a.bias", "norm.weight"}
    expected = reference(codes, zeros, scales, np.arange(64) // 32).T  # a Linear's [out, in]
    np.testing.assert_array_equal(source.get("a.weight"), expected.astype(np.float32))
    assert source.get("norm.weight") is norm and source.get("a.bias") is norm


def _refusal(call):
    with pytest.raises((PackedIntError, ValueError)) as error:
        call()
    assert "\n" not in str(error.value)
    return str(error.value)


@pytest.mark.parametrize("quantization_config, message", [
    ({**AWQ, "version": "gemv"}, "awq quantization_config version 'gemv' is not supported"),
    ({**AWQ, "version": "gemv_fast"}, "version 'gemv_fast' is not supported"),
    ({**AWQ, "version": None, "format": "llm-awq"}, "version 'llm-awq' is not supported"),
    ({**AWQ, "backend": "llm-awq"}, "backend 'llm-awq' is not supported"),
    ({**AWQ, "bits": 8}, "awq quantization_config.bits 8 is not supported \\(only 4\\)"),
    ({**AWQ, "zero_point": False}, "zero_point False is not supported"),
    ({**AWQ, "group_size": 0}, "group_size must be a positive integer or -1, got 0"),
    ({**GPTQ, "bits": 3}, "gptq quantization_config.bits 3 is not supported \\(only 2 or 4 or 8\\)"),
    ({**GPTQ, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin' is not supported"),
    ({**GPTQ, "checkpoint_format": None, "format": "bitblas"}, "checkpoint_format 'bitblas'"),
    ({**GPTQ, "pack_dtype": "int16"}, "pack_dtype 'int16' is not supported \\(only int32\\)"),
    ({**GPTQ, "dynamic": {r"-:.*down_proj": {}}}, "dynamic \\(per-module overrides\\) is not supported"),
])
def test_awq_and_gptq_variants_we_do_not_decode_are_refused_in_one_line(quantization_config, message):
    with pytest.raises(PackedIntError, match=message) as error:
        check_quantization_config({"model_type": "llama", "quantization_config": quantization_config})
    assert "\n" not in str(error.value)


def test_awq_and_gptq_configs_as_released_are_accepted():
    assert check_quantization_config({"quantization_config": AWQ}) == "awq"
    assert check_quantization_config({"quantization_config": {**AWQ, "version": "GEMM"}}) == "awq"
    assert check_quantization_config({"quantization_config": GPTQ}) == "gptq"
    v2 = {**GPTQ, "checkpoint_format": "gptq_v2", "sym": False, "desc_act": True, "bits": 8}
    assert check_quantization_config({"quantization_config": v2}) == "gptq"


def test_packed_tensors_we_cannot_read_exactly_are_refused_in_one_line():
    codes, zeros, scales = _codes(64, 16, 2, 4)
    qweight, qzeros = pack_gptq(codes, zeros, 4, v1=True)
    gptq = lambda **kw: dequantize_gptq(**{"qweight": qweight, "qzeros": qzeros, "scales": scales,  # noqa: E731
                                           "g_idx": None, "bits": 4, "group_size": 32,
                                           "zeros_minus_one": True, "dtype": np.float32, "name": "m",
                                           **kw})
    assert "'m.scales' is float32; scales are read as float16 or bfloat16" in _refusal(
        lambda: gptq(scales=scales.astype(np.float32)))
    assert "'m.qweight' is uint8" in _refusal(lambda: gptq(qweight=qweight.view(np.uint8)))
    assert "'m.scales' has shape [2, 16], expected [1, 16]" in _refusal(lambda: gptq(group_size=64))
    assert "'m.qzeros' has shape [1, 2], expected [2, 2]" in _refusal(lambda: gptq(qzeros=qzeros[:1]))
    bad_g_idx = np.full(64, 2, np.int32)
    assert "'m.g_idx' holds groups 2..2, outside the 2 of its scales" in _refusal(lambda: gptq(g_idx=bad_g_idx))
    inf = scales.copy()
    inf[1, 3] = np.inf
    assert "'m.scales' holds a value that is not finite" in _refusal(lambda: gptq(scales=inf))
    huge = np.full_like(scales, 60000)  # 15 x 60000 is beyond float16's 65504
    assert "is not finite in float16" in _refusal(lambda: gptq(scales=huge, dtype=np.float16))
    awq_qweight, awq_qzeros = pack_awq(codes, zeros)
    dangling = DictSource({"a.qweight": awq_qweight, "a.qzeros": awq_qzeros, "a.scales": scales,
                           "mlp.act.scales": np.ones(16, np.float16)})
    assert "awq tensor 'mlp.act.scales' has no 'mlp.act.qweight'" in _refusal(
        lambda: PackedIntSource(dangling, "awq", AWQ, np.float32))


# A tiny Qwen3-MoE: 2 layers, 4 experts, top 2, hidden 64, expert intermediate 128 (groups of 32
# divide both), every expert's gate/up/down and the attention quantized, the router float.
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128)
# name: (family, config overrides, quantization_config); the Llama's hidden is 64, intermediate 128.
VARIANTS = {
    "awq": ("llama", {}, AWQ),
    "gptq_v1_sym": ("llama", {}, GPTQ),
    "gptq_v1_act_order": ("llama", {}, {**GPTQ, "desc_act": True}),
    "gptq_v2_asym_act_order_8bit": ("llama", {}, {**GPTQ, "checkpoint_format": "gptq_v2",
                                                  "sym": False, "desc_act": True, "bits": 8}),
    "gptq_v1_asym_per_channel": ("llama", {}, {**GPTQ, "sym": False, "group_size": -1}),
    "qwen3_moe_awq": ("qwen3_moe", MOE, AWQ),
    # AutoAWQ's MoE models set modules_to_not_convert ["gate"]; matched as a substring it leaves
    # the experts' gate_proj float beside their packed up_proj and down_proj.
    "qwen3_moe_awq_not_convert_gate": ("qwen3_moe", MOE, {**AWQ, "modules_to_not_convert": ["gate"]}),
    "qwen3_moe_gptq_v1_act_order": ("qwen3_moe", MOE, {**GPTQ, "desc_act": True}),
    "qwen3_moe_gptq_v2_asym_8bit": ("qwen3_moe", MOE, {**GPTQ, "checkpoint_format": "gptq_v2",
                                                       "sym": False, "bits": 8}),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def packed_checkpoint(request, tmp_path_factory):
    """(packed checkpoint, the same with its weights dequantized to float32, transformers on those)."""
    import transformers

    family, overrides, quantization_config = VARIANTS[request.param]
    plain, packed, dequantized = (str(tmp_path_factory.mktemp(f"{request.param}_{kind}"))
                                  for kind in ("plain", "packed", "dequantized"))
    make_tiny_checkpoint(plain, family, **overrides)
    values = write_checkpoint(plain, packed, quantization_config)
    # float32 holds (q - z) * s exactly (fp16 scale x small integer)
    write_dequantized_checkpoint(plain, dequantized, {n: v.astype(np.float32) for n, v in values.items()})
    model = transformers.AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    return packed, dequantized, model


def test_packed_checkpoint_holds_the_packed_tensors_the_tests_below_decode(packed_checkpoint):
    """Attention packed in every variant; in the MoE ones every expert's projections packed (but
    gate_proj under AutoAWQ's ["gate"]) and the router float, as the real writers leave it."""
    packed, _, hf_model = packed_checkpoint
    names = SafetensorsSource(packed).names()
    for layer in range(2):
        assert f"model.layers.{layer}.self_attn.q_proj.qweight" in names
        if hf_model.config.model_type != "qwen3_moe":
            assert f"model.layers.{layer}.mlp.gate_proj.qweight" in names
            continue
        assert f"model.layers.{layer}.mlp.gate.weight" in names  # the router
        not_converted = "not_convert_gate" in packed
        for expert in range(MOE["num_experts"]):
            module = f"model.layers.{layer}.mlp.experts.{expert}."
            assert {module + "up_proj.qweight", module + "down_proj.qweight"} <= names
            assert (module + "gate_proj.weight" in names) == not_converted
            assert (module + "gate_proj.qweight" in names) != not_converted


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_packed_checkpoint_loads_exactly_the_dequantized_weights(packed_checkpoint, dtype_name, caplog):
    packed, dequantized, _ = packed_checkpoint
    with caplog.at_level(logging.INFO, logger="xlaserve.weights.formats.awq_gptq"):
        ours = _params(packed, dtype_name)
    method = "AWQ" if "awq" in packed else "GPTQ"
    assert f"{method} int" in caplog.text and f"weights dequantized to {dtype_name} at load" in caplog.text
    expected = _params(dequantized, dtype_name)
    assert ours.keys() == expected.keys()
    bits = DTYPES[dtype_name][1]
    for path, value in expected.items():
        np.testing.assert_array_equal(ours[path].view(bits), value.view(bits), err_msg=str(path))


def test_packed_checkpoint_gives_transformers_logits_and_greedy_tokens(packed_checkpoint):
    packed, _, hf_model = packed_checkpoint
    assert_gives_transformers_logits_and_greedy_tokens(packed, hf_model)
