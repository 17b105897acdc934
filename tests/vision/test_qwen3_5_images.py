"""Qwen3.5's image checkpoints (Qwen3_5ForConditionalGeneration) in the engine, against
transformers on a tiny random one (tests/vision_models.py): the hybrid text model of
tiny_models.HYBRID["qwen3_5"] (Gated DeltaNet layers and a gated full one, RoPE on a quarter of
each head, its multimodal sections interleaved over those pairs) beside Qwen3-VL's tower without
DeepStack, named as transformers saves it (`model.language_model.*`, `model.visual.*`), with a
multi-token-prediction head (`mtp.*`) in its files as the published ones have, which is not read.
The tower gives transformers' rows; text prompts, and prompts with one and two images run
together with chunked prefill across the images, give transformers' greedy tokens and logprobs
(its generate on the same processor inputs), with nothing compiled while serving."""
import numpy as np
import pytest

from tests.vision_models import (generate_all, hf_generate, make_tiny_vision_language,
                                 random_image)
from xlaserve.offline import Engine

# Prefill chunks of 8 tokens: an image of 16 tokens is cut across two or three.
SMALL = dict(dtype="float32", page_size=4, max_running_requests=4, chunked_prefill_size=8,
             max_prefill_tokens=12, context_length=256, max_total_tokens=2048)
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
PAD = "<|vision_start|> <|image_pad|> <|vision_end|>"


def _with_mtp_head(directory: str) -> None:
    """A file of `mtp.*` tensors beside the model's, as Qwen3.5's checkpoints ship their
    multi-token-prediction head (transformers ignores them on load; xlaserve does not read
    them)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    save_file({"mtp.fc.weight": rng.standard_normal((64, 128), np.float32),
               "mtp.norm.weight": np.ones(64, np.float32),
               "mtp.layers.0.input_layernorm.weight": np.ones(64, np.float32)},
              f"{directory}/mtp.safetensors")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("qwen3_5_images"))
    model = make_tiny_vision_language(directory, "qwen3_5")
    _with_mtp_head(directory)
    with Engine(directory, **SMALL) as engine:
        yield engine, model, directory


def _ids(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text, add_special_tokens=False)


def test_the_vision_tower_gives_transformers_rows(served):
    import torch
    import transformers

    engine, model, directory = served
    images = [random_image(90, 130, 1), random_image(40, 40, 2)]
    processor = transformers.Qwen2VLImageProcessorPil.from_pretrained(directory)
    out = processor(images=images, return_tensors="pt")
    with torch.no_grad():
        expected = model.model.visual(out["pixel_values"],
                                      grid_thw=out["image_grid_thw"]).pooler_output.numpy()
    grids = [tuple(g) for g in out["image_grid_thw"].tolist()]
    pixels = np.split(out["pixel_values"].numpy(), np.cumsum([np.prod(g) for g in grids])[:-1])
    rows = engine.core.features.images.encoder.embed(
        [(f"tower{i}", p, g) for i, (p, g) in enumerate(zip(pixels, grids))])
    # One level: the merged rows alone (no DeepStack rows).
    np.testing.assert_allclose(np.concatenate(rows, axis=1), expected[None], atol=2e-5)


def test_text_prompts_give_transformers_greedy_tokens(served):
    engine, model, directory = served
    texts = ["<|im_start|> user describe a red cat <|im_end|>",
             "what is in this picture and that one describe it " * 3, "cat"]
    compiled = engine.core.runner.compile_count()
    tokens, logprobs = generate_all(engine, [(text, []) for text in texts], GREEDY)
    expected = [hf_generate(model, directory, _ids(engine, text), [], GREEDY["max_new_tokens"],
                            logprobs=True) for text in texts]
    assert tokens == [t for t, _ in expected]
    np.testing.assert_allclose(np.array(logprobs), np.array([lp for _, lp in expected]),
                               atol=2e-4)
    assert engine.core.runner.compile_count() == compiled


def test_prompts_with_images_in_one_batch_give_transformers_greedy_tokens(served):
    """One image, two of other sizes, and a text-only prompt submitted together; the images'
    tokens (9 to 16 each) cut across prefill chunks of 8."""
    engine, model, directory = served
    big, small, tall = random_image(90, 130, 4), random_image(40, 40, 5), random_image(120, 50, 6)
    cases = [(f"<|im_start|> user {PAD} what is in this picture <|im_end|>", [big]),
             (f"user {PAD} and {PAD} what is in that one", [small, tall]),
             ("<|im_start|> user describe a red cat <|im_end|>", []),
             (f"{PAD} cat", [tall])]
    expected = []
    for text, images in cases:
        ids, _ = engine.core.features.images.prepare(_ids(engine, text), images)
        expected.append(hf_generate(model, directory, ids, images, GREEDY["max_new_tokens"],
                                    logprobs=True))
    compiled = engine.core.runner.compile_count()
    tokens, logprobs = generate_all(engine, cases, GREEDY)
    assert tokens == [t for t, _ in expected]
    np.testing.assert_allclose(np.array(logprobs), np.array([lp for _, lp in expected]),
                               atol=2e-4)
    assert engine.core.runner.compile_count() == compiled  # images need no new program
