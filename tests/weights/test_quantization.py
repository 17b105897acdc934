"""A quantized checkpoint we do not decode stops start-up with one line naming its method or its
tensor (xlaserve/weights/formats/quantization.py): nothing is cast from codes as if they were
values."""
import json
import os

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from safetensors.torch import save_file
from transformers.utils.quantization_config import QuantizationMethod

from tests.weights.dict_source import DictSource
from tests.tiny_models import make_tiny_checkpoint
from xlaserve.weights.loader import load_model
from xlaserve.weights.formats.quantization import (SUPPORTED_METHODS, QuantizationError,
                                                 check_quantization_config)
from xlaserve.weights.param_layout import expert_matrix


Q_PROJ = "model.layers.0.self_attn.q_proj."  # [64, 64] in the tiny Llama
FP8, E5M2 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)
# Each method's quantization_config as its tools write it, and the tensors its q_proj becomes
# (name suffix -> dtype, shape): llm-compressor's FP8,
# bitsandbytes' NF4 and LLM.int8 (an older config: load_in_8bit, no quant_method), ...
REFUSED = {
    "compressed-tensors": (
        {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
         "quantization_status": "compressed",
         "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
             "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}}}},
        {"weight": (FP8, (64, 64)), "weight_scale": (np.float32, (64, 1))}),
    "bitsandbytes": (
        {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
         "bnb_4bit_compute_dtype": "bfloat16"},
        {"weight": (np.uint8, (2048, 1)), "weight.absmax": (np.float32, (64,)),
         "weight.quant_map": (np.float32, (16,)), "weight.quant_state.bitsandbytes__nf4": (np.uint8, (96,))}),
    "bitsandbytes_8bit_without_quant_method": (
        {"load_in_8bit": True, "llm_int8_threshold": 6.0},
        {"weight": (np.int8, (64, 64)), "SCB": (np.float32, (64,))}),
    "fbgemm_fp8": ({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0},
                   {"weight": (FP8, (64, 64)), "weight_scale": (np.float32, (64, 1))}),
    "torchao": ({"quant_method": "torchao", "quant_type": {"default": {"_type": "Int8WeightOnlyConfig"}}},
                {"weight": (np.int8, (64, 64))}),
    "hqq": ({"quant_method": "hqq", "quant_config": {"weight_quant_params": {"nbits": 4, "group_size": 64}}},
            {"W_q": (np.uint8, (32, 64)), "scale": (np.float16, (64, 1)), "zero": (np.float16, (64, 1))}),
    "eetq": ({"quant_method": "eetq", "weights": "int8"},
             {"weight": (np.int8, (64, 64)), "weight_scales": (np.float16, (64,))}),
    "quanto": ({"quant_method": "quanto", "weights": "int8"},
               {"weight._data": (np.int8, (64, 64)), "weight._scale": (np.float32, (64, 1))}),
    "gguf": ({"quant_method": "gguf"}, {"weight": (np.uint8, (64, 36))}),
}

# AWQ and GPTQ load (tests/weights/test_awq_gptq.py), but not in a packing we do not decode: AutoAWQ's
# GEMV layout, and 3-bit GPTQ (codes across word boundaries).
REFUSED_VARIANTS = {
    "awq_gemv": ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemv"},
                 {"qweight": (np.int32, (64, 8)), "qzeros": (np.int32, (64, 1)), "scales": (np.float16, (64, 2))},
                 "awq quantization_config version 'gemv' is not supported"),
    "gptq_3bit": ({"quant_method": "gptq", "bits": 3, "group_size": 32, "desc_act": False, "sym": True},
                  {"qweight": (np.int32, (6, 64)), "qzeros": (np.int32, (2, 6)),
                   "scales": (np.float16, (2, 64)), "g_idx": (np.int32, (64,))},
                  "gptq quantization_config.bits 3 is not supported"),
}


@pytest.fixture(scope="module")
def plain_llama(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("plain_llama"))
    make_tiny_checkpoint(directory, "llama")
    return directory


def _rewrite(plain: str, directory: str, q_proj: dict, quantization_config=None) -> str:
    """`plain` with layer 0's q_proj.weight replaced by `q_proj` ({suffix: array}) and
    `quantization_config` (if any) in config.json."""
    tensors = {n: torch.from_numpy(v) for n, v in load_file(os.path.join(plain, "model.safetensors")).items()
               if n != Q_PROJ + "weight"}
    tensors.update({Q_PROJ + suffix: _torch(array) for suffix, array in q_proj.items()})
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(plain, "config.json")) as f:
        config = json.load(f)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return directory


def _torch(array: np.ndarray) -> torch.Tensor:
    array = np.ascontiguousarray(array)
    fp8 = {FP8: torch.float8_e4m3fn, E5M2: torch.float8_e5m2}.get(array.dtype)
    return torch.from_numpy(array) if fp8 is None else torch.from_numpy(array.view(np.uint8)).view(fp8)


def _load(directory, dtype="float32"):
    return load_model(directory, dtype=dtype, skip_tokenizer_init=True, progress=False)


def _one_line_error(directory) -> str:
    with pytest.raises(QuantizationError) as error:
        _load(directory)
    message = str(error.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("method", list(REFUSED))
def test_a_checkpoint_of_an_unsupported_method_is_refused_at_load_naming_it(plain_llama, tmp_path, method):
    quantization_config, layout = REFUSED[method]
    q_proj = {suffix: np.zeros(shape, dtype) for suffix, (dtype, shape) in layout.items()}
    message = _one_line_error(_rewrite(plain_llama, str(tmp_path), q_proj, quantization_config))
    named = quantization_config.get("quant_method", "bitsandbytes")
    assert f"quant_method {named!r} is not supported" in message
    assert all(repr(supported) in message for supported in SUPPORTED_METHODS)


@pytest.mark.parametrize("variant", list(REFUSED_VARIANTS))
def test_an_awq_or_gptq_packing_we_do_not_decode_is_refused_at_load_naming_it(plain_llama, tmp_path, variant):
    quantization_config, layout, expected = REFUSED_VARIANTS[variant]
    q_proj = {suffix: np.zeros(shape, dtype) for suffix, (dtype, shape) in layout.items()}
    with pytest.raises(ValueError, match=expected) as error:  # awq_gptq.PackedIntError
        _load(_rewrite(plain_llama, str(tmp_path), q_proj, quantization_config))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("method", [m.value for m in QuantizationMethod if m.value not in SUPPORTED_METHODS])
def test_every_other_transformers_quantization_method_is_refused_by_name(method):
    with pytest.raises(QuantizationError, match=f"quant_method '{method}' is not supported") as error:
        check_quantization_config({"model_type": "llama", "quantization_config": {"quant_method": method}})
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("quantization_config, message", [
    ({"bits": 4}, "quantization_config with no quant_method is not supported"),
    ("fp8", "quantization_config must be a JSON object, got str"),
    ({"quant_method": "fp8", "ignored_layers": "lm_head"}, "ignored_layers must be a list of module names"),
])
def test_a_malformed_quantization_config_is_refused_in_one_line(quantization_config, message):
    with pytest.raises(QuantizationError, match=message) as error:
        check_quantization_config({"model_type": "llama", "quantization_config": quantization_config})
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("dtype", [FP8, E5M2, np.dtype(np.int8), np.dtype(np.uint8), np.dtype(np.int32)],
                         ids=lambda d: d.name)
def test_a_quantized_tensor_without_a_quantization_config_is_refused_naming_it(plain_llama, tmp_path, dtype):
    weight = np.asarray(np.random.default_rng(0).normal(0, 8, (64, 64)), np.float32).astype(dtype)
    message = _one_line_error(_rewrite(plain_llama, str(tmp_path), {"weight": weight}))
    assert message.startswith(f"tensor '{Q_PROJ}weight' is stored as {dtype.name}, not float")


def test_a_packed_tensor_is_refused_for_its_dtype_before_its_shape(plain_llama, tmp_path):
    message = _one_line_error(_rewrite(plain_llama, str(tmp_path), {"weight": np.zeros((2048, 1), np.uint8)}))
    assert f"'{Q_PROJ}weight' is stored as uint8" in message


def test_a_plain_gpt_oss_expert_matrix_stored_as_int8_is_refused():
    name = "model.layers.0.mlp.experts.down_proj"
    with pytest.raises(QuantizationError, match=f"tensor '{name}' is stored as int8, not float"):
        expert_matrix(DictSource({name: np.ones((2, 64, 8), np.int8)}), name, (2, 64, 8))


@pytest.mark.parametrize("stored", ["float16", "bfloat16", "float64"])
def test_float_weights_of_any_width_are_still_cast_to_the_serving_dtype(tmp_path, stored):
    model = make_tiny_checkpoint(str(tmp_path), "llama", dtype=stored)
    loaded = _load(str(tmp_path))
    expected = model.state_dict()["model.embed_tokens.weight"].numpy()  # the stored values, as float32
    np.testing.assert_array_equal(np.asarray(loaded.model.embedding.get_value()), expected)
