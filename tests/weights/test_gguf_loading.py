"""GGUF checkpoints: every supported quantization type, names, and llama.cpp's q/k permutation."""
import os

import gguf
import numpy as np
import pytest
import torch
import transformers

from tests.greedy_driver import PagedBatch, make_forward
from xlaserve.weights.loader import load_model
from xlaserve.runtime.executor.kv_pool import init_kv_pool

from .gguf_writer import write_llama_gguf


Q = gguf.GGMLQuantizationType
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43]


def _tiny_llama(hidden: int, **config_fields):
    config = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=2, vocab_size=512, rms_norm_eps=1e-6,
        rope_theta=10000.0, **config_fields)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = 0.5 if "embed" in name else 0.08
            param.copy_(1 + 0.2 * torch.randn_like(param) if "norm" in name else scale * torch.randn_like(param))
    return model


def _our_logits(path, **load_options):
    loaded = load_model(path, dtype="float32", skip_tokenizer_init=True, progress=False,
                        **load_options)
    return _logits_of(loaded)


def _logits_of(loaded):
    from flax import nnx

    batch = PagedBatch(1, 2, 16)
    kv_caches = init_kv_pool(loaded.config, batch.num_pages, 16, loaded.dtype, loaded.mesh)
    input_ids, positions, metadata, logits_indices, _ = batch.step_inputs([PROMPT], logits="all")
    logits, _ = make_forward(loaded.model)(nnx.split(loaded.model)[1], input_ids, positions,
                                           kv_caches, metadata, logits_indices)
    return np.asarray(logits)[:len(PROMPT)]


def _transformers_logits(path):
    directory, filename = os.path.split(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=filename, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0].numpy()


def test_f32_gguf_gives_the_original_models_logits(tmp_path):
    """Writing with llama.cpp's permutation and loading with ours undoes it exactly."""
    hf_model = _tiny_llama(64)
    path = str(tmp_path / "tiny-f32.gguf")
    write_llama_gguf(path, hf_model, Q.F32)
    with torch.no_grad():
        expected = hf_model(torch.tensor([PROMPT])).logits[0].numpy()
    np.testing.assert_allclose(_our_logits(path), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K],
                         ids=lambda q: q.name)
def test_quantized_gguf_logits_equal_transformers_gguf_loader(tmp_path, qtype):
    # K-quants pack 256 values per block, so their rows must be multiples of 256.
    hidden = 256 if qtype in (Q.Q4_K, Q.Q6_K) else 64
    path = str(tmp_path / f"tiny-{qtype.name}.gguf")
    write_llama_gguf(path, _tiny_llama(hidden), qtype)
    np.testing.assert_allclose(_our_logits(path), _transformers_logits(path), atol=1e-4, rtol=0)


@pytest.mark.parametrize("rope_scaling", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
    {"rope_type": "yarn", "factor": 4.0, "beta_fast": 0.2, "beta_slow": 0.02,  # pairs 1 to 4
     "original_max_position_embeddings": 8},
    {"rope_type": "linear", "factor": 2.0},
], ids=["yarn", "yarn_betas", "linear"])
def test_gguf_rope_scaling_metadata_gives_the_original_models_logits(tmp_path, rope_scaling):
    """transformers maps llama.cpp's rope.scaling.* keys for gpt-oss only; we map them for the
    others (unmapped, the model would run with unscaled RoPE)."""
    hf_model = _tiny_llama(64, rope_scaling=rope_scaling, max_position_embeddings=64)
    path = str(tmp_path / "tiny-scaled.gguf")
    write_llama_gguf(path, hf_model, Q.F32)
    with torch.no_grad():
        expected = hf_model(torch.tensor([PROMPT])).logits[0].numpy()
    np.testing.assert_allclose(_our_logits(path), expected, atol=1e-4, rtol=0)


def test_gguf_with_a_rope_scaling_we_do_not_map_is_refused_with_one_line(tmp_path):
    path = str(tmp_path / "tiny-longrope.gguf")
    write_llama_gguf(path, _tiny_llama(64), Q.F32,
                     extra_metadata={"llama.rope.scaling.type": "longrope"})
    with pytest.raises(ValueError, match="GGUF rope scaling 'longrope' .* not supported") as error:
        load_model(path, dtype="float32", skip_tokenizer_init=True, progress=False)
    assert "\n" not in str(error.value)
