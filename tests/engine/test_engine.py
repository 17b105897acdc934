"""The engine end to end on a tiny model: continuous batching equals solo runs, retraction,
abort, no compiles after precompile, seeds, the offline API, the prefix cache (on by default)."""
import asyncio
import logging
import threading
import time

import numpy as np
import pytest

from tests.hf_reference import hf_greedy
from tests.tiny_models import make_tiny_checkpoint
from xlaserve.offline import Engine
from xlaserve.runtime.sampling.params import SamplingParams

PROMPTS = [
    [5, 17, 300, 42, 9, 77, 120, 3, 250, 11, 64, 8, 91, 13],
    [1, 2],
    [400, 401, 402, 403, 404, 405, 406, 407, 408, 409, 410, 411, 412, 413, 414, 415, 416, 417, 418,
     419, 420, 421, 422, 423, 424, 425],
    [99],
    [7, 7, 7, 7, 7, 7, 7],
    [33, 44, 55, 66],
]
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
SMALL = dict(dtype="float32", skip_tokenizer_init=True, page_size=4, max_running_requests=4,
             chunked_prefill_size=8, max_prefill_tokens=12, context_length=64)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("llama"))
    hf_model = make_tiny_checkpoint(directory, "llama")
    return directory, hf_model


@pytest.fixture(scope="module")
def engine(checkpoint):
    with Engine(checkpoint[0], max_total_tokens=512, **SMALL) as engine:
        yield engine


def test_concurrent_greedy_requests_equal_solo_runs_and_transformers(engine, checkpoint):
    together = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    for prompt, result in zip(PROMPTS, together, strict=True):
        solo = engine.generate(input_ids=prompt, sampling_params=GREEDY)
        assert result["output_ids"] == solo["output_ids"] == hf_greedy(checkpoint[1], prompt, 12)
        assert result["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
        assert result["meta_info"]["prompt_tokens"] == len(prompt)
        assert result["meta_info"]["completion_tokens"] == 12


def test_staggered_arrivals_join_the_running_batch(engine):
    expected = [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in PROMPTS]
    results = [None] * len(PROMPTS)

    def run(i):
        time.sleep(0.05 * i)
        results[i] = engine.generate(input_ids=PROMPTS[i], sampling_params=GREEDY)["output_ids"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == expected


def test_no_compile_after_precompile_during_a_mixed_workload(engine):
    compiled = engine.core.runner.compile_count()
    engine.generate(input_ids=PROMPTS + PROMPTS[:3], sampling_params=[
        {**GREEDY, "max_new_tokens": 3 + i} for i in range(len(PROMPTS) + 3)])
    engine.generate(input_ids=PROMPTS[0], sampling_params={"temperature": 0.7, "seed": 3, "max_new_tokens": 8,
                                                          "logit_bias": {5: 2.0, 6: -1.0}})
    assert engine.core.runner.compile_count() == compiled


def test_seeded_sampling_is_the_same_whatever_else_is_in_the_batch(engine):
    params = {"max_new_tokens": 10, "temperature": 1.0, "seed": 1234, "ignore_eos": True}
    alone = engine.generate(input_ids=PROMPTS[0], sampling_params=params)["output_ids"]
    crowd = engine.generate(input_ids=[PROMPTS[0]] + PROMPTS[1:4],
                            sampling_params=[params] + [{"temperature": 1.0, "max_new_tokens": 10}] * 3)
    assert crowd[0]["output_ids"] == alone
    other_seed = engine.generate(input_ids=PROMPTS[0], sampling_params={**params, "seed": 99})
    assert other_seed["output_ids"] != alone


def test_stop_token_ids_and_min_new_tokens(engine):
    free = engine.generate(input_ids=PROMPTS[2], sampling_params=GREEDY)["output_ids"]
    stop_at = free[3]
    stopped = engine.generate(input_ids=PROMPTS[2], sampling_params={**GREEDY, "stop_token_ids": [stop_at]})
    assert stopped["output_ids"] == free[:free.index(stop_at) + 1]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}
    late = engine.generate(input_ids=PROMPTS[2], sampling_params={
        **GREEDY, "stop_token_ids": [stop_at], "min_new_tokens": 12})
    assert late["meta_info"]["completion_tokens"] == 12 and stop_at not in late["output_ids"]


def test_tiny_page_pool_retracts_and_still_finishes_every_request_correctly(checkpoint, caplog):
    with Engine(checkpoint[0], max_total_tokens=48, disable_precompile=True, **SMALL) as small:
        with caplog.at_level(logging.INFO):
            results = small.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert "Retract requests" in caplog.text
        assert small.core.scheduler.token_usage() == 0
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert result["output_ids"] == hf_greedy(checkpoint[1], prompt, 12)


def test_overlapped_steps_give_what_steps_read_one_at_a_time_give(engine, checkpoint):
    # With overlap (the default), a decode step is dispatched before the host has read the step
    # that samples its input token; every sampling parameter must come out as without it.
    free = engine.generate(input_ids=PROMPTS[2], sampling_params=GREEDY)["output_ids"]
    params = [
        {"max_new_tokens": 11, "temperature": 1.0, "seed": 5, "top_k": 20, "ignore_eos": True,
         "frequency_penalty": 0.5, "repetition_penalty": 1.2},
        {"max_new_tokens": 12, "temperature": 0.8, "seed": 6, "top_p": 0.9, "min_p": 0.05,
         "presence_penalty": 0.7, "ignore_eos": True},
        {**GREEDY, "stop_token_ids": [free[3]]},  # ends on a stop id: one row too many in flight
        {**GREEDY, "stop_token_ids": [free[3]], "min_new_tokens": 6},
        {**GREEDY, "max_new_tokens": 1},
        {**GREEDY, "max_new_tokens": 2, "logit_bias": {"7": 5.0}},
    ]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[2], PROMPTS[3], PROMPTS[4]]
    continuations = []
    original = engine.core.scheduler.schedule_continuation

    def counting(batch):
        following = original(batch)
        continuations.append(following is not None)
        return following

    engine.core.scheduler.schedule_continuation = counting
    try:
        overlapped = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True,
                                     top_logprobs_num=3)
    finally:
        del engine.core.scheduler.schedule_continuation
    assert sum(continuations) >= 3  # the others waited for admissions (4 run at once)
    with Engine(checkpoint[0], max_total_tokens=512, disable_overlap_schedule=True,
                **SMALL) as serial_engine:
        serial = serial_engine.generate(input_ids=prompts, sampling_params=params,
                                        return_logprob=True, top_logprobs_num=3)
    for a, b in zip(overlapped, serial, strict=True):
        assert a["output_ids"] == b["output_ids"]
        assert a["meta_info"]["finish_reason"] == b["meta_info"]["finish_reason"]
        np.testing.assert_allclose([x[0] for x in a["meta_info"]["output_token_logprobs"]],
                                   [x[0] for x in b["meta_info"]["output_token_logprobs"]],
                                   rtol=1e-5, atol=1e-5)
        assert [[t for _, t, _ in top] for top in a["meta_info"]["output_top_logprobs"]] == \
            [[t for _, t, _ in top] for top in b["meta_info"]["output_top_logprobs"]]
    assert overlapped[2]["meta_info"]["finish_reason"] == {"type": "stop", "matched": free[3]}
    assert len(overlapped[3]["output_ids"]) >= 6
    assert engine.core.scheduler.token_usage() == 0


def test_abort_mid_stream_frees_the_pages(engine):
    async def consume_three():
        stream = await engine.async_generate(input_ids=PROMPTS[0], sampling_params={
            **GREEDY, "max_new_tokens": 40}, stream=True)
        seen = []
        async for chunk in stream:
            seen.append(chunk)
            if len(seen) == 3:
                break
        await stream.aclose()
        return seen

    seen = asyncio.run(consume_three())
    assert len(seen) == 3 and not seen[-1]["finished"]
    deadline = time.time() + 10
    while engine.core.scheduler.token_usage() != 0 and time.time() < deadline:
        time.sleep(0.05)
    assert engine.core.scheduler.token_usage() == 0


def test_bad_sampling_params_are_rejected_before_queueing(engine):
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(input_ids=[1, 2], sampling_params={"top_p": 0})
    with pytest.raises(ValueError, match="unknown sampling parameters"):
        engine.generate(input_ids=[1, 2], sampling_params={"topp": 0.5})
    with pytest.raises(ValueError, match="512"):
        engine.generate(input_ids=[1, 600], sampling_params=GREEDY)
    with pytest.raises(ValueError, match="64"):
        engine.generate(input_ids=[1] * 60, sampling_params=GREEDY)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        engine.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 0})
    with pytest.raises(ValueError, match="stop_token_ids takes at most 64"):
        engine.generate(input_ids=[1, 2], sampling_params={"stop_token_ids": list(range(65))})
    with pytest.raises(ValueError, match="plus the model's EOS ids come to 65"):  # EOS is not in 3..66
        engine.generate(input_ids=[1, 2], sampling_params={"stop_token_ids": list(range(3, 67))})
    assert np.all(np.asarray(engine.generate(input_ids=[1, 2], sampling_params=GREEDY)["output_ids"]) >= 0)


def test_a_consumer_that_raises_is_dropped_and_the_engine_keeps_serving(engine):
    # What an asyncio consumer does once its event loop has closed: every emit raises.
    calls = []

    def closed_loop(chunk):
        calls.append(chunk)
        raise RuntimeError("Event loop is closed")

    expected = engine.generate(input_ids=PROMPTS[1], sampling_params=GREEDY)["output_ids"]
    engine.core.submit(PROMPTS[0], SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True),
                       closed_loop)
    deadline = time.time() + 30
    while (not calls or engine.core.scheduler.token_usage() != 0) and time.time() < deadline:
        time.sleep(0.05)
    assert len(calls) == 1 and engine.core.scheduler.token_usage() == 0
    assert engine.core.is_alive()
    assert engine.generate(input_ids=PROMPTS[1], sampling_params=GREEDY)["output_ids"] == expected


def test_a_duplicate_request_id_fails_alone(engine):
    import queue

    first, second = queue.Queue(), queue.Queue()
    params = SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True)
    engine.core.submit(PROMPTS[0], params, first.put, rid="same-id")
    engine.core.submit(PROMPTS[1], params, second.put, rid="same-id")
    rejected = second.get(timeout=30)
    assert rejected.finished and "already in use" in rejected.error
    chunks = [first.get(timeout=60)]
    while not chunks[-1].finished:
        chunks.append(first.get(timeout=60))
    assert chunks[-1].error is None and len([c for c in chunks if c.token_id is not None]) == 30


def test_a_stopped_engine_refuses_requests_instead_of_hanging(checkpoint):
    stopped = Engine(checkpoint[0], max_total_tokens=64, disable_precompile=True, **SMALL)
    stopped.shutdown()
    with pytest.raises(RuntimeError, match="not running"):
        stopped.generate(input_ids=[1, 2], sampling_params=GREEDY)


def test_logprobs_of_chosen_tokens_and_top_alternatives_match_transformers(engine, checkpoint):
    import torch

    plain = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
    result = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, return_logprob=True,
                             top_logprobs_num=3)
    assert result["output_ids"] == plain["output_ids"]
    assert "output_token_logprobs" not in plain["meta_info"]
    chosen = result["meta_info"]["output_token_logprobs"]
    top = result["meta_info"]["output_top_logprobs"]
    assert [token for _, token, _ in chosen] == result["output_ids"]
    with torch.no_grad():
        logits = checkpoint[1](torch.tensor([PROMPTS[0] + result["output_ids"]])).logits[0].double()
    expected = torch.log_softmax(logits, dim=-1)[len(PROMPTS[0]) - 1:-1]  # the rows that predicted
    for i, ((logprob, token, _), alternatives) in enumerate(zip(chosen, top, strict=True)):
        assert logprob == pytest.approx(float(expected[i, token]), abs=1e-4)
        assert len(alternatives) == 3 and alternatives[0][1] == token  # greedy: the best one
        best = torch.topk(expected[i], 3)
        assert [t for _, t, _ in alternatives] == best.indices.tolist()
        np.testing.assert_allclose([lp for lp, _, _ in alternatives], best.values.numpy(), atol=1e-4)
    with pytest.raises(ValueError, match="top_logprobs_num"):
        engine.generate(input_ids=[1, 2], sampling_params=GREEDY, top_logprobs_num=21)


# --- the prefix cache (on in `engine`) --------------------------------------------------------------

SYSTEM = [5, 17, 300, 42, 9, 77, 120, 3, 250, 11, 64, 8]  # 3 whole pages of 4


@pytest.fixture(scope="module")
def uncached_engine(checkpoint):
    with Engine(checkpoint[0], max_total_tokens=512, disable_precompile=True,
                disable_radix_cache=True, **SMALL) as engine:
        yield engine


def test_multi_turn_prompts_reuse_the_cache_with_the_same_greedy_outputs(engine, uncached_engine,
                                                                          checkpoint):
    engine.core.flush_cache()
    turn1 = SYSTEM + [91, 13, 400, 401, 402, 403, 404, 405]  # 20 tokens
    first = engine.generate(input_ids=turn1, sampling_params=GREEDY)
    turn2 = turn1 + first["output_ids"] + [33, 44, 55, 66, 7, 7]  # 38 tokens
    second = engine.generate(input_ids=turn2, sampling_params=GREEDY)
    other = engine.generate(input_ids=SYSTEM + [99, 98, 97], sampling_params=GREEDY)
    # turn 1 computed 20 + 11 tokens (its last sampled token never enters the cache): 7 pages.
    assert [r["meta_info"]["cached_tokens"] for r in (first, second, other)] == [0, 28, 12]
    for prompt, result in [(turn1, first), (turn2, second), (SYSTEM + [99, 98, 97], other)]:
        plain = uncached_engine.generate(input_ids=prompt, sampling_params=GREEDY)
        assert plain["meta_info"]["cached_tokens"] == 0
        assert result["output_ids"] == plain["output_ids"] == hf_greedy(checkpoint[1], prompt, 12)


def test_seeded_samples_of_one_prompt_prefill_it_once_and_sample_as_without_the_cache(
        engine, uncached_engine):
    engine.core.flush_cache()
    prompt = SYSTEM + [1, 2, 3, 4, 5, 6, 7, 8]  # 20 tokens: 16 reusable, the last page recomputed
    params = {"n": 3, "max_new_tokens": 10, "temperature": 1.0, "seed": 7, "ignore_eos": True,
              "frequency_penalty": 0.5}
    cached = engine.generate(input_ids=prompt, sampling_params=params)
    plain = uncached_engine.generate(input_ids=prompt, sampling_params=params)
    assert [r["output_ids"] for r in cached] == [r["output_ids"] for r in plain]
    assert len({tuple(r["output_ids"]) for r in cached}) == 3  # seeds 7, 8, 9 differ
    assert [r["meta_info"]["cached_tokens"] for r in cached] == [0, 16, 16]


def test_flush_cache_brings_an_idle_pool_back_to_zero(engine):
    engine.core.flush_cache()
    engine.generate(input_ids=PROMPTS[2], sampling_params=GREEDY)
    allocator = engine.core.scheduler.allocator
    # 26 + 11 computed tokens: 9 whole pages stay cached, though no request uses them.
    assert engine.core.scheduler.token_usage() == 0 and allocator.num_used == 9
    assert engine.core.flush_cache() == 9
    assert allocator.num_used == 0 and allocator.usage() == 0
