"""FP8 checkpoints kept in FP8 (weights/kept_quantized/fp8_kept.py): the kept projections are
exactly the file's FP8 values and scales in our layout (their dequantization is formats/fp8.py's,
bit for bit), everything else is what the dequantizing load gives; when they are kept (a GPU with
FP8 matmuls, checked on compile-only H100 devices) and when not; and a tiny model served from them
on the CPU (the FP8 dots exact in XLA's CPU backend, the block kernel in Pallas interpret mode)
gives the dequantized model's logits within the activations' FP8 rounding."""
import dataclasses
import functools
import logging
import types

import jax.numpy as jnp
import numpy as np
import pytest

from tests import greedy_driver
from tests.compile_targets import devices
from tests.weights.fp8_writer import write_fp8_checkpoint
from tests.tiny_models import make_tiny_checkpoint
from xlaserve.weights.formats.fp8 import Fp8Source
from xlaserve.weights.kept_quantized.fp8_kept import convert_kept, kept_quantization
from xlaserve.model.weight_types.fp8_weights import Fp8BlockMatrix, Fp8Matrix, dequantize
from xlaserve.model.weight_types.int8 import Fp8Checkpoint, abstract_quantized, quantizes
from xlaserve.weights.loader import default_mesh, load_model, read_config
from xlaserve.weights.placement import place_model
from xlaserve.model.registry import model_class
from xlaserve.model.sharding import serving_mesh
from xlaserve.model.transformer import abstract_parameters
from xlaserve.weights.param_layout import SafetensorsSource, convert
from xlaserve.pallas_kernels.fp8_block_matmul import block_fp8_matmul

BLOCK_32 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
PER_CHANNEL = {"quant_method": "fp8", "weight_block_size": None}
VARIANTS = {  # family, quantization_config, scheme per tensor, what the projections become
    "llama_32x32_blocks": ("llama", BLOCK_32, lambda name: (32, 32), Fp8Checkpoint(32)),
    # Qwen2-MoE: experts (dequantized), a shared expert and a dense layer (kept).
    "qwen2_moe_per_tensor_and_channel": (
        "qwen2_moe", PER_CHANNEL, lambda name: "tensor" if "self_attn" in name else "channel",
        Fp8Checkpoint(None)),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def fp8_checkpoint(request, tmp_path_factory):
    family, quant, schemes, kept = VARIANTS[request.param]
    plain, fp8 = (str(tmp_path_factory.mktemp(f"{request.param}_{k}")) for k in ("plain", "fp8"))
    make_tiny_checkpoint(plain, family)
    write_fp8_checkpoint(plain, fp8, schemes, quant)
    return fp8, quant, kept


def _expected(config, kept, mesh, dtype=jnp.float32):
    """The kept model's abstract parameters, without the loader's platform check (this CPU has
    no FP8 matmul, which is what these tests go around)."""
    graphdef, _, floats = abstract_parameters(config, dtype, mesh, model_class(config.architecture))
    return graphdef, {path: abstract_quantized(path, p, kept) if quantizes(path) else p
                      for path, p in floats.items()}


def test_kept_projections_are_the_files_fp8_values_and_dequantize_as_the_loader_does(fp8_checkpoint):
    fp8, quant, kept = fp8_checkpoint
    config, _ = read_config(fp8)
    _, expected = _expected(config, kept, default_mesh())
    block = None if kept.block_k is None else (32, 32)
    ours = dict(convert_kept(config, SafetensorsSource(fp8), quant, np.float32, expected))
    dequantized = dict(convert(config, Fp8Source(SafetensorsSource(fp8), block, np.float32)))
    assert ours.keys() == dequantized.keys()
    kinds = set()
    for path, value in ours.items():
        if quantizes(path):
            assert type(value) is type(expected[path]), path
            assert value.values.dtype == jnp.float8_e4m3fn and value.scales.dtype == np.float32
            assert value.shape == dequantized[path].shape
            value = np.asarray(dequantize(value))
            kinds.add(path[-1])
        else:
            assert isinstance(value, np.ndarray), path
        np.testing.assert_array_equal(np.asarray(value, np.float32), dequantized[path],
                                      err_msg=str(path))
    assert kinds == {"qkv", "o_proj", "gate_up", "down"}


@pytest.fixture(scope="module")
def h100_mesh():
    _, h100 = devices("h100")  # skips where the CUDA plugin is absent
    return serving_mesh(h100, 1)


def _kept(fp8, quant, mesh, names=None):
    config, _ = read_config(fp8)
    _, _, floats = abstract_parameters(config, jnp.bfloat16, mesh, model_class(config.architecture))
    source = SafetensorsSource(fp8)
    if names is not None:
        source = types.SimpleNamespace(names=lambda: names)
    return kept_quantization(quant, source, floats, mesh)


def test_an_fp8_checkpoint_is_kept_on_one_h100_in_the_layout_of_its_scales(fp8_checkpoint,
                                                                            h100_mesh):
    fp8, quant, kept = fp8_checkpoint
    assert _kept(fp8, quant, h100_mesh) == kept
    assert _kept(fp8, quant, default_mesh()) is None  # no FP8 matmul on this CPU


def test_what_is_not_kept_says_why_and_is_dequantized_at_load(fp8_checkpoint, h100_mesh, caplog):
    fp8, quant, kept = fp8_checkpoint
    names = SafetensorsSource(fp8).names()
    unquantized = next(n for n in sorted(names) if n.endswith("o_proj.weight"))
    with caplog.at_level(logging.INFO):
        assert _kept(fp8, quant, h100_mesh, names - {unquantized + "_scale_inv"}) is None
    assert f"projections stored unquantized: 1 (e.g. {unquantized})" in caplog.text
    if kept.block_k is None:
        return
    with caplog.at_level(logging.INFO):
        # 128-wide K blocks: the tiny model's hidden size (64) is no whole number of them.
        assert _kept(fp8, {**quant, "weight_block_size": [128, 128]}, h100_mesh) is None
        assert "cannot multiply layers/0/attn/o_proj: K = 64 is not a whole number" in caplog.text
        _, eight = devices("h100x8")
        assert _kept(fp8, quant, serving_mesh(eight, 2)) is None
        assert "runs on one device, not a mesh of 2" in caplog.text


def test_a_model_served_from_kept_fp8_weights_gives_the_dequantized_models_logits(
        fp8_checkpoint, monkeypatch):
    """The FP8 dots run on the CPU (exact); the block kernel in interpret mode. What differs from
    the dequantized model is the activations' FP8 rounding (up to 2^-4 of a value): measured
    3.1-4.0% of the largest logit, and 84-100% of the greedy tokens the same, on these random
    two-layer models; with the block kernel given other columns' scales, 28% and 64%."""
    from tests.model.test_transformer_matches_transformers import PROMPTS, _run_ours

    fp8, quant, kept = fp8_checkpoint
    dequantized = load_model(fp8, dtype="float32", skip_tokenizer_init=True, progress=False)
    config = dequantized.config
    abstract = _expected(config, kept, dequantized.mesh)
    model = place_model(config, convert_kept(config, SafetensorsSource(fp8), quant, np.float32,
                                             abstract[1]),
                        dtype=jnp.float32, mesh=dequantized.mesh, progress=False, abstract=abstract)
    assert isinstance(model.layers[1].mlp.down.get_value(),
                      Fp8BlockMatrix if kept.block_k else Fp8Matrix)
    kept_model = dataclasses.replace(dequantized, model=model)
    cpu_kernels = greedy_driver.kernels_for
    monkeypatch.setattr(greedy_driver, "kernels_for",
                        lambda *args, **kwargs: dataclasses.replace(
                            cpu_kernels(*args, **kwargs),
                            fp8_block_matmul=functools.partial(block_fp8_matmul, interpret=True)))
    sequences = [(prompt, len(prompt)) for prompt in PROMPTS[:3]]
    for ours, theirs in zip(_run_ours(kept_model, sequences, 64, 16),
                            _run_ours(dequantized, sequences, 64, 16), strict=True):
        assert np.abs(ours - theirs).max() < 0.06 * np.abs(theirs).max()
        assert (ours.argmax(-1) == theirs.argmax(-1)).mean() >= 0.75
