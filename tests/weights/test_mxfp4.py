"""MXFP4 decoding (xlaserve/weights/formats/mxfp4.py) against transformers' decoder and loader, bit
for bit."""
import json
import os

import ml_dtypes
import numpy as np
import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from tests.weights.dict_source import DictSource
from tests.weights.mxfp4_writer import EXPERT_MATRICES, QUANTIZATION_CONFIG, encode_mxfp4
from xlaserve.weights.formats.mxfp4 import FP4_VALUES, Mxfp4Error, decode_mxfp4, read_expert_weight
from xlaserve.weights.formats.quantization import QuantizationError, check_quantization_config
from xlaserve.weights.param_layout import SafetensorsSource, WeightError, expert_matrix


DTYPES = {"bfloat16": (ml_dtypes.bfloat16, torch.bfloat16, np.uint16),
          "float32": (np.float32, torch.float32, np.uint32),
          "float16": (np.float16, torch.float16, np.uint16)}


def transformers_decode(blocks, scales, dtype_name):
    _, torch_dtype, bits = DTYPES[dtype_name]
    out = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch_dtype)
    return out.view(torch.int16 if bits == np.uint16 else torch.int32).numpy().view(bits)


def bits_of(array, dtype_name):
    return array.view(DTYPES[dtype_name][2])


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_decode_equals_transformers_for_every_scale_byte_and_code(dtype_name):
    # Row r holds all 256 byte values under scale byte r: every (scale, code) pair of the format.
    blocks = np.tile(np.arange(256, dtype=np.uint8).reshape(16, 16), (1, 256, 1, 1))
    scales = np.tile(np.arange(256, dtype=np.uint8)[:, None], (1, 1, 16))
    expected = transformers_decode(blocks, scales, dtype_name)  # [1, 512, 256]
    finite = np.isfinite(expected.view(DTYPES[dtype_name][0]).astype(np.float32)).all(axis=1)[0]
    first_overflow = int(np.argmin(finite))
    assert finite[:first_overflow].all() and not finite[first_overflow:].any()
    assert first_overflow == {"bfloat16": 253, "float32": 253, "float16": 141}[dtype_name]

    decoded = decode_mxfp4(blocks[:, :first_overflow], scales[:, :first_overflow], DTYPES[dtype_name][0])
    assert decoded.shape == (1, 512, first_overflow)
    np.testing.assert_array_equal(bits_of(decoded, dtype_name), expected[..., :first_overflow])
    for byte in (first_overflow, 254, 255):
        with pytest.raises(Mxfp4Error, match=f"scale byte {byte} .* overflows {dtype_name}"):
            decode_mxfp4(blocks[:, byte:byte + 1], scales[:, byte:byte + 1], DTYPES[dtype_name][0])


def test_decode_keeps_zero_codes_under_a_scale_that_overflows_other_codes():
    blocks = np.zeros((1, 2, 1, 16), np.uint8)
    blocks[0, 1] = 0x88  # -0.0, -0.0
    scales = np.full((1, 2, 1), 254, np.uint8)
    decoded = decode_mxfp4(blocks, scales, np.float32)
    np.testing.assert_array_equal(bits_of(decoded, "float32"), transformers_decode(blocks, scales, "float32"))


@pytest.mark.parametrize("layout", ["C", "F"])
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_decode_equals_transformers_on_random_experts(dtype_name, layout):
    rng = np.random.default_rng(1)
    # 300 rows cross the 256-row decoding tile; scales span gpt-oss's range and the extremes.
    blocks = rng.integers(0, 256, (3, 300, 4, 16), dtype=np.uint8)
    scales = np.clip(rng.normal(127, 40, (3, 300, 4)), 0, 252).astype(np.uint8)
    scales[0, 0, :] = (0, 1, 251, 252)
    expected = transformers_decode(blocks, scales, dtype_name)
    decoded = decode_mxfp4(np.asarray(blocks, order=layout), np.asarray(scales, order=layout),
                           DTYPES[dtype_name][0])
    assert decoded.shape == (3, 4 * 32, 300)  # [experts, in = groups * 32, out = rows]
    np.testing.assert_array_equal(bits_of(decoded, dtype_name), expected)


@pytest.mark.parametrize("blocks, scales, dtype, message", [
    (np.zeros((2, 3, 4, 16), np.int8), np.zeros((2, 3, 4), np.uint8), np.float32, "blocks must be uint8, got int8"),
    (np.zeros((2, 3, 4, 16), np.uint8), np.zeros((2, 3, 4), np.int32), np.float32, "scales must be uint8, got int32"),
    (np.zeros((2, 3, 4, 8), np.uint8), np.zeros((2, 3, 4), np.uint8), np.float32, r"blocks must be .* got \[2, 3, 4, 8\]"),
    (np.zeros((3, 4, 16), np.uint8), np.zeros((3, 4), np.uint8), np.float32, r"blocks must be .* got \[3, 4, 16\]"),
    (np.zeros((2, 3, 4, 16), np.uint8), np.zeros((2, 3, 5), np.uint8), np.float32, r"scales \[2, 3, 5\] do not match"),
    (np.zeros((2, 3, 4, 16), np.uint8), np.zeros((2, 3, 4), np.uint8), np.float64, "cannot decode MXFP4 into float64"),
    (np.zeros((2, 3, 4, 16), np.uint8), np.zeros((2, 3, 4), np.uint8), np.int8, "cannot decode MXFP4 into int8"),
])
def test_decode_refuses_bad_input_in_one_line(blocks, scales, dtype, message):
    with pytest.raises(Mxfp4Error, match=message) as error:
        decode_mxfp4(blocks, scales, dtype, name="w")
    assert "\n" not in str(error.value) and str(error.value).startswith("w: ")


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_encode_then_decode_returns_representable_values_exactly(dtype_name):
    rng = np.random.default_rng(2)
    blocks = rng.integers(0, 256, (2, 24, 3, 16), dtype=np.uint8)
    scales = rng.integers(0, 253, (2, 24, 3), dtype=np.uint8)  # the whole finite range
    weight = decode_mxfp4(blocks, scales, DTYPES[dtype_name][0])
    again = decode_mxfp4(*encode_mxfp4(weight.astype(np.float32)), DTYPES[dtype_name][0])
    np.testing.assert_array_equal(bits_of(again, dtype_name), bits_of(weight, dtype_name))


def test_encode_takes_the_ocp_scale_and_the_nearest_fp4_value():
    rng = np.random.default_rng(3)
    weight = rng.normal(0, 0.05, (2, 64, 8)) * np.exp(rng.normal(0, 2, (2, 64, 1)))
    weight[0, 3, 5] = 0.0
    weight[1, :32, 0] = 0.0  # an all-zero group
    blocks, scales = encode_mxfp4(weight)
    decoded = decode_mxfp4(blocks, scales, np.float32).astype(np.float64)
    groups = weight.transpose(0, 2, 1).reshape(2, 8, 2, 32)
    amax = np.abs(groups).max(-1)
    exponents = scales.astype(np.int64) - 127
    nonzero = amax > 0
    np.testing.assert_array_equal(exponents[nonzero], np.floor(np.log2(amax[nonzero])) - 2)
    step = np.repeat(2.0 ** exponents, 32, axis=-1).reshape(2, 8, 64).transpose(0, 2, 1)
    candidates = FP4_VALUES.astype(np.float64)[:, None, None, None] * step  # [16, E, in, out]
    best = np.abs(candidates - weight).min(axis=0)
    np.testing.assert_array_equal(np.abs(decoded - weight), best)


@pytest.mark.parametrize("hf_config, expected", [
    ({"model_type": "gpt_oss"}, None),
    ({"model_type": "gpt_oss", "quantization_config": QUANTIZATION_CONFIG}, "mxfp4"),
    ({"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}}, "mxfp4"),
])
def test_quantization_config_accepts_mxfp4_gpt_oss(hf_config, expected):
    assert check_quantization_config(hf_config) == expected


@pytest.mark.parametrize("hf_config, message", [
    ({"model_type": "qwen3_moe", "quantization_config": {"quant_method": "mxfp4"}},
     "gpt_oss expert weights only, not model_type 'qwen3_moe'"),
    ({"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": "lm_head"}},
     "modules_to_not_convert must be a list"),
    ({"model_type": "gpt_oss", "quantization_config": "mxfp4"}, "must be a JSON object"),
])
def test_mxfp4_quantization_config_refuses_other_models_and_malformed_fields_in_one_line(hf_config, message):
    with pytest.raises(QuantizationError, match=message) as error:
        check_quantization_config(hf_config)
    assert "\n" not in str(error.value)


def test_tiny_checkpoint_has_the_gpt_oss_on_disk_layout(tiny_gpt_oss):
    directory, model = tiny_gpt_oss
    c = model.config
    source = SafetensorsSource(directory)
    E, H, I = c.num_local_experts, c.hidden_size, c.intermediate_size
    expected = {"gate_up_proj_blocks": ((E, 2 * I, H // 32, 16), np.uint8),
                "gate_up_proj_scales": ((E, 2 * I, H // 32), np.uint8),
                "gate_up_proj_bias": ((E, 2 * I), ml_dtypes.bfloat16),
                "down_proj_blocks": ((E, H, I // 32, 16), np.uint8),
                "down_proj_scales": ((E, H, I // 32), np.uint8),
                "down_proj_bias": ((E, H), ml_dtypes.bfloat16)}
    for i in range(c.num_hidden_layers):
        prefix = f"model.layers.{i}.mlp."
        for suffix, (shape, dtype) in expected.items():
            tensor = source.get(prefix + "experts." + suffix)
            assert (tensor.shape, tensor.dtype) == (shape, np.dtype(dtype))
        assert source.get(prefix + "router.weight").shape == (E, H)
        assert prefix + "experts.gate_up_proj" not in source.names()
    with open(os.path.join(directory, "config.json")) as f:
        hf_config = json.load(f)
    assert hf_config["quantization_config"] == QUANTIZATION_CONFIG
    assert check_quantization_config(hf_config) == "mxfp4"


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_transformers_loads_the_tiny_checkpoint_to_the_experts_we_decode(tiny_gpt_oss, dtype_name):
    import transformers

    directory, model = tiny_gpt_oss
    # On CPU without Triton kernels transformers dequantizes MXFP4 at load (Mxfp4Dequantize).
    loaded = transformers.GptOssForCausalLM.from_pretrained(directory, dtype=DTYPES[dtype_name][1])
    source = SafetensorsSource(directory)
    for i, layer in enumerate(loaded.model.layers):
        for proj in EXPERT_MATRICES:
            param = getattr(layer.mlp.experts, proj).detach()
            name = f"model.layers.{i}.mlp.experts.{proj}"
            decoded = read_expert_weight(source, name, tuple(param.shape), DTYPES[dtype_name][0])
            expected = param.view(torch.int16 if dtype_name == "bfloat16" else torch.int32).numpy()
            np.testing.assert_array_equal(bits_of(decoded, dtype_name), expected.view(DTYPES[dtype_name][2]))
    if dtype_name == "float32":  # the writer's model holds exactly the checkpoint's values
        for name, tensor in model.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], tensor), name


def test_an_expert_matrix_is_read_plain_or_decoded_from_mxfp4_and_what_is_missing_is_named():
    """weights.expert_matrix chooses: a plain matrix as stored, else MXFP4 blocks and scales
    (read_expert_weight), else one line naming both."""
    plain = np.arange(2 * 64 * 8, dtype=np.float32).reshape(2, 64, 8)
    name = "model.layers.0.mlp.experts.down_proj"
    assert expert_matrix(DictSource({name: plain}), name, (2, 64, 8)) is plain
    blocks, scales = encode_mxfp4(plain)
    packed = DictSource({name + "_blocks": blocks, name + "_scales": scales})
    decoded = expert_matrix(packed, name, (2, 64, 8))
    assert decoded.dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(bits_of(decoded, "bfloat16"), transformers_decode(blocks, scales, "bfloat16"))
    with pytest.raises(Mxfp4Error, match=f"missing tensor '{name}_scales' \\(expected shape \\[2, 8, 2\\]\\)"):
        expert_matrix(DictSource({name + "_blocks": blocks}), name, (2, 64, 8))
    with pytest.raises(Mxfp4Error, match=r"_blocks' has shape \[2, 8, 2, 16\], expected \[2, 4, 4, 16\]"):
        read_expert_weight(packed, name, (2, 128, 4), np.float32)
    with pytest.raises(WeightError, match=f"neither '{name}' nor its MXFP4 '{name}_blocks'"):
        expert_matrix(DictSource({}), name, (2, 64, 8))
    with pytest.raises(WeightError, match=r"has shape \[2, 64, 8\], expected \[2, 8, 64\]"):
        expert_matrix(DictSource({name: plain}), name, (2, 8, 64))


def test_encode_rounds_ties_to_the_even_code_and_saturates_at_six():
    # max |v| = 7.5 gives the shared exponent floor(log2 7.5) - 2 = 0: the values are their own FP4 targets.
    row = [7.5, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 6.9, -7.0]
    weight = np.zeros((1, 32, 1))
    weight[0, :len(row), 0] = row
    blocks, scales = encode_mxfp4(weight)
    assert scales.tolist() == [[[127]]]
    decoded = decode_mxfp4(blocks, scales, np.float32)[0, :len(row), 0]
    assert decoded.tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -4.0, 6.0, -6.0]


def test_mxfp4_gpt_oss_checkpoint_gives_transformers_logits_and_greedy_tokens(tiny_gpt_oss):
    """Our loader decodes the MXFP4 experts, de-interleaves gate and up, and the decoder (sinks,
    sliding and full layers, YaRN, biases, clamped SwiGLU) gives transformers' logits."""
    from tests.model.test_transformer_matches_transformers import PROMPTS, _hf_reference, _run_ours
    from xlaserve.weights.loader import load_model

    directory, hf_model = tiny_gpt_oss
    loaded = load_model(directory, dtype="float32", skip_tokenizer_init=True, progress=False)
    references = [_hf_reference(hf_model, prompt) for prompt in PROMPTS[:3]]
    sequences = [(full, len(p)) for p, (full, _) in zip(PROMPTS, references)]
    for (full, expected), got in zip(references, _run_ours(loaded, sequences, 3, 4), strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
        assert got[:-1].argmax(-1).tolist()[-5:] == full[-5:]
