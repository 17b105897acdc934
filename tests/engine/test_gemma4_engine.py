"""Gemma 4's dense text model (a tiny random Gemma4ForCausalLM, tests/tiny_models.py: a sliding
layer of window 4 and a full one whose values are its keys' projection, soft-capped logits)
through the engine: prompts longer than the window, prefill chunks across its edge, continuous
batching and the prefix cache give transformers' greedy tokens with nothing compiled after the
precompile; on two devices (--tp-size 2: half of each layer's KV heads, the full layer's wider
and fewer) too, and its MoE block's form (--ep-size 2) (the checks:
tests/engine/family_engine.py). Its image checkpoints' form (Gemma4ForConditionalGeneration)
serves text prompts with transformers' own tokens beside its vision tower."""
from tests.engine.family_engine import (GREEDY, check_batched_equal_solo_and_transformers,
                                        check_cached_prefix, check_two_devices, family_fixtures)
from tests.engine.test_gemma3_engine import PROMPTS, SMALL
from tests.tiny_models import make_tiny_checkpoint, make_tiny_gemma4_conditional
from xlaserve.offline import Engine

checkpoint, engine = family_fixtures("gemma4", SMALL)


def test_batched_chunked_and_cached_greedy_requests_give_transformers_tokens(engine, checkpoint):
    """Batched requests equal their solo runs and transformers'; a prompt whose first 8 tokens
    come from the prefix cache gives transformers' tokens too."""
    check_batched_equal_solo_and_transformers(engine, checkpoint[1], PROMPTS, GREEDY)
    check_cached_prefix(engine, checkpoint[1], GREEDY)


def test_tensor_parallel_engine_gives_transformers_greedy_tokens(checkpoint):
    """--tp-size 2 on two CPU devices: half of each layer's KV heads (the sliding layer's 4 of
    16 wide, the full layer's 2 of 32), half the MLP and vocabulary each."""
    check_two_devices(checkpoint[0], checkpoint[1], PROMPTS, GREEDY, dict(SMALL, tp_size=2))


def test_the_moe_block_on_two_devices_gives_transformers_greedy_tokens(tmp_path):
    """gemma-4-26b-a4b's form (tests/tiny_models.py, "gemma4_moe": every layer's experts beside
    its dense MLP) on --tp-size 2 --ep-size 2: two experts a device, attention split by KV head;
    batched, chunked across the window's edge, transformers' greedy tokens."""
    hf_model = make_tiny_checkpoint(str(tmp_path), "gemma4_moe")
    check_two_devices(str(tmp_path), hf_model, PROMPTS, GREEDY, dict(SMALL, tp_size=2, ep_size=2))


def test_per_layer_embeddings_and_shared_kv_on_two_devices_give_transformers_tokens(tmp_path):
    """gemma-4-e2b's form ("gemma4_ple": per-layer embeddings, the last two of four layers
    reading the first two's KV caches, so the pool holds two layers' pages) on --tp-size 2:
    batched, chunked across the window's edge, transformers' greedy tokens."""
    hf_model = make_tiny_checkpoint(str(tmp_path), "gemma4_ple")
    check_two_devices(str(tmp_path), hf_model, PROMPTS, GREEDY, dict(SMALL, tp_size=2))


def test_an_image_checkpoint_serves_text_beside_its_vision_tower(tmp_path):
    """A Gemma4ForConditionalGeneration (transformers 5's save: `model.language_model.*`, its
    tower `model.vision_tower.*` read too, no processor config: transformers' defaults at 280
    tokens an image) gives transformers' greedy tokens on text prompts, chunked past the window,
    batched (its images: tests/vision/test_gemma4_images.py)."""
    hf_model = make_tiny_gemma4_conditional(str(tmp_path))
    with Engine(str(tmp_path), **SMALL) as engine:
        assert engine.core.features.images.encoder.buckets == (2048, 2520)
        check_batched_equal_solo_and_transformers(engine, hf_model, PROMPTS[:3], GREEDY)
