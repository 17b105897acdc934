"""GGUF weights kept in their quantized blocks on a single CPU device
(weights/kept_quantized/gguf_kept.py): each kept type gives the dequantized model's logits, a
Q4_K_M-like file of mixed types (Q6_K attn_v, ffn_down and output beside Q4_K) keeps every matrix in
its own format and matches transformers, a type the GEMM does not take is dequantized with a log
line, the model holds the file's bytes, and the conversion cache keeps the other parameters only."""
import logging
import os

import gguf
import jax
import numpy as np
import pytest
from flax import nnx

from xlaserve.weights.conversion_cache import ConversionCache
from xlaserve.weights.loader import load_model
from xlaserve.model.weight_types.quantized_rows import (QuantizedLinear, dequantized,
                                                        native_gemm_available)

from .gguf_writer import write_llama_gguf
from .test_gguf_loading import _logits_of, _our_logits, _tiny_llama, _transformers_logits

Q = gguf.GGMLQuantizationType
pytestmark = pytest.mark.skipif(not native_gemm_available(),
                                reason="the native quantized GEMM does not build here")
K_QUANTS = (Q.Q4_K, Q.Q6_K)


def _weights(loaded) -> dict:
    return {path: variable.get_value()
            for path, variable in nnx.to_flat_state(nnx.state(loaded.model))}


def _load(path, **options):
    return load_model(path, dtype="float32", skip_tokenizer_init=True, progress=False,
                      conversion_cache=False, **options)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q6_K],
                         ids=lambda q: q.name)
def test_kept_weights_give_the_dequantized_models_logits(tmp_path, qtype):
    hidden = 256 if qtype in K_QUANTS else 64
    path = str(tmp_path / f"tiny-{qtype.name}.gguf")
    write_llama_gguf(path, _tiny_llama(hidden), qtype)
    kept = _load(path)
    weights = _weights(kept)
    for name in (("layers", 0, "attn", "qkv"), ("layers", 1, "mlp", "down"), ("embedding",),
                 ("lm_head",)):
        assert isinstance(weights[name], QuantizedLinear), name
        assert weights[name].formats == (qtype.name.lower(),)
    floats = _load(path, matmul_backend="xla")
    assert not any(isinstance(w, QuantizedLinear) for w in _weights(floats).values())
    _assert_same_weights(weights, _weights(floats))
    np.testing.assert_allclose(_logits_of(kept), _logits_of(floats), atol=1e-4, rtol=0)


def _assert_same_weights(kept: dict, floats: dict) -> None:
    """Every kept weight stands for the dequantized load's array, exactly (fusion, q/k rows)."""
    for name, weight in kept.items():
        if isinstance(weight, QuantizedLinear):
            np.testing.assert_array_equal(dequantized(weight), np.asarray(floats[name]),
                                          err_msg=str(name))


def test_a_q4_k_m_like_file_keeps_each_matrix_in_its_format_and_matches_transformers(tmp_path):
    path = str(tmp_path / "tiny-Q4_K_M.gguf")
    six = {"blk.0.attn_v.weight": Q.Q6_K, "blk.0.ffn_down.weight": Q.Q6_K,
           "output.weight": Q.Q6_K}
    write_llama_gguf(path, _tiny_llama(256), Q.Q4_K, tensor_types=six)
    weights = _weights(_load(path))
    _assert_same_weights(weights, _weights(_load(path, matmul_backend="xla")))
    assert weights[("layers", 0, "attn", "qkv")].formats == ("q4_k", "q4_k", "q6_k")
    assert weights[("layers", 1, "attn", "qkv")].formats == ("q4_k",)  # fused
    assert weights[("layers", 0, "mlp", "down")].formats == ("q6_k",)
    assert weights[("layers", 1, "mlp", "down")].formats == ("q4_k",)
    assert weights[("lm_head",)].formats == ("q6_k",)
    # The layers' matrices of one kind and format are one stack: the q4_k gate_up of both layers
    gate_up = [weights[("layers", i, "mlp", "gate_up")].parts[0] for i in range(2)]
    assert gate_up[0].rows is gate_up[1].rows and (gate_up[0].layer, gate_up[1].layer) == (0, 1)
    np.testing.assert_allclose(_our_logits(path, conversion_cache=False),
                               _transformers_logits(path), atol=1e-4, rtol=0)


def test_a_type_the_gemm_does_not_take_is_dequantized_and_named(tmp_path, caplog):
    path = str(tmp_path / "tiny-mixed.gguf")
    write_llama_gguf(path, _tiny_llama(64), Q.Q8_0, tensor_types={"blk.1.ffn_up.weight": Q.F16})
    with caplog.at_level(logging.INFO, logger="xlaserve.weights.kept_quantized.gguf_kept"):
        loaded = _load(path)
    assert "model.layers.1.mlp.up_proj.weight (F16)" in caplog.text
    weights = _weights(loaded)
    assert not isinstance(weights[("layers", 1, "mlp", "gate_up")], QuantizedLinear)
    assert isinstance(weights[("layers", 0, "mlp", "gate_up")], QuantizedLinear)
    np.testing.assert_allclose(_logits_of(loaded), _transformers_logits(path), atol=1e-4, rtol=0)


def test_the_kept_model_holds_the_files_bytes(tmp_path):
    path = str(tmp_path / "tiny-Q4_0.gguf")
    write_llama_gguf(path, _tiny_llama(64), Q.Q4_0)
    leaves = jax.tree.leaves(nnx.state(_load(path).model))
    model_bytes = sum(leaf.nbytes for leaf in {id(x): x for x in leaves}.values())
    reader = gguf.GGUFReader(path)
    file_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    # the matrices as stored; the norms in float32 as stored too
    assert model_bytes == file_bytes


def test_the_conversion_cache_keeps_the_other_parameters_only(tmp_path):
    path = str(tmp_path / "tiny-Q8_0.gguf")
    write_llama_gguf(path, _tiny_llama(64), Q.Q8_0)
    root = str(tmp_path / "cache")
    first = load_model(path, dtype="float32", skip_tokenizer_init=True, progress=False,
                       conversion_cache_dir=root)
    entry = ConversionCache(root).lookup(path, "float32", "gguf-kept")
    assert entry is not None and ConversionCache(root).lookup(path, "float32") is None
    cached = {path for path, _ in entry.tensors()}
    assert ("layers", 0, "input_norm", "scale") in cached
    assert ("layers", 0, "attn", "qkv") not in cached
    assert os.path.getsize(os.path.join(entry.directory, "params.safetensors")) < 64 * 1024
    second = load_model(path, dtype="float32", skip_tokenizer_init=True, progress=False,
                        conversion_cache_dir=root)
    assert isinstance(_weights(second)[("layers", 0, "attn", "qkv")], QuantizedLinear)
    np.testing.assert_array_equal(_logits_of(first), _logits_of(second))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q6_K],
                         ids=lambda q: q.name)
def test_q8_activations_interleave_the_blocks_of_32_and_stay_near_the_exact_logits(tmp_path,
                                                                                  qtype):
    """--quantized-activations q8: every kept matrix multiplies x quantized per block (the Q8 GEMM,
    whose numerics tests/kernels/test_cpu_q8_gemm.py checks against ggml's); the formats of
    blocks of 32 are interleaved (x8), the K-quants kept as the file has them; the weights still
    stand for the dequantized ones exactly, and the logits differ from the exact float32 ones
    by 8-bit rounding of the inputs only."""
    hidden = 256 if qtype in K_QUANTS else 64
    path = str(tmp_path / f"tiny-{qtype.name}.gguf")
    write_llama_gguf(path, _tiny_llama(hidden), qtype)
    q8 = _load(path, quantized_activations="q8")
    weights = _weights(q8)
    layout = qtype.name.lower() + ("" if qtype in K_QUANTS else "x8")
    for name in (("layers", 0, "attn", "qkv"), ("layers", 1, "mlp", "down"), ("embedding",),
                 ("lm_head",)):
        assert weights[name].formats == (layout,), name
        assert all(part.activations == "q8" for part in weights[name].parts)
    _assert_same_weights(weights, _weights(_load(path, matmul_backend="xla")))
    exact = _logits_of(_load(path, quantized_activations="float32"))
    error = np.abs(_logits_of(q8) - exact).max()
    assert 0 < error <= 0.05 * np.abs(exact).max()  # measured 0.1% (Q4_K) to 3.7% (Q6_K)


def test_a_q8_engine_gives_each_prompt_its_solo_tokens_in_any_batch(tmp_path):
    """x is quantized row by row and each output summed in one order whatever the rows beside it:
    requests batched together decode what each decodes alone (the default q8 activations)."""
    from xlaserve.offline import Engine

    path = str(tmp_path / "tiny-Q4_1.gguf")
    write_llama_gguf(path, _tiny_llama(64), Q.Q4_1)
    prompts = [[1, 5, 9, 200, 31], [7] * 11, [300, 2, 4, 8, 16, 32, 64, 128, 256, 3]]
    greedy = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    with Engine(path, skip_tokenizer_init=True, max_running_requests=4,
                precompile_token_paddings="8,32", chunked_prefill_size=32,
                max_total_tokens=256, context_length=64,
                log_level="warning") as engine:
        batched = engine.generate(input_ids=prompts, sampling_params=greedy)
        for prompt, together in zip(prompts, batched, strict=True):
            alone = engine.generate(input_ids=prompt, sampling_params=greedy)
            assert together["output_ids"] == alone["output_ids"]
