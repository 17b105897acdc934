"""FP8 checkpoints (xlaserve/weights/formats/fp8.py): weights dequantized into the serving dtype
exactly as transformers does it, partial edge blocks as DeepSeek and transformers' FP8 matmul scale
them, and tiny Llama and Qwen3-MoE checkpoints that give transformers' logits and greedy tokens."""
import types

import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize, _dequantize_fp8_weight
from transformers.utils.quantization_config import FineGrainedFP8Config

from tests.weights.dict_source import DictSource
from tests.weights.fp8_writer import (dequantize_reference, quantize_fp8, write_dequantized_checkpoint,
                                    write_fp8_checkpoint)
from tests.tiny_models import make_tiny_checkpoint
from xlaserve.weights.formats.fp8 import Fp8Error, Fp8Source, dequantize_fp8
from xlaserve.weights.loader import load_model
from xlaserve.weights.formats.quantization import check_quantization_config


DTYPES = {"float32": (np.float32, torch.float32, np.uint32),
          "bfloat16": (ml_dtypes.bfloat16, torch.bfloat16, np.uint16),
          "float16": (np.float16, torch.float16, np.uint16)}
# DeepSeek-V3's and Qwen3-8B-FP8's quantization_config.
BLOCK_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": [128, 128]}


def _weight(shape, seed=0):
    return np.random.default_rng(seed).normal(0, 0.08, shape).astype(np.float32)


def _torch_fp8(array):
    return torch.from_numpy(np.ascontiguousarray(array).view(np.uint8)).view(torch.float8_e4m3fn)


@pytest.mark.parametrize("shape", [(256, 384), (2, 128, 256)])
def test_the_test_writer_quantizes_as_transformers_fp8_quantize(shape):
    weight = _weight(shape)
    quantizer = types.SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=(128, 128)))
    theirs = Fp8Quantize(quantizer)._quantize_one("w.weight", torch.from_numpy(weight))
    quantized, scale_inv = quantize_fp8(weight, (128, 128))
    np.testing.assert_array_equal(quantized.view(np.uint8), theirs["w.weight"].view(torch.uint8).numpy())
    np.testing.assert_array_equal(scale_inv, theirs["w.weight_scale_inv"].numpy())


# Shapes whose every dimension is one block or whole blocks, the ones transformers' CPU
# dequantization (`Fp8Dequantize`) scales correctly.
@pytest.mark.parametrize("scheme, shape", [((128, 128), (256, 384)), ((128, 128), (64, 128)),
                                           ((128, 128), (3, 256, 48)), ("channel", (96, 80)),
                                           ("tensor", (96, 80))])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_dequantize_is_transformers_fp8_dequantize_bit_for_bit(scheme, shape, dtype_name):
    ours_dtype, torch_dtype, bits = DTYPES[dtype_name]
    quantized, scale_inv = quantize_fp8(_weight(shape), scheme)
    block = scheme if isinstance(scheme, tuple) else None
    ours = dequantize_fp8(quantized, scale_inv, block, ours_dtype)
    theirs = Fp8Dequantize(None)._dequantize_one(_torch_fp8(quantized), torch.from_numpy(scale_inv),
                                                 torch_dtype)
    assert ours.dtype == np.dtype(ours_dtype) and ours.shape == shape
    their_bits = theirs.view(getattr(torch, f"int{8 * ours.itemsize}")).numpy().view(bits)
    np.testing.assert_array_equal(ours.view(bits), their_bits)


@pytest.mark.parametrize("shape", [(200, 300), (2, 576, 136)])  # 576 rows: DeepSeek-V3's kv_a_proj_with_mqa
def test_partial_edge_blocks_take_the_scale_of_the_block_they_start(shape):
    """As transformers' FP8 matmul and its `_dequantize_fp8_weight` (and DeepSeek's
    `weight_dequant`) scale them; its CPU `Fp8Dequantize` would scale rows 100..127 of a 200-row
    matrix with the second block's scale."""
    quantized, scale_inv = quantize_fp8(_weight(shape), (128, 128))
    assert scale_inv.shape[-2:] == (-(-shape[-2] // 128), -(-shape[-1] // 128))
    ours = dequantize_fp8(quantized, scale_inv, (128, 128), np.float32)
    np.testing.assert_array_equal(ours, dequantize_reference(quantized, scale_inv, (128, 128)))
    theirs = _dequantize_fp8_weight(_torch_fp8(quantized), torch.from_numpy(scale_inv), [128, 128], torch.float32)
    np.testing.assert_array_equal(ours, theirs.numpy())


def test_dequantize_reads_a_large_matrix_in_tiles_to_the_same_values():
    quantized, scale_inv = quantize_fp8(_weight((1100, 1500), seed=1), (128, 128))  # 2 tiles of rows
    ours = dequantize_fp8(quantized, scale_inv, (128, 128), ml_dtypes.bfloat16)
    reference = dequantize_reference(quantized, scale_inv, (128, 128)).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(ours.view(np.uint16), reference.view(np.uint16))


def _refusal(weight, scale_inv, block=(128, 128), dtype=np.float32):
    with pytest.raises(Fp8Error) as error:
        dequantize_fp8(weight, scale_inv, block, dtype, name="w.weight")
    assert "\n" not in str(error.value)
    return str(error.value)


def test_dequantize_refuses_what_it_cannot_read_exactly_in_one_line():
    quantized, scale_inv = quantize_fp8(_weight((200, 300)), (128, 128))
    assert "is float8_e5m2, not float8_e4m3fn" in _refusal(quantized.astype(ml_dtypes.float8_e5m2), scale_inv)
    assert "'w.weight_scale_inv' is uint8" in _refusal(quantized, scale_inv.astype(np.uint8))
    assert ("'w.weight_scale_inv' has shape [2, 2]; for weight [200, 300] expected [2, 3] for "
            "weight_block_size [128, 128], [200, 1] per channel or [1, 1] per tensor"
            ) in _refusal(quantized, scale_inv[:, :2])
    assert "a matrix was expected" in _refusal(quantized[0], scale_inv[0])
    nan = quantized.copy()
    nan.view(np.uint8)[150, 7] = 0x7F  # e4m3fn's NaN
    assert "'w.weight' at [150, 7]: nan x scale" in _refusal(nan, scale_inv)
    huge = np.full_like(scale_inv, 1000.0)  # 448 x 1000 is beyond float16's 65504
    assert "is not finite in float16" in _refusal(quantized, huge, dtype=np.float16)
    stack, stack_scale = quantize_fp8(_weight((3, 64, 64)), (128, 128))
    stack.view(np.uint8)[2, 5, 9] = 0xFF  # -NaN
    assert "'w.weight' at [2, 5, 9]: nan x scale" in _refusal(stack, stack_scale)


def test_fp8_source_dequantizes_hides_scales_and_refuses_an_fp8_tensor_without_one():
    quantized, scale_inv = quantize_fp8(_weight((64, 64)), (128, 128))
    norm = np.ones(64, np.float32)
    source = Fp8Source(DictSource({"a.weight": quantized, "a.weight_scale_inv": scale_inv,
                                 "a.activation_scale": np.ones((), np.float32), "norm.weight": norm,
                                 "b.weight": quantized}), (128, 128), np.float32)
    assert source.names() == {"a.weight", "norm.weight", "b.weight"}
    np.testing.assert_array_equal(source.get("a.weight"), dequantize_reference(quantized, scale_inv, (128, 128)))
    assert source.get("norm.weight") is norm
    with pytest.raises(Fp8Error, match="FP8 tensor 'b.weight' \\(float8_e4m3fn\\) has no 'b.weight_scale_inv'"):
        source.get("b.weight")


@pytest.mark.parametrize("quantization_config", [
    BLOCK_CONFIG,
    # Qwen3-30B-A3B-Instruct-2507-FP8 / MiniMax-M2 (fmt spelled out, MiniMax's ignored_layers name)
    {**BLOCK_CONFIG, "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate"]},
    {**BLOCK_CONFIG, "fmt": "float8_e4m3fn", "ignored_layers": ["gate", "lm_head"]},
    {"quant_method": "fp8", "fmt": "float8_e4m3fn"},  # MiniMax-M2.5: transformers' default 128x128
    {"quant_method": "fp8", "weight_block_size": None, "activation_scheme": "static"},
    FineGrainedFP8Config().to_dict(),  # as transformers writes it after quantizing
])
def test_fp8_quantization_configs_as_released_are_accepted(quantization_config):
    assert check_quantization_config({"model_type": "llama", "quantization_config": quantization_config}) == "fp8"


@pytest.mark.parametrize("field, message", [
    ({"scale_fmt": "ue8m0"}, "scale_fmt 'ue8m0' is not supported \\(only 'float'\\)"),
    ({"expert_dtype": "fp4"}, "expert_dtype 'fp4' is not supported"),
    ({"fmt": "e5m2"}, "fmt 'e5m2' is not supported"),
    ({"activation_scheme": "per_token"}, "activation_scheme 'per_token' is not supported"),
    ({"modules_to_convert": ["embed_tokens"]}, "modules_to_convert \\['embed_tokens'\\] \\(FP8 embedding tables\\)"),
    ({"weight_block_size": [128]}, "weight_block_size must be two positive integers, got \\[128\\]"),
    ({"weight_block_size": [0, 128]}, "weight_block_size must be two positive integers"),
    ({"kv_cache_scheme": {"num_bits": 8}}, "fields this loader does not know: \\['kv_cache_scheme'\\]"),
])
def test_fp8_fields_we_do_not_decode_are_refused_in_one_line(field, message):
    with pytest.raises(ValueError, match=message) as error:
        check_quantization_config({"model_type": "llama", "quantization_config": {**BLOCK_CONFIG, **field}})
    assert "\n" not in str(error.value)


# family, config overrides, quantization_config, scheme per weight name, reference for the logits:
# "dequantized" (transformers running the dequantized weights) where transformers' own CPU FP8
# loading mis-scales partial blocks, "transformers" (its own loading of the FP8 checkpoint) elsewhere.
def _attention_per_tensor_mlp_per_channel(name):
    return "tensor" if "self_attn" in name else "channel"


VARIANTS = {
    # hidden 160, intermediate 288: two or three blocks along each dimension, the last partial.
    "llama_128x128_partial_blocks": ("llama", dict(hidden_size=160, intermediate_size=288),
                                     BLOCK_CONFIG, lambda name: (128, 128), "dequantized"),
    # 8 experts of [144, 160] and [160, 144] each, their own scales.
    "qwen3_moe_128x128_partial_blocks": ("qwen3_moe", dict(hidden_size=160, moe_intermediate_size=144),
                                         BLOCK_CONFIG, lambda name: (128, 128), "dequantized"),
    "qwen3_moe_128x128_whole_blocks": ("qwen3_moe", dict(hidden_size=128), BLOCK_CONFIG,
                                       lambda name: (128, 128), "transformers"),
    # DeepSeek-V3's format on its own architecture (issue 35): every projection FP8 with 128x128
    # blocks, the MLA ones (q_a, q_b, kv_a_proj_with_mqa, kv_b) included, all partial blocks.
    "deepseek_v3_128x128_partial_blocks": ("deepseek_v3", dict(hidden_size=160), BLOCK_CONFIG,
                                           lambda name: (128, 128), "dequantized"),
    "llama_per_tensor_and_per_channel": ("llama", {}, {"quant_method": "fp8", "weight_block_size": None},
                                         _attention_per_tensor_mlp_per_channel, "transformers"),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def fp8_checkpoint(request, tmp_path_factory):
    """(FP8 checkpoint, the same with its weights dequantized to float32, the reference model)."""
    import transformers

    family, overrides, quantization_config, schemes, reference = VARIANTS[request.param]
    plain, fp8, dequantized = (str(tmp_path_factory.mktemp(f"{request.param}_{kind}"))
                               for kind in ("plain", "fp8", "dequantized"))
    make_tiny_checkpoint(plain, family, **overrides)
    write_dequantized_checkpoint(plain, dequantized, write_fp8_checkpoint(plain, fp8, schemes, quantization_config))
    source = fp8 if reference == "transformers" else dequantized
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    return fp8, dequantized, model


def _params(directory, dtype):
    loaded = load_model(directory, dtype=dtype, skip_tokenizer_init=True, progress=False)
    return {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.split(loaded.model)[1])}


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_fp8_checkpoint_loads_exactly_the_dequantized_weights(fp8_checkpoint, dtype_name):
    fp8, dequantized, _ = fp8_checkpoint
    ours, expected = _params(fp8, dtype_name), _params(dequantized, dtype_name)
    assert ours.keys() == expected.keys()
    for path, value in expected.items():
        assert ours[path].dtype == value.dtype == np.dtype(DTYPES[dtype_name][0])
        np.testing.assert_array_equal(ours[path].view(DTYPES[dtype_name][2]), value.view(DTYPES[dtype_name][2]),
                                      err_msg=str(path))


def test_fp8_checkpoint_gives_transformers_logits_and_greedy_tokens(fp8_checkpoint):
    fp8, dequantized, hf_model = fp8_checkpoint
    if hf_model.name_or_path == fp8:  # transformers' own FP8 loading: its weights are ours
        import transformers

        plain = transformers.AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32)
        for name, value in plain.state_dict().items():
            assert torch.equal(hf_model.state_dict()[name], value), name
    assert_gives_transformers_logits_and_greedy_tokens(fp8, hf_model)


def assert_gives_transformers_logits_and_greedy_tokens(directory, hf_model):
    """The checkpoint in `directory`, loaded in float32, gives `hf_model`'s logits (1e-4) and
    greedy tokens on three prompts (also used by test_awq_gptq.py)."""
    from tests.model.test_transformer_matches_transformers import PROMPTS, _hf_reference, _run_ours

    loaded = load_model(directory, dtype="float32", skip_tokenizer_init=True, progress=False)
    references = [_hf_reference(hf_model, prompt) for prompt in PROMPTS[:3]]
    sequences = [(full, len(p)) for p, (full, _) in zip(PROMPTS, references)]
    for (full, expected), got in zip(references, _run_ours(loaded, sequences, 3, 4), strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
        prompt_len = len(full) - 5
        assert got[prompt_len - 1:-1].argmax(-1).tolist() == full[prompt_len:]
