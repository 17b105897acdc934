"""Gemma 3 with images (Gemma3ForConditionalGeneration) against transformers on a tiny random
checkpoint (tests/gemma3_images.py: a SigLIP tower pooled to 16 image tokens, a decoder with a
sliding window of 4, pages of 4): the tower's rows; prompts expanded as transformers' processor
expands them; logits with images, chunked, in float32 and bfloat16; greedy tokens of prompts
with 0, 1 and 2 images batched with text-only ones, an image across a prefill chunk's edge; the
prefix cache with prompts sharing an image, a cached prefix that would end inside the image
recomputing it; no compile while serving; tensor parallelism over two devices. The OpenAI SDK:
tests/http/test_gemma3_vision_server.py."""
import dataclasses
import json
import os

import numpy as np
import pytest

from tests.gemma3_images import (IMAGE_TOKENS, hf_generate, hf_processor, make_tiny_gemma3_images,
                                 random_image)
from tests.image_checks import (check_batched_with_images, check_shared_image_prefix,
                                check_two_devices, ids_of)
from tests.vision_models import chat, our_logits
from xlaserve.offline import Engine
from xlaserve.weights.loader import load_model

# Prefill chunks of 20 tokens at most (an image is 16), pages of 4.
SMALL = dict(dtype="float32", page_size=4, max_running_requests=4, chunked_prefill_size=20,
             max_prefill_tokens=24, context_length=128, max_total_tokens=1024)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("gemma3_images"))
    model = make_tiny_gemma3_images(directory)
    with Engine(directory, **SMALL) as engine:
        yield engine, model, directory


def test_the_tower_and_projector_give_transformers_rows(served):
    import torch

    engine, model, directory = served
    images = [random_image(50, 70, 1), random_image(64, 64, 2)]
    pixels = hf_processor(directory).image_processor(images=images,
                                                     return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        expected = model.model.get_image_features(pixels).pooler_output.numpy()
    encoder = engine.core.features.images.encoder
    rows = encoder.embed([(f"key{i}", p) for i, p in enumerate(pixels.numpy())])
    assert rows[0].shape == (1, IMAGE_TOKENS, 64)
    np.testing.assert_allclose(np.concatenate(rows), expected, atol=2e-5)


def test_prompts_expand_as_transformers_processor_expands_them(served):
    """`<start_of_image>` -> "\\n\\n" boi, 16 image tokens, eoi "\\n\\n", the newlines merged
    with the prompt's own as the tokenizer gives them ("user\\n" before: "\\n\\n\\n")."""
    engine, _, directory = served
    prepare = engine.core.features.images.prepare
    processor = hf_processor(directory)
    image, other = random_image(40, 30, 3), random_image(30, 40, 4)
    cases = [(chat(engine, "<image>", "describe it"), [image]),
             (chat(engine, "what is in", "<image>", "and", "<image>"), [image, other]),
             ("<start_of_image>\n\n\n cat", [other]),
             (chat(engine, "a red cat"), [])]
    for text, images in cases:
        ids, prompt_images = prepare(ids_of(engine, text), images)
        out = processor(text=[text], images=[images] if images else None, return_tensors="np")
        assert ids == out["input_ids"][0].tolist()
        if images:
            kinds = np.zeros(len(ids), int)
            for first, last in prompt_images.whole_spans:
                kinds[first:last] = 1
            assert kinds.tolist() == out["token_type_ids"][0].tolist()
            assert prompt_images.positions is None and prompt_images.rope_delta == 0
        else:
            assert prompt_images is None
    with pytest.raises(ValueError, match=r"1 image placeholders \(<start_of_image>\) for 2"):
        prepare(ids_of(engine, cases[0][0]), [image, other])
    with pytest.raises(ValueError, match="holds image tokens"):
        prepare(ids_of(engine, cases[0][0]) + [499], [image])


def hf_logits(model, directory, ids, images, bidirectional=True):
    import torch

    pixels = hf_processor(directory).image_processor(images=images,
                                                     return_tensors="pt")["pixel_values"]
    types = torch.tensor([[int(t == model.config.image_token_id) for t in ids]])
    with torch.no_grad():
        out = model(torch.tensor([ids]), pixel_values=pixels,
                    token_type_ids=types if bidirectional else None)
    return out.logits[0].float().numpy()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_with_images_equal_transformers(served, dtype):
    """Two images, prefilled in chunks that end before each (the scheduler's cuts) and between
    them; float32 within 1e-4, bfloat16 within 5% of the logit scale (the text model's bound,
    test_transformer_matches_transformers.BFLOAT16_BOUNDS; measured 1.9%, where transformers'
    own bfloat16 model is 2.2% from its float32 one). The image tokens' attention to their
    whole image matters: transformers' causal-only logits are over 10% of the scale off."""
    import copy

    import torch

    engine, model, directory = served
    images = [random_image(50, 70, 5), random_image(64, 40, 6)]
    text = chat(engine, "what is in", "<image>", "and", "<image>", "describe it")
    ids, prompt_images = engine.core.features.images.prepare(ids_of(engine, text), images)
    (a, b), (c, d) = prompt_images.whole_spans
    chunk_ends = [a - 3, b + 1, c, d + 2, len(ids)]
    loaded = load_model(directory, dtype=dtype, progress=False)
    ours = our_logits(loaded, ids, prompt_images, chunk_ends)
    reference = model if dtype == "float32" else copy.deepcopy(model).to(torch.bfloat16)
    expected = hf_logits(reference, directory, ids, images)
    scale = np.abs(expected).max()
    bound = 1e-4 if dtype == "float32" else 0.05 * scale
    np.testing.assert_allclose(ours, expected, atol=bound, rtol=0)
    causal = hf_logits(model, directory, ids, images, bidirectional=False)
    assert np.abs(causal - hf_logits(model, directory, ids, images)).max() > 0.1 * scale


def test_prompts_with_zero_one_and_two_images_batched_give_transformers_tokens(served):
    """Batched with text-only prompts; the first prompt's image crosses the 20-token edge of its
    first prefill chunk, which ends before it; nothing compiles while serving (steps, tower)."""
    engine, model, directory = served
    core = engine.core
    big, small = random_image(90, 60, 7), random_image(20, 30, 8)
    prompts = [(chat(engine, "what is in this picture", "<image>"), [big]),
               (chat(engine, "describe a red cat"), []),
               (chat(engine, "<image>", "and", "<image>", "what is in that one"), [small, big]),
               (chat(engine, "a red cat"), [])]
    expanded = [core.features.images.prepare(ids_of(engine, t), i)[0] for t, i in prompts]
    first_image = expanded[0].index(499)
    assert first_image < SMALL["chunked_prefill_size"] < first_image + IMAGE_TOKENS
    check_batched_with_images(engine, model, directory, hf_generate, prompts)


def test_prompts_sharing_an_image_reuse_its_pages_but_never_a_part_of_it(served):
    """The same chat twice: the second reuses its whole pages, the image's included. A prompt
    ending two tokens after the image (its reusable pages ending inside the image) starts at
    the page before the image and computes the image again, whole."""
    engine, model, directory = served
    text = chat(engine, "what is in this picture a cat", "<image>", "describe it a red cat")
    short = "<bos><start_of_turn>user\nwhat is in this picture a cat<start_of_image>"
    check_shared_image_prefix(engine, model, directory, hf_generate, random_image(70, 50, 9),
                              text, short)


def test_tensor_parallel_over_two_devices_gives_transformers_tokens(served, tmp_path):
    """tp 2 (two CPU devices): the tower's heads and MLP split, the decoder's too, the image
    tokens' prefix part through the kernel under shard_map by head."""
    engine, model, directory = served
    check_two_devices(engine, model, directory, hf_generate, random_image(60, 60, 10),
                      dict(SMALL, max_total_tokens=512), tmp_path)


def test_what_is_not_built_is_refused_in_one_line(served, tmp_path):
    """A prompt budget that cannot hold an image's tokens in one step, processor kwargs,
    pan-and-scan crops (the checkpoint's processor config turning them on)."""
    import shutil

    from xlaserve.runtime.engine.gemma3_images import gemma3_image_prompts

    engine, _, directory = served
    core = engine.core
    args = dataclasses.replace(core.args, chunked_prefill_size=12)
    with pytest.raises(ValueError, match="^--chunked-prefill-size 12: a Gemma 3 image's 16 "
                                         "tokens attend to one another and run in one step$"):
        gemma3_image_prompts(args, core.loaded, core.runner, engine.tokenizer, directory, 4)
    args = dataclasses.replace(core.args, max_prefill_tokens=20, max_running_requests=8)
    with pytest.raises(ValueError, match="^--max-prefill-tokens 20 with --max-running-requests 8"
                                         ": a step beside as many decodes has room for 12 "):
        gemma3_image_prompts(args, core.loaded, core.runner, engine.tokenizer, directory, 4)
    args = dataclasses.replace(core.args, mm_processor_kwargs='{"do_pan_and_scan": true}')
    with pytest.raises(ValueError, match="--mm-processor-kwargs"):
        gemma3_image_prompts(args, core.loaded, core.runner, engine.tokenizer, directory, 4)
    shutil.copy(os.path.join(directory, "preprocessor_config.json"), tmp_path)
    config = json.loads((tmp_path / "preprocessor_config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        dict(config, do_pan_and_scan=True)))
    with pytest.raises(ValueError, match="^do_pan_and_scan: Gemma 3's pan-and-scan crops are "
                                         "not supported"):
        gemma3_image_prompts(core.args, core.loaded, core.runner, engine.tokenizer,
                             str(tmp_path), 4)
