"""Gemma 3 with images through the OpenAI SDK (tests/gemma3_images.py's tiny checkpoint): a chat
with a base64 image between two text parts answered with transformers' greedy tokens, its image
tokens counted in usage; the placeholder and expansion as Gemma's chat template and
transformers' processor make them."""
import pytest

from tests.gemma3_images import IMAGE_TOKENS, hf_generate, make_tiny_gemma3_images, random_image
from tests.http.conftest import RunningServer
from tests.vision_models import image_chat

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tiny-gemma3-images"))
    model = make_tiny_gemma3_images(directory)
    running = RunningServer(directory, served_model_name="tiny-gemma3", page_size=4,
                            chunked_prefill_size=20, max_prefill_tokens=24,
                            max_running_requests=4, context_length=128,
                            limit_mm_per_prompt='{"image": 2}')
    yield running, model, directory
    running.close()


def test_a_base64_image_in_a_chat_is_answered_with_transformers_tokens(gemma3):
    server, model, directory = gemma3
    image = random_image(80, 50, 21)
    messages, templated = image_chat(image, "what is in this picture", "describe it")
    tokenizer = server.ctx.tokenizer
    text = tokenizer.apply_chat_template(templated, tokenize=False, add_generation_prompt=True)
    ids, _ = server.ctx.core.features.images.prepare(
        tokenizer.encode(text, add_special_tokens=False), [image])
    expected = hf_generate(model, directory, ids, [image], NEW_TOKENS)
    out = server.openai().chat.completions.create(
        model="tiny-gemma3", messages=messages, max_tokens=NEW_TOKENS, temperature=0,
        extra_body={"ignore_eos": True})
    words = tokenizer.decode(expected, skip_special_tokens=True).split()
    assert out.choices[0].message.content.split() == words and words
    assert out.usage.prompt_tokens == len(ids) > IMAGE_TOKENS
