"""Gemma 4's image checkpoints' configs and tensors (Gemma4ForConditionalGeneration): the
published forms' configs read as their text model beside their vision tower
(gemma4_vision_config: gemma-4-26b-a4b-it's standardized tower whose images the sliding layers
see whole, gemma-4-e4b-it's clipped one whose images stay causal), round trip through to_dict,
what the tower does not run refused by name; the tensors without transformers' `model.` prefix
(`language_model.model.*`, `vision_tower.*`, `embed_vision.*`) load the same weights as
transformers 5's saves. Its images against transformers: tests/vision/test_gemma4_images.py."""
import json
import os

import numpy as np
import pytest
import transformers
from safetensors.numpy import load_file, save_file

from tests.gemma4_images import make_tiny_gemma4_images
from xlaserve.model.config.encoder_config import model_config_from_hf
from xlaserve.model.config.model_config import ModelConfig
from xlaserve.model.registry import model_class_check
from xlaserve.weights.loader import load_model

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "configs")
# google/gemma-4-26B-A4B-it's vision_config and top level (the text config:
# benchmarks/configs/gemma-4-26b-a4b-text), as two third-party copies of its config.json give
# them; gemma-4-E4B-it's vision_config (its text model is not built here).
LARGE_VISION = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                    num_attention_heads=16, num_key_value_heads=16, head_dim=72, patch_size=16,
                    pooling_kernel_size=3, position_embedding_size=10240, rms_norm_eps=1e-6,
                    rope_parameters={"rope_type": "default", "rope_theta": 100.0},
                    standardize=True, use_clipped_linears=False,
                    hidden_activation="gelu_pytorch_tanh")
SMALL_VISION = dict(LARGE_VISION, hidden_size=768, intermediate_size=3072, num_hidden_layers=16,
                    num_attention_heads=12, num_key_value_heads=12, head_dim=64,
                    standardize=False, use_clipped_linears=True)
TOP = dict(boi_token_id=255999, eoi_token_id=258882, image_token_id=258880,
           video_token_id=258884, audio_token_id=258881, eos_token_id=[1, 106, 50],
           vision_soft_tokens_per_image=280)


def _hf(vision=LARGE_VISION, text_changes=None, **changes):
    with open(os.path.join(CONFIGS, "gemma-4-26b-a4b-text", "config.json")) as f:
        text = {k: v for k, v in json.load(f).items() if k not in ("architectures",)}
    text.update({"use_bidirectional_attention": "vision", **(text_changes or {})})
    config = transformers.Gemma4Config(text_config=text, vision_config=vision,
                                       audio_config=None, **{**TOP, **changes})
    config.architectures = ["Gemma4ForConditionalGeneration"]
    return config


def test_the_published_configs_read_as_their_text_model_and_tower():
    hf_config = _hf()
    c = model_config_from_hf(hf_config, model_class_check(hf_config))
    text = ModelConfig.from_hf(hf_config.text_config, "Gemma4ForCausalLM")
    assert c.eos_token_ids == (1, 106, 50) and c.num_experts == 128
    assert (c.hidden_size, c.num_layers) == (text.hidden_size, text.num_layers) == (2816, 30)
    v = c.vision
    assert (v.depth, v.hidden_size, v.num_heads, v.head_dim, v.intermediate_size,
            v.out_hidden_size) == (27, 1152, 16, 72, 4304, 2816)
    assert (v.patch_dim, v.max_patches, v.fewest_tokens) == (768, 2520, 124)
    assert v.standardize and not v.clipped and v.whole_images and v.sliding_layers_only
    assert (v.image_token_id, v.boi_token_id, v.eoi_token_id) == (258880, 255999, 258882)
    assert ModelConfig.from_dict(c.to_dict()) == c  # a converted checkpoint's config.json
    small = model_config_from_hf(_hf(SMALL_VISION, dict(use_bidirectional_attention=None)),
                                 "Gemma4ForConditionalGeneration").vision
    assert small.clipped and not small.standardize and not small.whole_images
    assert (small.depth, small.hidden_size, small.head_dim) == (16, 768, 64)


@pytest.mark.parametrize("vision,text,refusal", [
    (dict(LARGE_VISION, hidden_activation="relu"), {}, "vision hidden_activation 'relu'"),
    (dict(LARGE_VISION, num_key_value_heads=8), {}, "vision num_key_value_heads 8 other than"),
    (dict(LARGE_VISION, head_dim=70), {}, "vision head_dim 70 is not a multiple of 4"),
    (dict(LARGE_VISION, position_embedding_size=512), {}, "past the vision "
                                                          "position_embedding_size 512"),
    (LARGE_VISION, dict(use_bidirectional_attention="all"), "use_bidirectional_attention='all'"),
])
def test_what_the_tower_does_not_run_is_refused_by_name(vision, text, refusal):
    with pytest.raises(ValueError, match=refusal):
        model_config_from_hf(_hf(vision, text), "Gemma4ForConditionalGeneration")


def test_tensors_without_the_model_prefix_load_the_same_weights(tmp_path_factory):
    """transformers 5's saves (`model.language_model.*`, `model.vision_tower.*`,
    `model.embed_vision.*`) and the same tensors under `language_model.model.*`,
    `vision_tower.*` and `embed_vision.*`; the clipped form's bounds too."""
    directory = str(tmp_path_factory.mktemp("gemma4_saved"))
    make_tiny_gemma4_images(directory, "small")
    tensors = load_file(os.path.join(directory, "model.safetensors"))
    assert any(n.startswith("model.embed_vision.") for n in tensors)
    renamed = {("language_model.model." + n[len("model.language_model."):]
                if n.startswith("model.language_model.") else n[len("model."):]): t
               for n, t in tensors.items()}
    other = tmp_path_factory.mktemp("gemma4_unprefixed")
    save_file(renamed, str(other / "model.safetensors"))
    with open(os.path.join(directory, "config.json")) as f:
        (other / "config.json").write_text(f.read())
    a, b = (load_model(p, dtype="float32", skip_tokenizer_init=True, progress=False).model
            for p in (directory, str(other)))
    np.testing.assert_array_equal(np.asarray(a.embedding[...]), np.asarray(b.embedding[...]))
    for name in ("patch_embed", "pos_embed", "projection"):
        np.testing.assert_array_equal(np.asarray(getattr(a.vision, name)[...]),
                                      np.asarray(getattr(b.vision, name)[...]))
    for name in ("qkv", "gate_up", "down"):
        np.testing.assert_array_equal(np.asarray(getattr(a.vision.blocks[1], name)[...]),
                                      np.asarray(getattr(b.vision.blocks[1], name)[...]))
    bounds = np.asarray(a.vision.blocks[1].qkv_clip.bounds[...])
    np.testing.assert_array_equal(bounds, np.asarray(b.vision.blocks[1].qkv_clip.bounds[...]))
    np.testing.assert_array_equal(bounds, np.float32([[-1.5, 1.5, -0.6, 0.6]] * 3))  # the tiny
    # model's (tests/tiny_models.randomize)
