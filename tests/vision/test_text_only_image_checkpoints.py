"""An image checkpoint served for text (--limit-mm-per-prompt '{"image": 0}', vLLM's way of turning
images off): its decoder alone is read and held (no tower), what a vision model refuses opens again
(here NGRAM speculation), its text tokens are transformers' own, and a request with an image is
refused. Gemma 3's and Llama 4's image checkpoints (Gemma 4's take the same path); a Qwen-VL's
decoder needs its tower, refused by name (model/config/vision_config.text_only)."""
import pytest

from tests.engine.family_engine import GREEDY
from tests.hf_reference import hf_greedy
from tests.tiny_models import make_tiny_gemma3_conditional, make_tiny_llama4_conditional
from xlaserve.model.config.vision_config import text_only
from xlaserve.offline import Engine

PROMPTS = [[5, 17, 300, 42, 9, 77, 5, 17, 300, 42, 9, 77, 5, 17], [7, 8, 7, 8, 7, 8, 7]]
SMALL = dict(dtype="float32", skip_tokenizer_init=True, page_size=4, max_running_requests=8,
             chunked_prefill_size=8, max_prefill_tokens=12, context_length=64,
             max_total_tokens=512)


def _llama4_text(directory):  # transformers' Llama 4 generates text through its language model
    return make_tiny_llama4_conditional(directory).language_model


@pytest.mark.parametrize("make", [make_tiny_gemma3_conditional, _llama4_text],
                         ids=["gemma3", "llama4"])
def test_an_image_checkpoint_with_images_off_serves_its_decoder_with_drafts(make, tmp_path):
    hf_model = make(str(tmp_path))
    with Engine(str(tmp_path), limit_mm_per_prompt='{"image": 0}',
                speculative_algorithm="NGRAM", speculative_num_draft_tokens=4, **SMALL) as engine:
        runner = engine.core.runner
        assert runner.config.vision is None and not runner.takes_images  # no tower
        results = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        with pytest.raises(ValueError):
            engine.generate(input_ids=PROMPTS[0], image_data=b"not read",
                            sampling_params=GREEDY)
    for prompt, result in zip(PROMPTS, results):
        assert result["output_ids"] == hf_greedy(hf_model, prompt, GREEDY["max_new_tokens"])


def test_a_decoder_that_needs_its_tower_is_refused_text_only():
    class Tower:
        kind = "qwen2_5_vl"

    class Config:
        vision, architecture = Tower(), "Qwen2_5_VLForConditionalGeneration"

    with pytest.raises(ValueError, match="Qwen2_5_VLForConditionalGeneration's decoder is not "
                                         "served without its vision tower"):
        text_only(Config())
