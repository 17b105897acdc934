"""Gemma 3 with images through the OpenAI SDK (tests/gemma3_images.py's tiny checkpoint): a chat
with a base64 image between two text parts answered with transformers' greedy tokens, its image
tokens counted in usage; the placeholder and expansion as Gemma's chat template and
transformers' processor make them."""
import pytest

from tests.gemma3_images import IMAGE_TOKENS, hf_generate, make_tiny_gemma3_images, random_image
from tests.http.conftest import RunningServer
from tests.image_checks import chat_with_image


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
    out, _, _ = chat_with_image(server, "tiny-gemma3", random_image(80, 50, 21), hf_generate,
                                  model, directory)
    assert out.usage.prompt_tokens > IMAGE_TOKENS
