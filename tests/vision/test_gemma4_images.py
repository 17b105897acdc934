"""Gemma 4 with images (Gemma4ForConditionalGeneration) against transformers on tiny random
checkpoints (tests/gemma4_images.py: images of up to 70 tokens, a decoder with a sliding window
of 4, pages of 4): the tower's rows (gemma-4-31b's form, standardized; e2b's, its projections
clipped); prompts expanded as transformers' processor expands them; logits with images, chunked,
in float32 and bfloat16, the image tokens seeing their whole image in the sliding layers only,
and e2b's form (per-layer embeddings, KV-shared layers, images causal); greedy tokens of prompts
with 0, 1 and 2 images batched with text-only ones, an image across a prefill chunk's edge; the
prefix cache with prompts sharing an image, a cached prefix that would end inside the image
recomputing it; no compile while serving; tensor parallelism over two devices. The OpenAI SDK:
tests/http/test_gemma4_vision_server.py."""
import copy
import dataclasses
import json
import os

import numpy as np
import pytest

from tests.gemma4_images import (IMAGE_TOKENS, hf_generate, hf_pixels, hf_processor,
                                 make_tiny_gemma4_images, random_image)
from tests.image_checks import (check_batched_with_images, check_shared_image_prefix,
                                check_two_devices, ids_of)
from tests.vision_models import chat, our_logits
from xlaserve.offline import Engine
from xlaserve.weights.loader import load_model

# Prefill chunks of 80 tokens at most (an image is up to 70), pages of 4.
SMALL = dict(dtype="float32", page_size=4, max_running_requests=4, chunked_prefill_size=80,
             max_prefill_tokens=96, context_length=256, max_total_tokens=2048)
IMAGE_ID = 499


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("gemma4_images"))
    model = make_tiny_gemma4_images(directory)
    with Engine(directory, **SMALL) as engine:
        yield engine, model, directory


@pytest.fixture(scope="module")
def small_form(tmp_path_factory):
    """gemma-4-e2b's form, loaded without an engine."""
    directory = str(tmp_path_factory.mktemp("gemma4_e2b_images"))
    return make_tiny_gemma4_images(directory, "small"), directory


def hf_rows(model, directory, images):
    import torch

    with torch.no_grad():
        out = model.model.get_image_features(**hf_pixels(directory, images))
    return [rows.numpy() for rows in out.pooler_output]


def encoder_inputs(directory, images):
    """The processor's patches and positions of each image, its padding dropped."""
    pixels = hf_pixels(directory, images)
    found = []
    for patches, positions in zip(pixels["pixel_values"].numpy(),
                                  pixels["image_position_ids"].numpy()):
        real = (positions >= 0).all(-1)
        found.append((patches[real], positions[real]))
    return found


def test_the_tower_and_embedder_give_transformers_rows(served, small_form):
    """gemma-4-31b's form (standardized) through the engine's encoder, each image in its own
    bucket's padding; e2b's (clipped projections, whose bounds matter: unbounded, the rows move
    by over 10x the tolerance) from a loaded model."""
    from xlaserve.runtime.executor.towers.gemma4_encoder import Gemma4Encoder
    from xlaserve.runtime.executor.kernels import kernels_for

    engine, model, directory = served
    images = [random_image(50, 70, 1), random_image(64, 64, 2), random_image(20, 300, 3)]
    encoder = engine.core.features.images.encoder
    assert encoder.buckets == (512, 630)
    rows = encoder.embed([(f"key{i}", p) for i, p in enumerate(encoder_inputs(directory,
                                                                             images))])
    for ours, expected in zip(rows, hf_rows(model, directory, images), strict=True):
        assert ours.shape == (1, len(expected), 64) and len(expected) <= IMAGE_TOKENS
        np.testing.assert_allclose(ours[0], expected, atol=2e-5)
    small, small_dir = small_form
    loaded = load_model(small_dir, dtype="float32", progress=False)
    expected = hf_rows(small, small_dir, images)
    inputs = encoder_inputs(small_dir, images)
    clipped = Gemma4Encoder(loaded, kernels_for("auto", loaded.mesh))
    for i, (ours, want) in enumerate(zip(clipped.embed(list(enumerate(inputs))), expected)):
        np.testing.assert_allclose(ours[0], want, atol=2e-5)
    for block in loaded.model.vision.blocks:
        for bounds in (block.qkv_clip, block.o_clip, block.gate_up_clip, block.down_clip):
            bounds.bounds[...] = np.tile([-np.inf, np.inf, -np.inf, np.inf],
                                         (bounds.bounds.shape[0], 1)).astype(np.float32)
    unbounded = Gemma4Encoder(loaded, kernels_for("auto", loaded.mesh)).embed([(0, inputs[0])])
    assert np.abs(unbounded[0][0] - expected[0]).max() > 2e-4


def test_prompts_expand_as_transformers_processor_expands_them(served):
    """`<|image|>` -> boi, one image token per soft token (by the image's aspect ratio), eoi;
    the image tokens are the processor's mm_token_type_ids."""
    engine, _, directory = served
    prepare = engine.core.features.images.prepare
    processor = hf_processor(directory)
    image, other = random_image(40, 30, 3), random_image(30, 90, 4)
    cases = [(chat(engine, "<image>", "describe it"), [image]),
             (chat(engine, "what is in", "<image>", "and", "<image>"), [image, other]),
             (chat(engine, "a red cat"), [])]
    for text, images in cases:
        ids, prompt_images = prepare(ids_of(engine, text), images)
        out = processor(text=[text], images=[images] if images else None, return_tensors="np")
        assert ids == out["input_ids"][0].tolist()
        if images:
            kinds = np.zeros(len(ids), int)
            for first, last in prompt_images.whole_spans:
                kinds[first:last] = 1
            assert kinds.tolist() == out["mm_token_type_ids"][0].tolist()
            assert len(prompt_images.whole_spans) == len(images)
        else:
            assert prompt_images is None
    with pytest.raises(ValueError, match=r"1 image placeholders \(<\|image\|>\) for 2"):
        prepare(ids_of(engine, cases[0][0]), [image, other])


def hf_logits(model, directory, ids, images, whole_images=True):
    import torch

    types = torch.tensor([[int(t == IMAGE_ID) for t in ids]])
    with torch.no_grad():
        out = model(torch.tensor([ids]), **hf_pixels(directory, images),
                    mm_token_type_ids=types if whole_images else None)
    return out.logits[0].float().numpy()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_with_images_equal_transformers(served, dtype):
    """Two images of different lengths, prefilled in chunks that end before each (the
    scheduler's cuts) and between them, against transformers' float32 logits: float32 within
    1e-4; bfloat16 as close as transformers' own bfloat16 model. The tiny tower's post-normed
    layers (each sublayer's small output normed back to size) amplify bfloat16's rounding, in
    transformers as here: measured, its bfloat16 model is 3.6% of the logit scale off on
    average and 58% at worst (image positions), ours 2.8% and 48%; the text before the first
    image within the text model's 5%. The image tokens' attention to their whole image
    matters: transformers' causal-only logits are over 10% of the scale off."""
    import torch

    engine, model, directory = served
    images = [random_image(50, 70, 5), random_image(90, 40, 6)]
    text = chat(engine, "what is in", "<image>", "and", "<image>", "describe it")
    ids, prompt_images = engine.core.features.images.prepare(ids_of(engine, text), images)
    (a, b), (c, d) = prompt_images.whole_spans
    assert b - a != d - c
    chunk_ends = [a - 3, b + 1, c, d + 2, len(ids)]
    loaded = load_model(directory, dtype=dtype, progress=False)
    ours = our_logits(loaded, ids, prompt_images, chunk_ends)
    expected = hf_logits(model, directory, ids, images)
    scale = np.abs(expected).max()
    if dtype == "float32":
        np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)
    else:
        own = hf_logits(copy.deepcopy(model).to(torch.bfloat16), directory, ids, images)
        error, own_error = np.abs(ours - expected), np.abs(own - expected)
        assert error.mean() <= 0.05 * scale and error.max() <= 1.25 * own_error.max()
        np.testing.assert_allclose(ours[:a], expected[:a], atol=0.05 * scale, rtol=0)
    causal = hf_logits(model, directory, ids, images, whole_images=False)
    assert np.abs(causal - hf_logits(model, directory, ids, images)).max() > 0.1 * scale


@pytest.mark.parametrize("form", ["small", "moe"])
def test_the_small_and_moe_forms_logits_with_images_equal_transformers(form, small_form,
                                                                       tmp_path):
    """gemma-4-e2b's form: per-layer embeddings (an image token's the pad token's own part and
    its image row's projection), the last two layers reading the first two's caches, clipped
    projections in the tower, the image tokens causal (no whole spans: the chunks cut inside
    the image). gemma-4-26b-a4b's: the experts beside every MLP, its image tokens seeing their
    whole image (a chunk ends before it). Float32 within 1e-4."""
    from xlaserve.runtime.engine.gemma4_images import Gemma4ImagePrompts
    from xlaserve.runtime.executor.towers.gemma4_encoder import Gemma4Encoder
    from xlaserve.runtime.executor.kernels import kernels_for

    model, directory = (small_form if form == "small"
                        else (make_tiny_gemma4_images(str(tmp_path), "moe"), str(tmp_path)))
    loaded = load_model(directory, dtype="float32", progress=False)
    processor = hf_processor(directory)
    prompts = Gemma4ImagePrompts(loaded.config.vision, processor.image_processor,
                                 Gemma4Encoder(loaded, kernels_for("auto", loaded.mesh)), 2, 64,
                                 loaded.dtype)
    images = [random_image(60, 50, 7)]
    text = "<bos><|turn>user\nwhat is in<|image|>describe it<turn|>\n<|turn>model\n"
    ids, prompt_images = prompts.prepare(processor.tokenizer.encode(
        text, add_special_tokens=False), images)
    start = ids.index(IMAGE_ID)
    if form == "small":
        assert prompt_images.whole_spans == ()
        chunk_ends = [start + 9, start + 40, len(ids)]
    else:  # a chunk never ends inside an image whose tokens see it whole
        assert prompt_images.whole_spans
        chunk_ends = [start - 1, len(ids)]
    ours = our_logits(loaded, ids, prompt_images, chunk_ends)
    np.testing.assert_allclose(ours, hf_logits(model, directory, ids, images), atol=1e-4,
                               rtol=0)


def test_prompts_with_zero_one_and_two_images_batched_give_transformers_tokens(served):
    """Batched with text-only prompts; the third prompt's second image crosses the 80-token edge
    of its first prefill chunk, which ends before it; nothing compiles while serving (steps,
    tower)."""
    engine, model, directory = served
    core = engine.core
    big, small = random_image(90, 60, 7), random_image(20, 30, 8)
    prompts = [(chat(engine, "what is in this picture", "<image>"), [big]),
               (chat(engine, "describe a red cat"), []),
               (chat(engine, "a red cat", "<image>", "and", "<image>", "what is in that one"),
                [small, big]),
               (chat(engine, "a red cat"), [])]
    expanded = [core.features.images.prepare(ids_of(engine, t), i)[0] for t, i in prompts]
    second = expanded[2].index(IMAGE_ID, expanded[2].index(498))
    assert second < SMALL["chunked_prefill_size"] < expanded[2].index(498, second)
    check_batched_with_images(engine, model, directory, hf_generate, prompts)


def test_prompts_sharing_an_image_reuse_its_pages_but_never_a_part_of_it(served):
    """The same chat twice: the second reuses its whole pages, the image's included. A prompt
    ending with the image (its reusable pages ending inside it: 72 of its 76 tokens, the image
    at 12 to 75) starts at the page before the image and computes the image again, whole."""
    engine, model, directory = served
    text = chat(engine, "what is in this picture a cat", "<image>", "describe it a red cat")
    short = "<bos><|turn>user\nwhat is in this picture a cat<|image|>"
    check_shared_image_prefix(engine, model, directory, hf_generate, random_image(70, 50, 9),
                              text, short)


def test_tensor_parallel_over_two_devices_gives_transformers_tokens(served, tmp_path):
    """tp 2 (two CPU devices): the tower's heads and MLP split, the decoder's too, the image
    tokens' prefix part through the kernel under shard_map by head."""
    engine, model, directory = served
    check_two_devices(engine, model, directory, hf_generate, random_image(60, 60, 10),
                      dict(SMALL, max_total_tokens=512), tmp_path)


def test_what_is_not_built_is_refused_in_one_line(served, tmp_path):
    """A prompt budget that cannot hold an image's tokens in one step (where they see one
    another), processor kwargs, a processor whose budget is not the config's."""
    import shutil

    from xlaserve.runtime.engine.gemma4_images import gemma4_image_prompts

    engine, _, directory = served
    core = engine.core
    args = dataclasses.replace(core.args, chunked_prefill_size=64)
    with pytest.raises(ValueError, match="^--chunked-prefill-size 64: a Gemma 4 image's up to 70 "
                                         "tokens attend to one another and run in one step$"):
        gemma4_image_prompts(args, core.loaded, core.runner, directory, 4)
    args = dataclasses.replace(core.args, max_prefill_tokens=72, max_running_requests=8)
    with pytest.raises(ValueError, match="^--max-prefill-tokens 72 with --max-running-requests 8"
                                         ": a step beside as many decodes has room for 64 "):
        gemma4_image_prompts(args, core.loaded, core.runner, directory, 4)
    args = dataclasses.replace(core.args, mm_processor_kwargs='{"max_soft_tokens": 140}')
    with pytest.raises(ValueError, match="^--mm-processor-kwargs"):
        gemma4_image_prompts(args, core.loaded, core.runner, directory, 4)
    shutil.copy(os.path.join(directory, "preprocessor_config.json"), tmp_path)
    config = json.loads((tmp_path / "preprocessor_config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        dict(config, max_soft_tokens=140)))
    with pytest.raises(ValueError, match="^the image processor makes images of up to 140 "):
        gemma4_image_prompts(core.args, core.loaded, core.runner, str(tmp_path), 4)
