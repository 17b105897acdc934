"""`--quantization int8` (model/weight_types/int8.py): per-output-channel symmetric int8 weights
quantized at load, multiplied by XLA's dots; against float64 references and transformers running the
same int8-dequantized weights."""
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from tests.hf_reference import hf_greedy
from tests.weights.fp8_writer import write_dequantized_checkpoint, write_fp8_checkpoint
from tests.model.test_transformer_matches_transformers import (NEW_TOKENS, PROMPTS, TOLERANCE,
                                                               _hf_reference, _run_ours)
from tests.tiny_models import make_tiny_checkpoint
from xlaserve.runtime.executor.kernels import kernels_for
from xlaserve.model.weight_types.int8 import Int8Matrix, dequantize, quantize
from xlaserve.model.layers import Kernels, linear
from xlaserve.weights.loader import load_model
from xlaserve.model.weight_types.packed import PackedMatrix, pack_model
from xlaserve.model.weight_types.quantized_rows import QuantizedLinear, native_gemm_available

# The Hugging Face weights --quantization int8 quantizes: every attention and dense MLP projection
# (a shared expert's too), not the experts of a mixture of experts.
QUANTIZED = re.compile(r"^(?!.*\.experts\.).*\.(q|k|v|o|gate|up|down)_proj\.weight$")


def quantize_reference(weight: np.ndarray, contracted: int) -> tuple[np.ndarray, np.ndarray]:
    """(int values, scales) in float64: scale = max |w| / 127 per output column (the axes after
    the first `contracted`), values = w / scale rounded to nearest; a zero column: scale 0."""
    w = weight.astype(np.float64)
    scales = np.abs(w).max(axis=tuple(range(contracted))) / 127
    return np.rint(w / np.where(scales > 0, scales, 1.0)), scales


def _weight(shape, seed=0, zero_column=True):
    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    if zero_column:
        w.reshape(-1, w.shape[-1])[:, 3] = 0.0  # one output column of zeros
    return w


@pytest.mark.parametrize("shape,contracted", [((96, 40), 1), ((4, 16, 40), 2), ((64, 2, 24), 1)])
def test_quantize_is_the_float64_per_channel_symmetric_reference(shape, contracted):
    w = _weight(shape)
    ours = quantize(jnp.asarray(w), contracted, jnp.float32)
    values, scales = np.asarray(ours.values), np.asarray(ours.scales)
    assert values.dtype == np.int8 and scales.dtype == np.float32
    assert values.shape == shape and scales.shape == shape[contracted:]
    expected_values, expected_scales = quantize_reference(w, contracted)
    np.testing.assert_allclose(scales, expected_scales, rtol=1e-7, atol=0)
    # The float32 quotient may round the other way only next to a half-integer.
    quotient = w.astype(np.float64) / np.where(scales > 0, scales, 1.0).astype(np.float64)
    near_half = np.abs(np.abs(quotient - np.floor(quotient)) - 0.5) < 1e-4
    assert np.abs(values - expected_values).max() <= 1
    np.testing.assert_array_equal(values[~near_half], expected_values[~near_half])
    assert np.abs(values).max() == 127  # every nonzero column reaches +-127
    zero = (slice(None),) * (len(shape) - 1) + (3,)
    assert not values.reshape(-1, shape[-1])[:, 3].any() and scales.reshape(-1)[3] == 0
    # Dequantized: within half a step of each column's scale.
    error = np.abs(np.asarray(dequantize(ours)) - w)
    assert (error <= 0.5 * scales * (1 + 1e-6) + 1e-12).all()
    assert not np.asarray(dequantize(ours))[zero].any()


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_linear_with_int8_weights_is_the_float64_matmul_of_the_dequantized_weights(compute_dtype):
    """x @ (values * scales) with float32 accumulation: the float64 product of the same inputs
    (x rounded to the compute dtype, as linear does) within float32 accumulation error."""
    k, out = 256, (3, 40)
    weight = quantize(jnp.asarray(_weight((k, *out), seed=1)), 1, compute_dtype)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((7, k)), jnp.float32)
    y = linear(x, weight, Kernels(attention=None))
    assert y.dtype == jnp.float32 and y.shape == (7, *out)
    x64 = np.asarray(x.astype(compute_dtype).astype(jnp.float32), np.float64)
    w64 = np.asarray(weight.values, np.float64) * np.asarray(weight.scales, np.float64)
    expected = (x64 @ w64.reshape(k, -1)).reshape(7, *out)
    bound = 1e-6 * (np.abs(x64) @ np.abs(w64.reshape(k, -1))).reshape(7, *out)
    assert (np.abs(np.asarray(y, np.float64) - expected) <= bound + 1e-12).all()


def _int8_checkpoint(tmp_path_factory, family, seed: int = 0):
    """(float32 tiny model of `family`, the same with its quantized projections int8-dequantized
    by the float64 reference, transformers running the dequantized one)."""
    import transformers

    plain, dequantized = (str(tmp_path_factory.mktemp(f"{family}_{kind}"))
                          for kind in ("plain", "dequantized"))
    hf_model = make_tiny_checkpoint(plain, family, seed=seed)
    weights = {}
    for name, value in hf_model.state_dict().items():
        if QUANTIZED.search(name):  # [out, in]: the output channel is the row
            values, scales = quantize_reference(value.numpy().T, 1)
            weights[name] = np.ascontiguousarray((values * scales).T.astype(np.float32))
    write_dequantized_checkpoint(plain, dequantized, weights)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        dequantized, dtype=torch.float32, attn_implementation="eager").eval()
    return plain, dequantized, reference


@pytest.fixture(scope="module")
def int8_llama(tmp_path_factory):
    return _int8_checkpoint(tmp_path_factory, "llama")


def test_mixture_of_experts_keeps_its_experts_and_quantizes_its_shared_expert(tmp_path_factory):
    """Qwen2-MoE (a shared expert, a dense second layer): transformers' logits on the reference's
    weights, the experts' own float weights and the rest int8-dequantized."""
    plain, _, reference = _int8_checkpoint(tmp_path_factory, "qwen2_moe")
    loaded = load_model(plain, dtype="float32", skip_tokenizer_init=True, progress=False,
                        quantization="int8")
    moe, dense = loaded.model.layers[0].mlp, loaded.model.layers[1].mlp
    assert isinstance(moe.shared_expert.gate_up.get_value(), Int8Matrix)
    assert isinstance(dense.down.get_value(), Int8Matrix)
    assert moe.experts_gate_up.get_value().dtype == jnp.float32
    _assert_gives_reference_logits(loaded, reference)


@pytest.mark.parametrize("family", ["gemma4_ple", "gemma4_moe", "llama4"])
def test_this_years_families_give_transformers_logits_on_int8_dequantized_weights(
        tmp_path_factory, family):
    """Gemma 4's KV-shared layers' query-only projection, its full layers' wider heads, its MoE
    block beside the MLP (experts kept float), Llama 4's reordered q/k rows (each row its own
    scale, so the reorder commutes): transformers' logits on the int8-dequantized weights."""
    # gemma4_ple's seed 0 has one of the 16384 weights of a double-wide up_proj whose w / scale
    # lands within float32's rounding of a half step: quantized in float32 (ours) and float64
    # (the reference) it differs by one step, and the logits by 3e-4. Seed 1 has no such tie.
    plain, _, reference = _int8_checkpoint(tmp_path_factory, family,
                                           seed=1 if family == "gemma4_ple" else 0)
    loaded = load_model(plain, dtype="float32", skip_tokenizer_init=True, progress=False,
                        quantization="int8")
    assert all(isinstance(layer.attn.qkv.get_value(), Int8Matrix)
               for layer in loaded.model.layers)
    _assert_gives_reference_logits(loaded, reference)


@pytest.mark.parametrize("layout", ["xla", "packed"])
def test_int8_llama_gives_transformers_logits_on_the_int8_dequantized_weights(int8_llama, layout):
    """Quantized at load from the float checkpoint: transformers' logits (1e-4) and greedy tokens
    on the reference's dequantized weights. `packed`: the CPU runner's packing gives the int8
    weights to the native quantized GEMM as "i8_row" rows (the LM head is packed in float)."""
    plain, _, reference = int8_llama
    loaded = load_model(plain, dtype="float32", skip_tokenizer_init=True, progress=False,
                        quantization="int8")
    layer = loaded.model.layers[0]
    for weight in (layer.attn.qkv, layer.attn.o_proj, layer.mlp.gate_up, layer.mlp.down):
        assert isinstance(weight.get_value(), Int8Matrix)
    assert loaded.model.embedding.get_value().dtype == jnp.float32  # and the LM head stays float
    if layout == "packed":
        if kernels_for().packed_matmul is None:  # what the server's runner asks
            pytest.skip("the native CPU GEMM does not build here")
        if not native_gemm_available():
            pytest.skip("the native quantized GEMM does not build here")
        pack_model(loaded.model, loaded.config.tie_word_embeddings, int8_as_rows=True)
        assert isinstance(loaded.model.lm_head.get_value(), PackedMatrix)
        down = [layer.mlp.down.get_value() for layer in loaded.model.layers]
        assert all(isinstance(d, QuantizedLinear) and d.formats == ("i8_row",) for d in down)
        assert down[0].parts[0].rows is down[1].parts[0].rows  # one stack for every layer
    _assert_gives_reference_logits(loaded, reference)


def test_int8_rows_with_q8_activations_are_interleaved_and_near_the_float32_logits(int8_llama):
    """--quantized-activations q8 (the server's default): the runner's int8 rows are interleaved
    for the Q8 GEMM (W8A8, numerics in tests/kernels/test_cpu_q8_gemm.py) and the logits differ
    from float32 x's by the rounding of x alone."""
    if kernels_for().packed_matmul is None or not native_gemm_available():
        pytest.skip("the native CPU GEMMs do not build here")
    plain, _, _ = int8_llama
    logits = {}
    for activations in ("q8", "float32"):
        loaded = load_model(plain, dtype="float32", skip_tokenizer_init=True, progress=False,
                            quantization="int8")
        pack_model(loaded.model, loaded.config.tie_word_embeddings, int8_as_rows=True,
                   int8_activations=activations)
        down = loaded.model.layers[0].mlp.down.get_value()
        assert down.formats == ("i8_rowx8" if activations == "q8" else "i8_row",)
        assert down.parts[0].activations == activations
        logits[activations] = _run_ours(loaded, [(PROMPTS[0], len(PROMPTS[0]))], 3, 4)[0]
    error = np.abs(logits["q8"] - logits["float32"]).max()
    assert 0 < error <= 0.05 * np.abs(logits["float32"]).max()


def _assert_gives_reference_logits(loaded, reference):
    references = [_hf_reference(reference, prompt) for prompt in PROMPTS[:3]]
    sequences = [(full, len(p)) for p, (full, _) in zip(PROMPTS, references)]
    for (full, expected), got in zip(references, _run_ours(loaded, sequences, 3, 4), strict=True):
        np.testing.assert_allclose(got, expected, atol=TOLERANCE, rtol=0)
        prompt_len = len(full) - NEW_TOKENS
        assert got[prompt_len - 1:-1].argmax(-1).tolist() == full[prompt_len:]


def test_engine_with_quantization_int8_generates_transformers_greedy_tokens(int8_llama, caplog):
    """The flag end to end: ServerArgs -> start-up -> load_model, on the CPU's runner (which gives
    the int8 weights to the native quantized GEMM and says so)."""
    from xlaserve import Engine

    plain, _, reference = int8_llama
    prompts = [[5, 17, 300, 42, 9, 77, 120, 3, 250, 11, 64], [400, 401, 402, 403], [99]]
    with caplog.at_level(logging.INFO), Engine(
            plain, dtype="float32", quantization="int8", skip_tokenizer_init=True, page_size=4,
            max_running_requests=4, context_length=64, max_total_tokens=256,
            precompile_token_paddings="16", random_seed=0) as engine:
        outputs = engine.generate(input_ids=prompts, sampling_params={
            "max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output["output_ids"] == hf_greedy(reference, prompt, 6)
    assert "Quantized the attention and MLP weights to int8" in caplog.text
    if engine.core.runner.kernels.packed_matmul is not None and native_gemm_available():
        assert "int8 weights are multiplied by the native quantized CPU GEMM" in caplog.text


def test_dummy_weights_with_int8_are_the_float_dummy_weights_quantized(int8_llama):
    plain, _, _ = int8_llama
    floats = load_model(plain, dtype="float32", load_format="dummy", skip_tokenizer_init=True)
    ints = load_model(plain, dtype="float32", load_format="dummy", skip_tokenizer_init=True,
                      quantization="int8")
    got = ints.model.layers[1].attn.o_proj.get_value()
    expected = quantize(floats.model.layers[1].attn.o_proj.get_value(), 2, jnp.float32)
    np.testing.assert_array_equal(np.asarray(got.values), np.asarray(expected.values))
    np.testing.assert_array_equal(np.asarray(got.scales), np.asarray(expected.scales))


def _one_line_error(call) -> str:
    with pytest.raises(ValueError) as error:
        call()
    message = str(error.value)
    assert "\n" not in message
    return message


def test_int8_of_an_already_quantized_checkpoint_or_unknown_scheme_is_refused_in_one_line(
        int8_llama, tmp_path):
    plain, _, _ = int8_llama
    fp8 = str(tmp_path / "fp8")
    write_fp8_checkpoint(plain, fp8, lambda name: "channel",
                         {"quant_method": "fp8", "weight_block_size": None})
    message = _one_line_error(lambda: load_model(fp8, skip_tokenizer_init=True, progress=False,
                                                 quantization="int8"))
    assert "--quantization int8 needs a float checkpoint" in message and "(fp8)" in message
    message = _one_line_error(lambda: load_model(None, skip_tokenizer_init=True,
                                                 quantization="int8"))
    assert "already quantized (GGUF)" in message
    message = _one_line_error(lambda: load_model(plain, skip_tokenizer_init=True,
                                                 quantization="int4"))
    assert "unknown quantization 'int4'" in message


def test_an_xlaserve_checkpoint_is_quantized_as_the_safetensors_it_came_from(int8_llama, tmp_path):
    from xlaserve.weights import checkpoint

    plain, _, _ = int8_llama
    floats = load_model(plain, dtype="float32", skip_tokenizer_init=True, progress=False)
    checkpoint.save(str(tmp_path / "ckpt"), floats.config, floats.model)
    restored = load_model(str(tmp_path / "ckpt"), dtype="float32", skip_tokenizer_init=True,
                          quantization="int8")
    direct = load_model(plain, dtype="float32", skip_tokenizer_init=True, progress=False,
                        quantization="int8")
    for ours, theirs in zip(jax.tree.leaves(nnx.state(restored.model)),
                            jax.tree.leaves(nnx.state(direct.model)), strict=True):
        assert ours.dtype == theirs.dtype
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    assert isinstance(restored.model.layers[0].attn.o_proj.get_value(), Int8Matrix)
