"""Gemma 4 with images through the OpenAI SDK (tests/gemma4_images.py's tiny checkpoint,
gemma-4-31b's form): a chat with a base64 image between two text parts answered with
transformers' greedy tokens, its image tokens (as many as the image's aspect ratio gives)
counted in usage; an audio part refused by name."""
import openai
import pytest

from tests.gemma4_images import IMAGE_TOKENS, hf_generate, make_tiny_gemma4_images, random_image
from tests.http.conftest import RunningServer
from tests.image_checks import chat_with_image


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tiny-gemma4-images"))
    model = make_tiny_gemma4_images(directory)
    running = RunningServer(directory, served_model_name="tiny-gemma4", page_size=4,
                            chunked_prefill_size=80, max_prefill_tokens=96,
                            max_running_requests=4, context_length=256,
                            limit_mm_per_prompt='{"image": 2}')
    yield running, model, directory
    running.close()


def test_a_base64_image_in_a_chat_is_answered_with_transformers_tokens(gemma4):
    server, model, directory = gemma4
    out, ids, prompt_images = chat_with_image(server, "tiny-gemma4", random_image(80, 50, 21),
                                              hf_generate, model, directory)
    assert prompt_images.num_image_tokens < IMAGE_TOKENS  # 80 x 50 pixels: 60 tokens
    assert out.usage.prompt_tokens > prompt_images.num_image_tokens
    audio = {"role": "user", "content": [{"type": "input_audio",
                                          "input_audio": {"data": "AAAA", "format": "wav"}}]}
    with pytest.raises(openai.BadRequestError, match="input_audio"):
        server.openai().chat.completions.create(model="tiny-gemma4", messages=[audio],
                                                max_tokens=1)
