"""Prompt (input) token logprobs: the step's target rows, the host collector over chunks and
retractions, and the engine / offline API against transformers' log_softmax."""
import asyncio
import queue

import numpy as np
import pytest
import torch

from tests.tiny_models import make_tiny_checkpoint
from xlaserve.runtime.executor.buckets import buckets_for_limits
from xlaserve.weights.loader import load_model
from xlaserve.offline import Engine
from xlaserve.runtime.executor.forward_batch import make_forward_batch
from xlaserve.runtime.scheduler.request import SeqChunk
from xlaserve.runtime.sampling.params import SamplingParams
from xlaserve.runtime.executor.model_runner import ModelRunner
from xlaserve.runtime.executor.step_inputs import SAMPLING_WIDTHS
from xlaserve.runtime.sampling.params import MAX_TOP_LOGPROBS
from xlaserve.runtime.sampling.prompt_logprobs import NO_TARGET, PromptLogprobCollector
from xlaserve.runtime.sampling.params import RowSamplingParams
from xlaserve.runtime.sampling.params import build_sampling_metadata

LONG_PROMPT = [400, 401, 17, 402, 403, 5, 404, 405, 406, 407, 300, 408, 409, 410, 411, 412, 413,
               414, 42, 415, 416, 417, 418, 419, 420, 421]  # 26 tokens: 4 chunks of at most 8
SHORT_PROMPT = [5, 17, 300, 42, 9, 77, 120]
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
SMALL = dict(dtype="float32", skip_tokenizer_init=True, page_size=4, max_running_requests=4,
             chunked_prefill_size=8, max_prefill_tokens=12, context_length=64)
ECHO = dict(return_logprob=True, logprob_start_len=0, top_logprobs_num=5)


def hf_log_softmax(hf_model, prompt_ids) -> torch.Tensor:
    """float32 [len, V]: row i is log p(. | prompt[:i + 1]) under transformers."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def assert_matches_transformers(hf_model, prompt_ids, token_logprobs, top_logprobs, top_n):
    expected = hf_log_softmax(hf_model, prompt_ids)
    assert len(token_logprobs) == len(top_logprobs) == len(prompt_ids)  # nothing twice
    assert token_logprobs[0] == (None, prompt_ids[0], None) and top_logprobs[0] is None
    for i in range(1, len(prompt_ids)):
        logprob, token, _ = token_logprobs[i]
        assert token == prompt_ids[i]
        assert logprob == pytest.approx(float(expected[i - 1, token]), abs=1e-4), i
        best = torch.topk(expected[i - 1], top_n)
        assert [t for _, t, _ in top_logprobs[i]] == best.indices.tolist(), i
        np.testing.assert_allclose([lp for lp, _, _ in top_logprobs[i]], best.values.numpy(),
                                   atol=1e-4)


# --- the host collector ---------------------------------------------------------------------


def test_collector_targets_cross_chunk_boundaries_and_a_recompute_fills_nothing_twice():
    prompt = [10, 11, 12, 13, 14, 15, 16]
    collector = PromptLogprobCollector(prompt, top_n=2)
    # The first chunk's last row targets the next chunk's first token; the prompt's last row
    # targets nothing (its next token is sampled).
    assert collector.targets(0, 4).tolist() == [11, 12, 13, 14]
    rows = np.arange(4, dtype=np.float32)
    collector.collect(0, -rows - 1, np.tile([[7, 8]], (4, 1)), np.full((4, 3), -0.5, np.float32))
    assert collector.num_collected == 5 and not collector.complete
    # Retracted, then recomputed from 0 (prompt + 2 outputs): only entries 5 and 6 are asked.
    assert collector.targets(0, 9).tolist() == [NO_TARGET] * 4 + [15, 16] + [NO_TARGET] * 3
    collector.collect(0, np.full(9, -9.0, np.float32), np.zeros((9, 2), np.int32),
                      np.zeros((9, 2), np.float32))
    assert collector.complete
    token_logprobs, top = collector.sglang_lists()
    assert [lp for lp, _, _ in token_logprobs] == [None, -1.0, -2.0, -3.0, -4.0, -9.0, -9.0]
    assert [t for _, t, _ in token_logprobs] == prompt
    assert top[0] is None and top[1] == [(-0.5, 7, None), (-0.5, 8, None)]


def test_rows_over_several_blocks_equal_numpy_log_softmax_and_no_target_rows_are_zero():
    import jax.numpy as jnp

    from xlaserve.runtime.sampling.prompt_logprobs import LOGPROB_BLOCK_ROWS, prompt_logprobs

    rng = np.random.default_rng(0)
    rows, width, vocab = 2 * LOGPROB_BLOCK_ROWS + 88, 16, 64  # 3 blocks, the last one padded
    hidden = rng.normal(size=(rows, width)).astype(np.float32)
    head = rng.normal(size=(width, vocab)).astype(np.float32)
    targets = rng.integers(0, vocab, rows).astype(np.int32)
    targets[::7] = NO_TARGET
    out = prompt_logprobs(lambda h: h @ jnp.asarray(head), jnp.asarray(hidden),
                          jnp.asarray(targets), 4)
    logits = (hidden @ head).astype(np.float64)
    expected = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    wanted = targets >= 0
    np.testing.assert_allclose(np.asarray(out.logprobs)[wanted],
                               expected[wanted, targets[wanted]], atol=1e-4)
    assert not np.any(np.asarray(out.logprobs)[~wanted])
    np.testing.assert_array_equal(np.asarray(out.top_ids), np.argsort(-expected, -1)[:, :4])
    np.testing.assert_allclose(np.asarray(out.top_logprobs), -np.sort(-expected, -1)[:, :4],
                               atol=1e-4)
    skipped = prompt_logprobs(lambda h: h @ jnp.asarray(head), jnp.asarray(hidden),
                              jnp.full(rows, NO_TARGET, jnp.int32), 4)
    assert not np.any(np.asarray(skipped.top_logprobs))


# --- the step -------------------------------------------------------------------------------

PAGE_SIZE = 4
BUCKETS = buckets_for_limits(max_tokens_per_step=16, max_seqs=4, max_pages_per_seq=8,
                             page_paddings=[8])


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("qwen3"))
    hf_model = make_tiny_checkpoint(directory, "qwen3")  # a separate LM head
    return load_model(directory, dtype="float32", skip_tokenizer_init=True, progress=False), hf_model


def _step(runner, chunks, slots):
    batch = make_forward_batch(chunks, BUCKETS, PAGE_SIZE)
    sampling = build_sampling_metadata([RowSamplingParams(temperature=0.0, seed=0)] * len(chunks),
                                       batch.shape[1], SAMPLING_WIDTHS)
    padded = np.zeros(batch.shape[1], np.int32)
    padded[:len(slots)] = slots
    return runner.step(batch, sampling, padded)


def test_step_returns_target_logprobs_of_every_row_and_compiles_nothing_new(qwen3):
    loaded, hf_model = qwen3
    runner = ModelRunner(loaded, num_pages=17, page_size=PAGE_SIZE, max_running_requests=4)
    runner.precompile(BUCKETS.all_shapes(), progress=False)
    compiled = runner.compile_count()
    pages = [list(range(1, 9)), list(range(9, 17))]
    other = [1, 2, 3]
    for slot, prompt in ((1, SHORT_PROMPT), (2, other)):
        runner.assign_slots([(slot, prompt, ())])

    # An ordinary step (no targets) skips the branch: zeros, in the same program.
    plain = _step(runner, [SeqChunk(other, 0, pages[1])], [2])
    assert not np.any(np.asarray(plain.prompt.logprobs))
    assert not np.any(np.asarray(plain.prompt.top_ids))
    # The prompt in two chunks (positions 0-3, then 4-6) beside the other sequence's decode.
    expected = hf_log_softmax(hf_model, SHORT_PROMPT)
    first = SeqChunk(SHORT_PROMPT[:4], 0, pages[0], sample=False, target_ids=SHORT_PROMPT[1:5])
    decode = SeqChunk([int(plain.sample.tokens[0])], 3, pages[1])
    out = _step(runner, [first, decode], [1, 2])
    second = SeqChunk(SHORT_PROMPT[4:], 4, pages[0], target_ids=SHORT_PROMPT[5:] + [NO_TARGET])
    out2 = _step(runner, [second], [1])
    logprobs = np.concatenate([np.asarray(out.prompt.logprobs)[:4],
                               np.asarray(out2.prompt.logprobs)[:2]])
    top_ids = np.concatenate([np.asarray(out.prompt.top_ids)[:4],
                              np.asarray(out2.prompt.top_ids)[:2]])
    top_logprobs = np.concatenate([np.asarray(out.prompt.top_logprobs)[:4],
                                   np.asarray(out2.prompt.top_logprobs)[:2]])
    for p in range(len(SHORT_PROMPT) - 1):
        assert logprobs[p] == pytest.approx(float(expected[p, SHORT_PROMPT[p + 1]]), abs=1e-4)
        best = torch.topk(expected[p], MAX_TOP_LOGPROBS)
        assert top_ids[p].tolist() == best.indices.tolist()
        np.testing.assert_allclose(top_logprobs[p], best.values.numpy(), atol=1e-4)
    assert float(np.asarray(out2.prompt.logprobs)[2]) == 0.0  # no target, no logprob
    # The decode row in the same step sampled what it samples alone.
    alone = ModelRunner(loaded, num_pages=17, page_size=PAGE_SIZE, max_running_requests=4)
    alone.assign_slots([(2, other, ())])
    first_token = _step(alone, [SeqChunk(other, 0, pages[1])], [2]).sample.tokens
    assert int(first_token[0]) == int(plain.sample.tokens[0])
    second_token = _step(alone, [decode], [2]).sample.tokens
    assert int(np.asarray(out.sample.tokens)[1]) == int(second_token[0])
    assert runner.compile_count() == compiled


# --- the engine and the offline API ---------------------------------------------------------


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("llama_tied"))
    return directory, make_tiny_checkpoint(directory, "llama_tied_linear")  # LM head = embedding


@pytest.fixture(scope="module")
def engine(tied):
    with Engine(tied[0], max_total_tokens=512, **SMALL) as engine:
        yield engine


def _submit(engine, prompt, **logprobs) -> queue.Queue:
    sink: queue.Queue = queue.Queue()
    engine.core.submit(prompt, SamplingParams(**GREEDY), sink.put, **logprobs)
    return sink


def _chunks(sink) -> list:
    chunks = [sink.get(timeout=120)]
    while not chunks[-1].finished:
        chunks.append(sink.get(timeout=120))
    return chunks


def test_generate_returns_prompt_logprobs_equal_to_transformers_over_chunk_boundaries(engine, tied):
    for prompt in (LONG_PROMPT, SHORT_PROMPT):
        result = engine.generate(input_ids=prompt, sampling_params=GREEDY, **ECHO)
        meta = result["meta_info"]
        assert_matches_transformers(tied[1], prompt, meta["input_token_logprobs"],
                                    meta["input_top_logprobs"], 5)
        assert len(meta["output_token_logprobs"]) == 6
    # Without top_logprobs_num only the chosen tokens' logprobs, as SGLang.
    bare = engine.generate(input_ids=SHORT_PROMPT, sampling_params=GREEDY, return_logprob=True,
                           logprob_start_len=0)["meta_info"]
    assert len(bare["input_token_logprobs"]) == len(SHORT_PROMPT)
    assert "input_top_logprobs" not in bare
    off = engine.generate(input_ids=SHORT_PROMPT, sampling_params=GREEDY, return_logprob=True)
    assert "input_token_logprobs" not in off["meta_info"]
    one = engine.generate(input_ids=[99], sampling_params=GREEDY, **ECHO)["meta_info"]
    assert one["input_token_logprobs"] == [(None, 99, None)] and one["input_top_logprobs"] == [None]


def test_a_request_beside_one_with_prompt_logprobs_is_unchanged_and_nothing_compiles(
        engine, tied, monkeypatch):
    alone = engine.generate(input_ids=SHORT_PROMPT, sampling_params=GREEDY)
    compiled = engine.core.runner.compile_count()
    added = []
    add = engine.core.scheduler.add
    monkeypatch.setattr(engine.core.scheduler, "add", lambda r: (added.append(r), add(r)))
    echo_sink = _submit(engine, LONG_PROMPT, return_logprob=True, top_logprobs_num=3,
                        return_prompt_logprob=True)
    plain_sink = _submit(engine, SHORT_PROMPT)
    echo, plain = _chunks(echo_sink), _chunks(plain_sink)
    assert [c.token_id for c in plain] == alone["output_ids"]
    assert all(c.input_token_logprobs is None for c in plain)
    assert plain[-1].finish.input_token_logprobs is None
    # Delivered once, with the first output chunk, and again in the final meta_info.
    assert echo[0].input_token_logprobs is not None
    assert all(c.input_token_logprobs is None for c in echo[1:])
    assert echo[-1].finish.input_token_logprobs == echo[0].input_token_logprobs
    assert_matches_transformers(tied[1], LONG_PROMPT, echo[0].input_token_logprobs,
                                echo[0].input_top_logprobs, 3)
    assert engine.core.runner.compile_count() == compiled
    # Every prompt row must be computed: a prefix cache may not serve this request.
    assert [r.no_prefix_reuse for r in added] == [True, False]


def test_streaming_carries_prompt_logprobs_in_meta_info_and_bad_start_is_refused(engine, tied):
    async def stream():
        chunks = await engine.async_generate(input_ids=SHORT_PROMPT, sampling_params=GREEDY,
                                             stream=True, **ECHO)
        return [c async for c in chunks]

    last = asyncio.run(stream())[-1]
    assert_matches_transformers(tied[1], SHORT_PROMPT, last["meta_info"]["input_token_logprobs"],
                                last["meta_info"]["input_top_logprobs"], 5)
    with pytest.raises(ValueError, match="logprob_start_len=3"):
        engine.generate(input_ids=SHORT_PROMPT, sampling_params=GREEDY, return_logprob=True,
                        logprob_start_len=3)


def test_retracted_requests_report_each_prompt_token_once(tied, caplog):
    import logging

    prompts = [LONG_PROMPT, SHORT_PROMPT, LONG_PROMPT[::-1], [7, 7, 7, 7, 7, 7, 7]]
    params = {**GREEDY, "max_new_tokens": 12}
    with Engine(tied[0], max_total_tokens=48, disable_precompile=True, **SMALL) as small:
        with caplog.at_level(logging.INFO):
            results = small.generate(input_ids=prompts, sampling_params=params, **ECHO)
        assert "Retract requests" in caplog.text
        assert small.core.scheduler.token_usage() == 0
    for prompt, result in zip(prompts, results, strict=True):
        meta = result["meta_info"]
        assert_matches_transformers(tied[1], prompt, meta["input_token_logprobs"],
                                    meta["input_top_logprobs"], 5)
        assert len(result["output_ids"]) == 12
