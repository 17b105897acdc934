"""Llama 4's text model (a tiny random Llama4ForCausalLM, tests/tiny_models.py: RoPE and NoPE
layers, dense and MoE ones, an attention chunk of 32) through the engine: continuous batching,
chunked prefill and the prefix cache give transformers' greedy tokens with nothing compiled after
the precompile; on two devices (--tp-size 2) too (the checks: tests/engine/family_engine.py).
Contexts cross the attention chunk: prompts past it, prefill chunks of 7 across its edge,
continuations decoded across it (the RoPE layers then see their own chunk alone). Its image
checkpoints' form (Llama4ForConditionalGeneration) serves text with transformers' tokens; its
images: tests/vision/test_llama4_images.py."""
import pytest

from tests.engine.family_engine import (GREEDY, check_batched_equal_solo_and_transformers,
                                        check_cached_prefix, check_two_devices, family_fixtures)
from tests.tiny_models import make_tiny_llama4_conditional
from xlaserve.offline import Engine

# Past the chunk of 32: a 40-token prompt (its chunked prefill crosses 32), a 26-token one whose
# continuation crosses it, a 70-token one into the third chunk; and short ones within the first.
# The NoPE layers' temperature grows every 4 positions (floor_scale 4).
PROMPTS = [
    [5, 17, 300, 42, 9, 77, 120, 3, 250, 11, 64, 8, 91, 13, 200, 201, 7, 8] * 2 + [1, 2, 3, 4],
    [1, 2],
    [(11 * i) % 500 + 1 for i in range(26)],
    [400 + i for i in range(70)],
    [99, 98, 97, 96, 95],
]
SMALL = dict(dtype="float32", skip_tokenizer_init=True, page_size=4, max_running_requests=4,
             chunked_prefill_size=7, max_prefill_tokens=12, context_length=96,
             max_total_tokens=512)


checkpoint, engine = family_fixtures("llama4", SMALL)


def test_batched_chunked_greedy_requests_equal_solo_runs_and_transformers(engine, checkpoint):
    check_batched_equal_solo_and_transformers(engine, checkpoint[1], PROMPTS, GREEDY)


def test_a_prompt_that_reuses_cached_pages_gives_the_same_tokens(engine, checkpoint):
    check_cached_prefix(engine, checkpoint[1], GREEDY)


def test_tensor_parallel_engine_gives_transformers_greedy_tokens(checkpoint):
    """--tp-size 2 on two CPU devices: a kv head, half the experts' and MLPs' width each."""
    check_two_devices(checkpoint[0], checkpoint[1], PROMPTS, GREEDY, dict(SMALL, tp_size=2))


def test_expert_parallel_engine_gives_transformers_greedy_tokens(checkpoint):
    """--tp-size 2 --ep-size 2: two of the MoE layers' four experts a device (the top-1 router's
    choice scaling the expert's input, moe.expert_parallel), the shared expert split by width."""
    check_two_devices(checkpoint[0], checkpoint[1], PROMPTS, GREEDY,
                      dict(SMALL, tp_size=2, ep_size=2))


def test_an_image_checkpoint_serves_text_and_without_a_tokenizer_refuses_images(tmp_path):
    """A Llama4ForConditionalGeneration (transformers 5's save: `language_model.model.*`) gives
    transformers' greedy tokens on text prompts, batched and chunked; without its tokenizer
    (--skip-tokenizer-init: an image's prompt needs its marker tokens) image_data is refused.
    The oracle is its `language_model` (the Llama4ForCausalLM its forward runs on text):
    transformers 5.24's Llama4ForConditionalGeneration.forward fails on text alone (it reads
    `image_outputs` from the text model's output)."""
    hf_model = make_tiny_llama4_conditional(str(tmp_path)).language_model
    with Engine(str(tmp_path), **SMALL) as engine:
        check_batched_equal_solo_and_transformers(engine, hf_model, PROMPTS[:3], GREEDY)
        with pytest.raises(ValueError, match="whose images this server runs"):
            engine.generate(input_ids=PROMPTS[1], image_data=b"not read", sampling_params=GREEDY)
