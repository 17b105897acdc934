"""--quantization mxfp4: gpt-oss's MXFP4 experts kept as stored
(weights/kept_quantized/mxfp4_kept.py), multiplied by the GPU's kernel that decodes them
(interpreted here), against the experts decoded at load."""
import dataclasses
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tests.compile_targets import devices, first_layers
from xlaserve.model.weight_types.mxfp4_experts import Mxfp4Experts, mxfp4_mesh_problem
from xlaserve.weights import loader
from xlaserve.weights.kept_quantized import mxfp4_kept
from xlaserve.weights.formats.mxfp4 import Mxfp4Error, decode_mxfp4
from xlaserve.weights.param_layout import SafetensorsSource, convert
from xlaserve.weights.formats.quantization import dequantizing_source


def test_kept_experts_are_the_files_bytes_in_our_gate_up_order(tiny_gpt_oss):
    tiny_gpt_oss, _ = tiny_gpt_oss
    # Decoded, each kept weight is the parameter the loader decodes at load: gate's rows (the
    # file's even rows) then up's (its odd ones), down as stored.
    config, _ = loader.read_config(tiny_gpt_oss)
    source = SafetensorsSource(tiny_gpt_oss)
    decoded = dict(convert(config, dequantizing_source(source, {}, jnp.bfloat16)))
    kept = dict(mxfp4_kept.kept_experts(config, source))
    assert set(kept) == mxfp4_kept.kept_paths(config) and len(kept) == 2 * config.num_layers
    for path, experts in kept.items():
        assert isinstance(experts, Mxfp4Experts) and experts.blocks.dtype == np.uint8
        assert experts.shape == decoded[path].shape
        blocks, scales = experts.flat()
        got = decode_mxfp4(blocks, scales, np.float32).reshape(decoded[path].shape)
        np.testing.assert_array_equal(got, np.asarray(decoded[path], np.float32))
    remaining = dict(convert(config, dequantizing_source(source, {}, jnp.bfloat16),
                             skip=mxfp4_kept.kept_paths(config)))
    assert set(decoded) - set(remaining) == mxfp4_kept.kept_paths(config)


def test_a_model_with_kept_experts_gives_the_decoded_models_logits(tiny_gpt_oss, monkeypatch):
    # The whole model (sinks, sliding window, biases, clamped SwiGLU) with its experts in MXFP4,
    # the kernel interpreted on this CPU (the platform check lifted for it), against the model
    # whose experts were decoded at load; x goes into the kernel in bfloat16, hence the
    # tolerance. Swapping gate and up, or reading a layer's experts into another, is far off.
    from tests.model.test_transformer_matches_transformers import PROMPTS, _run_ours
    from xlaserve.model.weight_types import int8

    tiny_gpt_oss, _ = tiny_gpt_oss
    monkeypatch.setattr(int8, "check_platform", lambda *args: None)
    decoded = loader.load_model(tiny_gpt_oss, dtype="float32", skip_tokenizer_init=True,
                                progress=False)
    config, mesh = decoded.config, decoded.mesh
    _, _, hf_config = loader._read_config(tiny_gpt_oss, config_file_allowed=False)
    model = loader._load_safetensors(tiny_gpt_oss, loader._named_source(tiny_gpt_oss), config,
                                     hf_config, dtype=jnp.float32, mesh=mesh, progress=False,
                                     quantization="mxfp4")
    kept = dataclasses.replace(decoded, model=model)
    assert mxfp4_kept.kept_bytes(model) == sum(
        e.blocks.nbytes + e.scales.nbytes
        for _, e in mxfp4_kept.kept_experts(config, SafetensorsSource(tiny_gpt_oss)))
    sequences = [(prompt, len(prompt) - 3) for prompt in PROMPTS[:3]]
    want = _run_ours(decoded, sequences, 4, 4)
    got = _run_ours(kept, sequences, 4, 4, mxfp4_interpreted=True)
    for g, w in zip(got, want, strict=True):
        scale = float(np.max(np.abs(w)))
        np.testing.assert_allclose(g, w, rtol=0, atol=2e-2 * scale)


def test_mxfp4_is_refused_in_one_line_where_it_cannot_keep_the_experts(tiny_gpt_oss, tmp_path,
                                                                        monkeypatch):
    tiny_gpt_oss, float_model = tiny_gpt_oss
    with pytest.raises(ValueError, match="^--quantization mxfp4 keeps MXFP4 experts for the "
                                         "NVIDIA GPU kernel; this is cpu"):
        loader.load_model(tiny_gpt_oss, quantization="mxfp4", skip_tokenizer_init=True)
    monkeypatch.setattr(loader, "check_platform", lambda *args: None)
    llama = first_layers("llama-3.1-8b", 1, tmp_path)
    with pytest.raises(ValueError, match="keeps gpt-oss's MXFP4 experts; this config is "
                                         "LlamaForCausalLM"):
        loader.load_model(llama, load_format="dummy", quantization="mxfp4",
                          skip_tokenizer_init=True)
    # Past the loader's first check, the abstract parameters refuse a CPU mesh too.
    with pytest.raises(ValueError, match="keeps MXFP4 experts for the NVIDIA GPU kernel; this is "
                                         "cpu"):
        loader.load_model(tiny_gpt_oss, quantization="mxfp4", skip_tokenizer_init=True)
    # A float gpt-oss checkpoint has no MXFP4 experts to keep.
    monkeypatch.setattr(mxfp4_kept, "check_model", lambda *args: None)
    floats = tmp_path / "float"
    float_model.save_pretrained(str(floats))  # its experts as float tensors
    with pytest.raises(ValueError, match="keeps a gpt-oss checkpoint's MXFP4 experts; .* has "
                                         "none \\(float weights\\)"):
        loader.load_model(str(floats), quantization="mxfp4", skip_tokenizer_init=True)


@pytest.mark.parametrize("byte", [0, 1, 253, 255])
def test_scales_the_kernel_would_not_decode_exactly_are_refused(tiny_gpt_oss, tmp_path, byte):
    tiny_gpt_oss, _ = tiny_gpt_oss
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((Path(tiny_gpt_oss) / name).read_bytes())
    tensors = load_file(str(tmp_path / "model.safetensors"))
    scales = "model.layers.1.mlp.experts.down_proj_scales"
    tensors[scales] = tensors[scales].copy()
    tensors[scales][0, 0, 0] = byte
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config, _ = loader.read_config(str(tmp_path))
    with pytest.raises(Mxfp4Error, match=re.escape(f"{scales[:-len('_scales')]}: MXFP4 scale "
                                                   f"byte {byte} (2**{byte - 127})")):
        list(mxfp4_kept.kept_experts(config, SafetensorsSource(str(tmp_path))))


def test_the_mesh_must_hold_whole_k_steps_of_both_experts():
    # gpt-oss's hidden 2880 and intermediate 2880: at tensor parallel size 2 each device's down
    # takes 1440 input features, not a multiple of the kernel's 64-wide K steps.
    from jax.sharding import Mesh

    _, found = devices("h100x8")

    one = Mesh(np.array(found[:1]).reshape(1, 1, 1), ("data", "expert", "tensor"))
    two = Mesh(np.array(found[:2]).reshape(1, 1, 2), ("data", "expert", "tensor"))
    experts = Mesh(np.array(found[:2]).reshape(1, 2, 1), ("data", "expert", "tensor"))
    assert mxfp4_mesh_problem(2880, 2880, one) is None
    assert mxfp4_mesh_problem(2880, 2880, experts) is None
    assert "down at tensor parallel size 2" in mxfp4_mesh_problem(2880, 2880, two)


def test_a_gpt_oss_step_with_mxfp4_experts_compiles_for_an_h100(tmp_path):
    """The server's step of gpt-oss-20b (its first 2 layers) with the experts in MXFP4, through
    XLA's and Triton's compilers for a deviceless H100: two MXFP4 grouped matmuls a layer, no dot
    of XLA's over the experts, and a quarter of bfloat16's expert bytes in the arguments."""
    from benchmarks.predict_accelerators import server_args
    from tests.compile_targets import weight_bytes
    from xlaserve.runtime.executor import aot
    from xlaserve.runtime.sampling.step_needs import PLAIN

    devices("h100")  # skips where the CUDA plugin is absent
    programs = {}
    for quantization in (None, "mxfp4"):
        args = dataclasses.replace(server_args("gpt-oss-20b", tp=1, quantization=quantization),
                                   model_path=first_layers("gpt-oss-20b", 2, tmp_path))
        programs[quantization] = aot.server_step("h100", args)
    program, shapes, _ = programs["mxfp4"]
    tokens, seqs, pages = next(shape for shape in shapes if shape[0] == 256)
    hlo = program.compile(tokens, seqs, pages, PLAIN).as_text()
    assert len(re.findall(r'name = "grouped_matmul_mxfp4_m\d+"', hlo)) == 4, hlo[-2000:]
    experts = 2 * 32 * 2880 * (2 * 2880 + 2880)  # 2 layers x E x K x (gate_up + down) weights
    saved = weight_bytes(programs[None][0]) - weight_bytes(program)
    assert saved == experts * 2 - experts * (1 + 1 / 16) // 2  # bfloat16 -> codes and scales
