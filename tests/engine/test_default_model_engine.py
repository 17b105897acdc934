"""The engine on the embedded default model (SmolLM2-135M GGUF) with float32 activations
(--quantized-activations float32): chat prompts run together, with staggered arrivals and chunked
prefill, give each prompt's solo greedy output, which equals transformers' greedy generation on
the same GGUF. (The default q8 activations round each matmul's input to 8 bits as llama.cpp
does, and transformers' tokens are no longer the reference: tests/kernels/test_cpu_q8_gemm.py
checks their numerics, tests/weights/test_gguf_kept.py a q8 engine's batches.)"""
import threading
import time

import pytest

from tests.hf_reference import default_model_in_transformers, hf_greedy
from xlaserve.offline import Engine
from xlaserve.runtime.sampling.params import SamplingParams


QUESTIONS = ["List 3 countries and their capitals.", "What is 7 times 8?",
             "Write a haiku about the sea.", "Name two primary colors."]
NEW_TOKENS = 20
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine():
    # Two step shapes (8 and 64 tokens, 4 sequences), so the test compiles two programs.
    with Engine(None, max_running_requests=4, chunked_prefill_size=24, max_prefill_tokens=48,
                precompile_token_paddings="8,64", max_total_tokens=1024, context_length=512,
                quantized_activations="float32", log_level="warning") as engine:
        yield engine


@pytest.fixture(scope="module")
def prompts(engine):
    return [engine.tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                 add_generation_prompt=True, return_dict=False)
            for q in QUESTIONS]


def test_default_model_batched_staggered_greedy_equals_solo_and_transformers(engine, prompts):
    """Requests arriving 0.3 s apart, while earlier ones prefill or decode, each give their solo
    greedy tokens, which are transformers' own. Over 20 s: the module's default-model engine
    starts here (load, precompile), and transformers decodes each prompt on the CPU."""
    results = [None] * len(prompts)

    def run(i):
        results[i] = engine.generate(input_ids=prompts[i], sampling_params=GREEDY)

    threads = []
    for i in range(len(prompts)):  # arrivals while earlier requests are prefilling or decoding
        threads.append(threading.Thread(target=run, args=(i,)))
        threads[-1].start()
        time.sleep(0.3)
    for thread in threads:
        thread.join()

    hf_model = default_model_in_transformers()
    for prompt, result in zip(prompts, results, strict=True):
        solo = engine.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"]
        expected = hf_greedy(hf_model, prompt, NEW_TOKENS)
        assert solo == expected, ("solo", engine.tokenizer.decode(solo), engine.tokenizer.decode(expected))
        assert result["output_ids"] == solo, ("batched", result["text"], engine.tokenizer.decode(solo))
    assert results[0]["text"] == engine.tokenizer.decode(results[0]["output_ids"])
    assert engine.core.runner.compile_count() == 2  # nothing compiled after precompile


def test_stop_string_ends_the_request_where_it_matches(engine, prompts):
    # With overlap on (the default), the step after the one that completes the stop string is
    # already running when the detokenizer sees it: that step's token must not leak out.
    full = engine.generate(input_ids=prompts[0], sampling_params=GREEDY)
    text = full["text"]
    stop = text[len(text) // 2:len(text) // 2 + 4]
    result = engine.generate(input_ids=prompts[0], sampling_params={**GREEDY, "stop": [stop]})
    assert result["text"] == text[:text.index(stop)]
    assert result["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    n = result["meta_info"]["completion_tokens"]
    assert result["output_ids"] == full["output_ids"][:n] and n < NEW_TOKENS
    assert engine.core.scheduler.token_usage() == 0 or engine.core.scheduler.has_work()


def test_chunks_are_made_off_the_engine_loop_and_a_stop_string_frees_the_request_first(
        engine, prompts):
    # The output thread detokenizes and finds the stop string; the loop must have ended the
    # request (slot and pages free) before its final chunk goes out, and nothing follows it.
    text = engine.generate(input_ids=prompts[1], sampling_params=GREEDY)["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    seen, done = [], threading.Event()

    def emit(chunk):
        seen.append((threading.current_thread().name, chunk, engine.core.scheduler.num_running))
        if chunk.finished:
            done.set()

    engine.core.submit(prompts[1], SamplingParams(**GREEDY, stop=[stop]), emit)
    assert done.wait(60)
    time.sleep(0.5)  # a chunk after the final one would arrive by now
    assert {name for name, _, _ in seen} == {"xlaserve-output"}
    assert [chunk.finished for _, chunk, _ in seen].count(True) == 1 and seen[-1][1].finished
    assert seen[-1][2] == 0  # the request had left the scheduler
    assert "".join(chunk.text for _, chunk, _ in seen) == text[:text.index(stop)]
    assert seen[-1][1].finish.meta_info()["finish_reason"] == {"type": "stop", "matched": stop}
