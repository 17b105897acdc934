"""Gemma 3's text model (a tiny random Gemma3ForCausalLM, tests/tiny_models.py: a sliding layer
of window 4 and a full layer, each with its own RoPE) through the engine: prompts longer than the
window, prefill chunks that cross the window's edge, continuous batching and the prefix cache
give transformers' greedy tokens with nothing compiled after the precompile; on two devices
(--tp-size 2: a kv head each) too (the checks: tests/engine/family_engine.py). Its image
checkpoints' form (Gemma3ForConditionalGeneration) serves text prompts with transformers' own
tokens; without its tokenizer it refuses images (their prompts: tests/vision/test_gemma3_images.py)."""
import pytest

from tests.engine.family_engine import (GREEDY, check_batched_equal_solo_and_transformers,
                                        check_cached_prefix, check_two_devices, family_fixtures)
from tests.tiny_models import make_tiny_gemma3_conditional
from xlaserve.offline import Engine

PROMPTS = [
    [5, 17, 300, 42, 9, 77, 120, 3, 250, 11, 64, 8, 91, 13, 200, 201, 7, 8, 9, 10, 11, 12, 13],
    [1, 2],
    [400, 401, 402, 403, 404, 405, 406, 407, 408, 409, 410, 411, 412, 413],
    [99, 98, 97, 96, 95],
]
# Prefill chunks of 7 tokens at most on pages of 4: a long prompt's chunks end off the window's
# edge and off a page's, and each later chunk reads its window partly from the cache.
SMALL = dict(dtype="float32", skip_tokenizer_init=True, page_size=4, max_running_requests=4,
             chunked_prefill_size=7, max_prefill_tokens=12, context_length=64,
             max_total_tokens=512)


checkpoint, engine = family_fixtures("gemma3", SMALL)


def test_batched_chunked_greedy_requests_equal_solo_runs_and_transformers(engine, checkpoint):
    check_batched_equal_solo_and_transformers(engine, checkpoint[1], PROMPTS, GREEDY)


def test_a_prompt_that_reuses_cached_pages_gives_the_same_tokens(engine, checkpoint):
    """The second prompt's first 8 tokens come from the cache: its sliding layer's window
    reaches back into them, its full layer reads them all."""
    check_cached_prefix(engine, checkpoint[1], GREEDY)


def test_tensor_parallel_engine_gives_transformers_greedy_tokens(checkpoint):
    """--tp-size 2 on two CPU devices: a kv head and half the MLP and vocabulary each."""
    check_two_devices(checkpoint[0], checkpoint[1], PROMPTS, GREEDY, dict(SMALL, tp_size=2))


def test_an_image_checkpoint_serves_text_and_without_its_tokenizer_refuses_images(tmp_path):
    """A Gemma3ForConditionalGeneration (transformers 5's save: `language_model.model.*`) gives
    transformers' greedy tokens on text prompts, chunked past the window, batched; with
    --skip-tokenizer-init image_data is refused (an image's prompt needs its newline tokens),
    as the start-up warning says."""
    hf_model = make_tiny_gemma3_conditional(str(tmp_path))
    with Engine(str(tmp_path), **SMALL) as engine:
        check_batched_equal_solo_and_transformers(engine, hf_model, PROMPTS[:3], GREEDY)
        with pytest.raises(ValueError, match="whose images this server runs"):
            engine.generate(input_ids=PROMPTS[1], image_data=b"not read", sampling_params=GREEDY)
