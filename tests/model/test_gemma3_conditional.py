"""Gemma 3's image checkpoints (Gemma3ForConditionalGeneration: gemma-3-4b-it, 12b, 27b): a tiny
random one saved by transformers 5 (tests/tiny_models.py; its decoder's tensors
`language_model.model.*`, as gemma-3-4b-it's files name them) gives transformers' logits and
greedy tokens on text prompts, chunked; transformers' module names (`model.language_model.*`,
`model.vision_tower.*`, `model.multi_modal_projector.*`) and the published files' tower prefix
(`vision_tower.vision_model.*`) load the same weights; the published config reads as its text
model with the top level's tied head and end-of-turn ids beside its SigLIP tower (siglip_config),
what the tower does not run refused by name. Its images: tests/vision/test_gemma3_images.py;
the Engine on text: tests/engine/test_gemma3_engine.py."""
import dataclasses
import json
import os

import numpy as np
import pytest
import transformers
from safetensors.numpy import load_file, save_file

from tests.model.test_gemma3_config import GEMMA_3_4B_TEXT
from tests.model.test_transformer_matches_transformers import (PROMPTS, TOLERANCE, _hf_reference,
                                                              _run_ours)
from tests.tiny_models import make_tiny_gemma3_conditional
from xlaserve.model.config.encoder_config import model_config_from_hf
from xlaserve.model.config.model_config import ModelConfig
from xlaserve.model.registry import model_class_check
from xlaserve.weights.loader import load_model

# google/gemma-3-4b-it's config.json around its text_config: SigLIP's so400m tower at 896 px,
# 256 image tokens, the end-of-turn <end_of_turn> (106) an EOS beside <eos> (1).
GEMMA_3_4B_IT = dict(
    text_config=GEMMA_3_4B_TEXT, mm_tokens_per_image=256, boi_token_index=255999,
    eoi_token_index=256000, image_token_index=262144, eos_token_id=[1, 106],
    vision_config=dict(hidden_size=1152, image_size=896, intermediate_size=4304,
                       num_attention_heads=16, num_hidden_layers=27, patch_size=14,
                       vision_use_head=False))


@pytest.fixture(scope="module")
def conditional(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("gemma3_conditional"))
    return directory, make_tiny_gemma3_conditional(directory)


def test_the_published_config_reads_as_its_text_model_and_its_tower():
    hf_config = transformers.Gemma3Config(**GEMMA_3_4B_IT)
    hf_config.architectures = ["Gemma3ForConditionalGeneration"]
    c = model_config_from_hf(hf_config, model_class_check(hf_config))
    text = model_config_from_hf(transformers.Gemma3TextConfig(**GEMMA_3_4B_TEXT),
                                "Gemma3ForCausalLM")
    assert c.tie_word_embeddings
    assert c == dataclasses.replace(text, architecture="Gemma3ForConditionalGeneration",
                                    eos_token_ids=(1, 106), vision=c.vision)
    v = c.vision
    assert (v.depth, v.hidden_size, v.num_heads, v.intermediate_size, v.out_hidden_size) == (
        27, 1152, 16, 4304, 2560)
    assert (v.patches_per_side, v.tokens_per_side, v.pool, v.patch_dim) == (64, 16, 4, 588)
    assert (v.image_token_id, v.boi_token_id, v.eoi_token_id) == (262144, 255999, 256000)
    assert ModelConfig.from_dict(c.to_dict()) == c  # a converted checkpoint's config.json


@pytest.mark.parametrize("change,refusal", [
    (dict(vision_config=dict(GEMMA_3_4B_IT["vision_config"], hidden_act="relu")),
     "vision hidden_act 'relu' is not supported"),
    (dict(mm_tokens_per_image=200), "mm_tokens_per_image 200 is not a square"),
    (dict(mm_tokens_per_image=81), "mm_tokens_per_image 81 is not a square whose side divides"),
])
def test_what_the_tower_does_not_run_is_refused_by_name(change, refusal):
    hf_config = transformers.Gemma3Config(**{**GEMMA_3_4B_IT, **change})
    hf_config.architectures = ["Gemma3ForConditionalGeneration"]
    with pytest.raises(ValueError, match=refusal):
        model_config_from_hf(hf_config, model_class_check(hf_config))


def test_text_prompts_give_transformers_logits_and_greedy_tokens(conditional):
    directory, hf_model = conditional
    names = load_file(os.path.join(directory, "model.safetensors")).keys()
    assert "language_model.model.embed_tokens.weight" in names  # transformers 5's saved names
    assert any(n.startswith("vision_tower.") for n in names)
    loaded = load_model(directory, dtype="float32", skip_tokenizer_init=True, progress=False)
    references = [_hf_reference(hf_model, p) for p in PROMPTS]
    sequences = [(full, len(p)) for p, (full, _) in zip(PROMPTS, references, strict=True)]
    ours = _run_ours(loaded, sequences, prefill_chunk=3, page_size=4)
    for (full, expected), got in zip(references, ours, strict=True):
        np.testing.assert_allclose(got, expected, atol=TOLERANCE, rtol=0)
        prompt_len = len(full) - 5
        assert got[prompt_len - 1:-1].argmax(-1).tolist() == full[prompt_len:]


@pytest.mark.parametrize("layout", ["modules", "published"])
def test_other_tensor_names_load_the_same_weights(conditional, tmp_path, layout):
    """"modules": `model.language_model.*`, `model.vision_tower.*`,
    `model.multi_modal_projector.*`, the names of transformers' modules (state_dict), which some
    conversions save; "published": gemma-3-4b-it's files' tower, `vision_tower.vision_model.*`
    (transformers 5 drops SiglipVisionModel's `vision_model.` when it saves)."""
    directory, _ = conditional
    tensors = load_file(os.path.join(directory, "model.safetensors"))
    if layout == "modules":
        renamed = {("model.language_model." + n[len("language_model.model."):]
                    if n.startswith("language_model.model.") else "model." + n): t
                   for n, t in tensors.items()}
    else:
        renamed = {("vision_tower.vision_model." + n[len("vision_tower."):]
                    if n.startswith("vision_tower.") else n): t for n, t in tensors.items()}
    save_file(renamed, str(tmp_path / "model.safetensors"))
    with open(os.path.join(directory, "config.json")) as f:
        (tmp_path / "config.json").write_text(f.read())
    paths = [directory, str(tmp_path)]
    a, b = (load_model(p, dtype="float32", skip_tokenizer_init=True, progress=False).model
            for p in paths)
    np.testing.assert_array_equal(np.asarray(a.embedding[...]), np.asarray(b.embedding[...]))
    np.testing.assert_array_equal(np.asarray(a.layers[1].attn.qkv[...]),
                                  np.asarray(b.layers[1].attn.qkv[...]))
    for name in ("patch_embed", "pos_embed", "projection"):
        np.testing.assert_array_equal(np.asarray(getattr(a.vision, name)[...]),
                                      np.asarray(getattr(b.vision, name)[...]))
    np.testing.assert_array_equal(np.asarray(a.vision.blocks[1].qkv[...]),
                                  np.asarray(b.vision.blocks[1].qkv[...]))
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [
        "Gemma3ForConditionalGeneration"]
