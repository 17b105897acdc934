"""Llama 4 with images through the OpenAI SDK (tests/llama4_images.py's tiny checkpoint): a chat
with a base64 image (tiled: 1 x 2 and the global tile) between two text parts answered with
transformers' greedy tokens, its image tokens counted in usage; the placeholder and expansion as
Llama 4's chat template and transformers' processor make them."""
import pytest
import torch

from tests.http.conftest import RunningServer
from tests.llama4_images import TILE_TOKENS, hf_generate, make_tiny_llama4_images, smooth_image
from tests.vision_models import image_chat

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tiny-llama4-images"))
    model = make_tiny_llama4_images(directory)
    running = RunningServer(directory, served_model_name="tiny-llama4", page_size=4,
                            chunked_prefill_size=16, max_prefill_tokens=24,
                            max_running_requests=4, context_length=128,
                            limit_mm_per_prompt='{"image": 2}')
    yield running, model
    running.close()


def test_a_base64_image_in_a_chat_is_answered_with_transformers_tokens(llama4):
    server, model = llama4
    image = smooth_image(30, 60, 21)
    messages, templated = image_chat(image, "what is in this picture", "describe it")
    tokenizer = server.ctx.tokenizer
    text = tokenizer.apply_chat_template(templated, tokenize=False, add_generation_prompt=True)
    images = server.ctx.core.features.images
    ids, _ = images.prepare(tokenizer.encode(text, add_special_tokens=False), [image])
    expected = hf_generate(model, ids, [image], NEW_TOKENS,
                           pixels=torch.tensor(images.processor(image)[0]))
    out = server.openai().chat.completions.create(
        model="tiny-llama4", messages=messages, max_tokens=NEW_TOKENS, temperature=0,
        extra_body={"ignore_eos": True})
    words = tokenizer.decode(expected, skip_special_tokens=True).split()
    assert out.choices[0].message.content.split() == words and words
    assert out.usage.prompt_tokens == len(ids) > 3 * TILE_TOKENS
