"""Which quantized checkpoints load: the one place that reads `quantization_config` and refuses,
in one line, what we do not decode, so that no checkpoint loads silently wrong.

Two decisions, both made before any weight is used:
- the config: `check_quantization_config` accepts no quantization, "fp8" (weights/formats/fp8.py:
  dequantized at load), "awq" and "gptq" (weights/formats/awq_gptq.py: dequantized at load) and
  gpt-oss's "mxfp4" (weights/formats/mxfp4.py); every other `quant_method` (compressed-tensors,
  bitsandbytes, torchao, ...) and every AWQ/GPTQ variant whose packing we do not decode stops
  start-up naming it.
- the tensors: `check_float_tensor` refuses a stored tensor that is not float16, bfloat16, float32
  or float64 where a weight is read (an FP8, int8 or packed-int tensor that no accepted method
  has dequantized), naming it and its dtype, instead of casting its codes as if they were values.
"""
from __future__ import annotations

import logging

import ml_dtypes
import numpy as np

from xlaserve.weights.formats.awq_gptq import (PackedIntSource, check_awq_config,
                                               check_gptq_config, log_dequantizing)
from xlaserve.weights.formats.fp8 import Fp8Source, check_fp8_config
from xlaserve.weights.formats.tensor_source import TensorSource

logger = logging.getLogger(__name__)

SUPPORTED_METHODS = {
    "fp8": "float8_e4m3fn weights with weight_scale_inv per block, channel or tensor",
    "mxfp4": "gpt-oss's MXFP4 experts",
    "awq": "AutoAWQ's 4-bit GEMM packing",
    "gptq": "2, 4 or 8-bit GPTQ, v1 or v2 checkpoint format",
}
FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32),
                np.dtype(np.float64))


class QuantizationError(ValueError):
    """A quantization method or quantized tensor this loader does not decode."""


def supported_methods() -> str:
    named = [f"{method!r} ({what})" for method, what in SUPPORTED_METHODS.items()]
    return ", ".join(named[:-1]) + " and " + named[-1]


def check_quantization_config(hf_config: dict) -> str | None:
    """The quantization method of a Hugging Face config as a dict: None (unquantized), "fp8",
    "awq", "gptq" or "mxfp4". Any other method, or a field of these that we do not decode,
    raises one line."""
    quant = hf_config.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, dict):
        raise QuantizationError(f"quantization_config must be a JSON object, got {type(quant).__name__}")
    method = quant.get("quant_method")
    method = getattr(method, "value", method)  # transformers' QuantizationMethod enum, as a str
    if quant.get("load_in_4bit") or quant.get("load_in_8bit"):  # bitsandbytes' older configs
        method = "bitsandbytes"
    for key in ("modules_to_not_convert", "ignored_layers"):  # MiniMax's name for the first
        skip = quant.get(key)
        if skip is not None and not (isinstance(skip, list) and all(isinstance(s, str) for s in skip)):
            raise QuantizationError(f"quantization_config.{key} must be a list of module names, "
                                    f"got {skip!r}")
    if method == "fp8":
        check_fp8_config(quant)
        return "fp8"
    if method == "awq":
        check_awq_config(quant)
        return "awq"
    if method == "gptq":
        check_gptq_config(quant)
        return "gptq"
    if method == "mxfp4":
        _check_mxfp4_config(quant, hf_config.get("model_type"))
        return "mxfp4"
    what = "with no quant_method" if method is None else f"quant_method {method!r}"
    raise QuantizationError(f"quantization_config {what} is not supported; xlaserve loads "
                            f"{supported_methods()}")


def dequantizing_source(source: TensorSource, hf_config: dict, dtype) -> TensorSource:
    """`source` as the conversion reads it: FP8, AWQ and GPTQ weights dequantized into `dtype`
    (MXFP4 experts are decoded by the conversion itself), else as stored."""
    method = check_quantization_config(hf_config)
    if method in ("awq", "gptq"):
        packed = PackedIntSource(source, method, hf_config["quantization_config"], dtype)
        log_dequantizing(method, packed.bits, dtype)
        return packed
    if method != "fp8":
        return source
    quant = hf_config["quantization_config"]
    block_size = check_fp8_config(quant)
    logger.info("FP8 checkpoint (%s): weights dequantized to %s at load%s",
                "per-channel or per-tensor scales" if block_size is None else
                f"{block_size[0]}x{block_size[1]} blocks", np.dtype(dtype).name,
                "; its static activation scales are not applied"
                if str(quant.get("activation_scheme", "dynamic")).lower() == "static" else "")
    return Fp8Source(source, block_size, dtype)


def check_float_tensor(name: str, array: np.ndarray) -> np.ndarray:
    """`array` if it holds float values; a quantized or integer tensor is refused, not cast."""
    if array.dtype not in FLOAT_DTYPES:
        raise QuantizationError(
            f"tensor {name!r} is stored as {array.dtype.name}, not float: a quantized weight needs "
            f"the quantization_config of a method that decodes it ({supported_methods()})")
    return array


def _check_mxfp4_config(quant: dict, model_type) -> None:
    """`modules_to_not_convert` (the real checkpoints list attention, router, embeddings and
    lm_head) only tells transformers which GptOssMLP modules to swap for its Triton MXFP4 module;
    when it dequantizes at load, as it does on CPU and as we do everywhere, the tensors in the
    file decide: `<name>_blocks` + `<name>_scales` are decoded, a plain `<name>` is read as is
    (weights.expert_matrix). So the list is checked for form only, as for fp8."""
    if model_type != "gpt_oss":
        raise QuantizationError(f"mxfp4 quantization is defined for gpt_oss expert weights only, "
                                f"not model_type {model_type!r}")
