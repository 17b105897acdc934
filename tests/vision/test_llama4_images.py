"""Llama 4 with images (Llama4ForConditionalGeneration) against transformers on a tiny random
checkpoint (tests/llama4_images.py: a 2-layer encoder on 32-pixel tiles of 16 tokens, up to 4
tiles and the global one; the decoder's attention chunk of 32, pages of 4): the encoder's rows;
the tiles as transformers' processor makes them; prompts expanded as its Llama4Processor
expands them; logits with images, prefilled in chunks that end inside the images, in float32 and
bfloat16; greedy tokens of prompts with 0, 1 and 2 images (a 2 x 2 tiled one) batched with
text-only ones in prefill chunks of 7; the prefix cache with prompts sharing an image, a cached
prefix ending inside the image; no compile while serving; tensor parallelism over two devices;
refusals. The OpenAI SDK: tests/http/test_llama4_vision_server.py.

The oracle's tiles are ours (transformers' model on them: the model's path exact to float32's
rounding); transformers' processor's tiles differ from ours by one level (1/255) at a few
percent of values (the resizes' fixed point: test_tiles_are_transformers_processor_s), which
moves these random logits by 0.24% of their scale (test_logits_with_images_equal_transformers).
"""
import dataclasses
import json
import os

import numpy as np
import pytest

from tests.llama4_images import (MAX_TILES, TILE, TILE_TOKENS, hf_generate, hf_image_processor,
                                 hf_logits, hf_processor, make_tiny_llama4_images, smooth_image)
from tests.vision_models import (chat, generate_all, our_logits, random_image,
                                 two_device_tokens)
from xlaserve.model.vision.llama4_tiles import TileProcessor, fitted_size
from xlaserve.offline import Engine
from xlaserve.runtime.engine.llama4_images import image_markers, tile_processor
from xlaserve.weights.loader import load_model

PATCH = 499
SMALL = dict(dtype="float32", page_size=4, max_running_requests=4, chunked_prefill_size=7,
             max_prefill_tokens=12, context_length=128, max_total_tokens=1024)
NEW_TOKENS = 8
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("llama4_images"))
    model = make_tiny_llama4_images(directory)
    with Engine(directory, **SMALL) as engine:
        yield engine, model, directory


def expanded(engine, text, images):
    """(ids, PromptImages) of a prompt text and its images, as the engine prepares them."""
    return engine.core.features.images.prepare(
        engine.tokenizer.encode(text, add_special_tokens=False), images)


def our_tiles(engine, images):
    """The images' tiles as the server makes them, one after another (the oracle's pixels)."""
    import torch

    processor = engine.core.features.images.processor
    return torch.tensor(np.concatenate([processor(image)[0] for image in images]))


def test_the_encoder_and_projector_give_transformers_rows(served):
    import torch

    engine, model, _ = served
    images = [smooth_image(64, 60, 1), smooth_image(20, 30, 2)]  # 2 x 2 tiles + global; 1 tile
    pixels = hf_image_processor()(images=images, return_tensors="pt")["pixel_values"].float()
    with torch.no_grad():
        features = model.vision_model(pixels).last_hidden_state
        expected = model.multi_modal_projector(features).numpy()
    rows = engine.core.features.images.encoder.embed([("a", pixels[:5].numpy()),
                                                      ("b", pixels[5:].numpy())])
    assert [r.shape for r in rows] == [(1, 5 * TILE_TOKENS, 64), (1, TILE_TOKENS, 64)]
    np.testing.assert_allclose(np.concatenate(rows, 1)[0], expected.reshape(-1, 64), atol=2e-5)


def test_tiles_are_transformers_processor_s():
    """The canvas, the grid and the global tile as transformers chooses them over 60 sizes
    (sizes whose fitted width is float32's, 41 x 82 -> 63 columns where float64 says 64, and
    49 x 98 -> 64 where float64 says 63, among them); the values one level apart at most
    (2/255, and bfloat16's rounding of either side), at few of them."""
    hf, ours = hf_image_processor(), TileProcessor(tile=TILE, max_patches=MAX_TILES)
    assert fitted_size((41, 82), (32, 64), 32) == (32, 63)
    assert fitted_size((49, 98), (32, 64), 32) == (32, 64)
    rng = np.random.default_rng(0)
    sizes = [(41, 82), (49, 98), (82, 41), (32, 32), (300, 200), (5, 190)] + [
        tuple(int(n) for n in rng.integers(5, 200, 2)) for _ in range(54)]
    differ = []
    for i, (height, width) in enumerate(sizes):
        image = (smooth_image if i % 2 else random_image)(height, width, i)
        out = hf(images=[image], return_tensors="pt")
        tiles, grid = ours(image)
        assert grid == tuple(out["aspect_ratios"][0].tolist()), (height, width)
        expected = out["pixel_values"].float().numpy()
        assert tiles.shape == expected.shape and np.abs(tiles - expected).max() <= 0.016
        differ.append(np.mean(tiles != expected))
    assert np.median(differ) < 0.01  # measured 0.19% (at most 16.5%: random noise shrunk 6x)


def test_prompts_expand_as_transformers_processor_expands_them(served):
    """<|image|> -> <|image_start|>, the tiles' <|patch|> tokens row by row with their
    separators, <|image|>, the global tile's, <|image_end|>; a one-tile image without
    separators; placeholders that do not match the images, and <|patch|> written in the prompt,
    refused."""
    engine, _, directory = served
    processor = hf_processor(directory)
    big, wide, small = smooth_image(64, 60, 3), smooth_image(30, 60, 4), smooth_image(20, 30, 5)
    cases = [(chat(engine, "<image>", "describe it"), [big]),
             (chat(engine, "what is in", "<image>", "and", "<image>"), [wide, small]),
             (chat(engine, "a red cat"), [])]
    for text, images in cases:
        ids, prompt_images = expanded(engine, text, images)
        out = processor(text=[text], images=images or None, return_tensors="pt")
        assert ids == out["input_ids"][0].tolist()
        if images:
            assert prompt_images.positions is None and not prompt_images.whole_spans
            assert prompt_images.embed_rows.tolist() == [
                int(np.sum(np.asarray(ids[:i]) == PATCH)) if t == PATCH else -1
                for i, t in enumerate(ids)]
        else:
            assert prompt_images is None
    ids = expanded(engine, cases[0][0], [big])[0]
    assert ids.count(495) == 2 and ids.count(494) == 2 and ids.count(PATCH) == 5 * TILE_TOKENS
    with pytest.raises(ValueError, match=r"1 image placeholders \(<\|image\|>\) for 2 images"):
        expanded(engine, cases[0][0], [big, small])
    with pytest.raises(ValueError, match="holds image tokens"):
        engine.core.features.images.prepare([1, PATCH, 496], [small])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_with_images_equal_transformers(served, dtype):
    """A tiled image (2 x 2 and the global tile) and a one-tile one, prefilled in chunks that
    end inside the first tile, the second, and the second image: float32 within 1e-4 of
    transformers on the same tiles (measured 1.8e-6), bfloat16 within 5% of the logit scale
    (the text model's bound; measured 2.3%, transformers' own bfloat16 model is 1.9% from its
    float32 one). transformers' processor's tiles move its float32 logits by 0.24% of the scale
    (bound 1%)."""
    import copy

    import torch

    engine, model, directory = served
    images = [smooth_image(40, 70, 6), smooth_image(20, 20, 7)]
    text = chat(engine, "what is in", "<image>", "and", "<image>", "describe it")
    ids, prompt_images = expanded(engine, text, images)
    patches = [i for i, t in enumerate(ids) if t == PATCH]
    chunk_ends = [patches[5], patches[20], patches[-3], len(ids)]
    loaded = load_model(directory, dtype=dtype, progress=False)
    ours = our_logits(loaded, ids, prompt_images, chunk_ends)
    reference = model if dtype == "float32" else copy.deepcopy(model).to(torch.bfloat16)
    expected = hf_logits(reference, ids, images, our_tiles(engine, images))
    scale = np.abs(expected).max()
    bound = 1e-4 if dtype == "float32" else 0.05 * scale
    np.testing.assert_allclose(ours, expected, atol=bound, rtol=0)
    if dtype == "float32":
        assert np.abs(hf_logits(model, ids, images) - expected).max() < 0.01 * scale


def test_prompts_with_zero_one_and_two_images_batched_give_transformers_tokens(served):
    """Batched with text-only prompts in prefill chunks of 7 (an image's 16-token tiles are
    cut), a 2 x 2 tiled image (5 tiles, past the attention chunk of 32); nothing compiles while
    serving (steps, encoder)."""
    engine, model, _ = served
    core = engine.core
    big, wide, small = smooth_image(64, 60, 8), smooth_image(30, 60, 9), smooth_image(20, 30, 10)
    prompts = [(chat(engine, "what is in this picture", "<image>"), [big]),
               (chat(engine, "describe a red cat"), []),
               (chat(engine, "<image>", "and", "<image>", "what is in that one"), [small, wide]),
               (chat(engine, "a red cat"), [])]
    ids = [expanded(engine, t, i)[0] for t, i in prompts]
    assert ids[0].count(PATCH) == 5 * TILE_TOKENS and len(ids[0]) + NEW_TOKENS <= 128
    expected = [hf_generate(model, prompt, images, NEW_TOKENS, logprobs=True,
                            pixels=our_tiles(engine, images) if images else None)
                for prompt, (_, images) in zip(ids, prompts)]
    compiled, encoder = core.runner.compile_count(), core.features.images.encoder._encode
    tokens, logprobs = generate_all(engine, prompts, GREEDY)
    assert tokens == [t for t, _ in expected]
    np.testing.assert_allclose(logprobs, [lp for _, lp in expected], atol=2e-4)
    assert core.runner.compile_count() == compiled and encoder._cache_size() == 0


def test_prompts_sharing_an_image_reuse_its_pages_even_inside_it(served):
    """The same chat twice: the second reuses its whole pages, the image's included, and the
    encoder runs once. A prompt ending with the image: its reusable pages end inside the image
    (its tokens attend causally, so a prefix of them is the same wherever the prompt goes on),
    and the rest of the image is prefilled from there."""
    engine, model, _ = served
    engine.core.flush_cache()
    image = smooth_image(30, 60, 11)
    runs = engine.core.features.images.encoder.runs
    text = chat(engine, "what is in this picture a cat", "<image>", "describe it a red cat")
    ids, _ = expanded(engine, text, [image])
    short = text[:text.index("<|image|>") + len("<|image|>")]
    short_ids = expanded(engine, short, [image])[0]
    end = short_ids.index(498)
    assert short_ids == ids[:end + 1] and ids[(len(short_ids) - 1) // 4 * 4 - 1] == PATCH
    outs = [engine.generate(t, dict(GREEDY), image_data=image) for t in (text, text, short)]
    assert engine.core.features.images.encoder.runs == runs + 1  # one image, encoded once
    cached = [o["meta_info"]["cached_tokens"] for o in outs]
    assert cached == [0, (len(ids) - 1) // 4 * 4, (len(short_ids) - 1) // 4 * 4]
    pixels = our_tiles(engine, [image])
    for out, prompt in zip(outs, (ids, ids, short_ids)):
        assert out["output_ids"] == hf_generate(model, prompt, [image], NEW_TOKENS,
                                                pixels=pixels)


def test_tensor_parallel_over_two_devices_gives_transformers_tokens(served, tmp_path):
    """tp 2 (two CPU devices): the encoder's heads, MLP and adapter split, the decoder's too."""
    engine, model, directory = served
    image = smooth_image(30, 60, 12)
    text = chat(engine, "what is in this picture", "<image>", "describe it")
    ids, _ = expanded(engine, text, [image])
    assert two_device_tokens(directory, image, SMALL, text, tmp_path) == hf_generate(
        model, ids, [image], NEW_TOKENS, pixels=our_tiles(engine, [image]))


def test_what_is_not_built_is_refused_in_one_line(served, tmp_path):
    """--mm-processor-kwargs beyond max_patches and resize_to_max_canvas, a processor config
    that is not the encoder's tile or not bilinear, a tokenizer without the image markers."""
    import shutil

    _, _, directory = served
    assert tile_processor(directory, TILE, '{"max_patches": 2}').max_tiles() == 3
    with pytest.raises(ValueError, match="^--mm-processor-kwargs .*: Llama 4's images take "
                                         "max_patches"):
        tile_processor(directory, TILE, '{"max_pixels": 1000}')
    with pytest.raises(ValueError, match="size .* is not the vision encoder's 64-pixel"):
        tile_processor(directory, 64, None)
    shutil.copy(os.path.join(directory, "preprocessor_config.json"), tmp_path)
    config = json.loads((tmp_path / "preprocessor_config.json").read_text())
    for change, message in (({"resample": 3}, "^resample 3: Llama 4's images are resized "
                                              "bilinearly"),
                            ({"do_normalize": False}, "^do_normalize false")):
        (tmp_path / "preprocessor_config.json").write_text(json.dumps(dict(config, **change)))
        with pytest.raises(ValueError, match=message):
            tile_processor(str(tmp_path), TILE, None)

    @dataclasses.dataclass
    class Vocabulary:
        vocabulary: dict

        def get_vocab(self):
            return self.vocabulary

    markers = {"<|image|>": 1, "<|image_start|>": 2, "<|image_end|>": 3, "<|patch|>": 4,
               "<|tile_x_separator|>": 5}
    with pytest.raises(ValueError, match=r"need the tokens <\|tile_y_separator\|> in"):
        image_markers(Vocabulary(markers), 4)
    with pytest.raises(ValueError, match=r"<\|patch\|> is 4, not the config's image_token_index 9"):
        image_markers(Vocabulary(dict(markers, **{"<|tile_y_separator|>": 6})), 9)
