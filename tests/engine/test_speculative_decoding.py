"""Speculative decoding (NGRAM) end to end on a tiny model: every output, greedy or seeded
sampled, stop ids, lengths and logprobs, equals what the same engine gives without speculation,
in batches that mix verified rows with plain ones; nothing compiles while serving, pages come
back, an abort mid-stream is clean. The host side alone: tests/scheduler/test_speculation.py."""
import asyncio
import time

import numpy as np
import pytest

from tests.hf_reference import hf_greedy
from tests.tiny_models import make_tiny_checkpoint
from xlaserve.offline import Engine


# Prompts that repeat themselves, so the drafter finds matches from the first output token on.
PROMPTS = [
    [5, 17, 300, 42, 9, 77, 5, 17, 300, 42, 9, 77, 5, 17],
    [7, 8, 7, 8, 7, 8, 7],
    [400, 401, 402, 403, 404, 405, 406, 400, 401, 402],
    [99, 98],
]
GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
# A step with drafts holds at most max_running_requests tokens: 16 leave room for 4 rows' drafts.
SMALL = dict(dtype="float32", skip_tokenizer_init=True, page_size=4, max_running_requests=16,
             chunked_prefill_size=8, max_prefill_tokens=12, context_length=96,
             max_total_tokens=1024)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("llama"))
    return directory, make_tiny_checkpoint(directory, "llama")


@pytest.fixture(scope="module")
def plain(checkpoint):
    with Engine(checkpoint[0], **SMALL) as engine:
        yield engine


@pytest.fixture(scope="module")
def spec(checkpoint):
    with Engine(checkpoint[0], speculative_algorithm="NGRAM", speculative_num_draft_tokens=4,
                **SMALL) as engine:
        yield engine


def ids(results):
    return [r["output_ids"] for r in results]


def test_greedy_output_equals_plain_decoding_and_transformers(plain, spec, checkpoint):
    together = spec.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert ids(together) == ids(plain.generate(input_ids=PROMPTS, sampling_params=GREEDY))
    for prompt, result in zip(PROMPTS, together):
        assert result["output_ids"] == hf_greedy(checkpoint[1], prompt, 24)
    meta = [r["meta_info"] for r in together]
    verified = [m for m in meta if "spec_verify_ct" in m]
    assert verified and max(m["spec_accept_length"] for m in verified) > 1.5
    assert all(m["completion_tokens"] == 24 for m in meta)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_seeded_sampled_output_equals_plain_decoding_token_for_token(plain, spec, seed):
    """Each token is drawn with the key (seed, output position) either way: the same tokens,
    i.e. the model's distribution exactly, whatever was drafted."""
    params = [
        {"temperature": 0.6, "top_k": 4, "seed": seed, "max_new_tokens": 20, "ignore_eos": True},
        {"temperature": 1.0, "top_p": 0.8, "min_p": 0.05, "seed": seed + 10,
         "max_new_tokens": 20, "ignore_eos": True, "logit_bias": {"7": 3.0}},
        {"temperature": 0.3, "seed": seed + 20, "max_new_tokens": 20, "ignore_eos": True,
         "stop_token_ids": [8], "min_new_tokens": 5},
        {"temperature": 0.8, "seed": seed + 30, "max_new_tokens": 20, "ignore_eos": True},
    ]
    assert ids(spec.generate(input_ids=PROMPTS, sampling_params=params)) == \
        ids(plain.generate(input_ids=PROMPTS, sampling_params=params))


@pytest.mark.parametrize("penalty", [{"frequency_penalty": 1.5}, {"presence_penalty": 1.5},
                                     {"repetition_penalty": 1.8}], ids=lambda p: next(iter(p)))
def test_penalized_output_equals_plain_decoding(plain, spec, penalty):
    """A penalty counts the output so far: in a verified row, the drafts before each token, and
    after it the kept tokens alone (executor/verified_rows.py). Penalized greedy and seeded rows
    beside plain ones."""
    params = [{**GREEDY, **penalty}, {**GREEDY, "max_new_tokens": 30},
              {"temperature": 0.7, "seed": 3, "max_new_tokens": 30, "ignore_eos": True, **penalty},
              {**GREEDY, **penalty, "logit_bias": {"7": 2.0}}]
    spec.core.scheduler.speculator.verified_rows = 0
    assert ids(spec.generate(input_ids=PROMPTS, sampling_params=params)) == \
        ids(plain.generate(input_ids=PROMPTS, sampling_params=params))
    assert spec.core.scheduler.speculator.verified_rows > 0


def test_stop_ids_and_max_tokens_inside_verified_rows_are_exact(plain, spec):
    free = plain.generate(input_ids=PROMPTS[1], sampling_params=GREEDY)["output_ids"]
    for stop in sorted(set(free[1:8])):
        params = {**GREEDY, "stop_token_ids": [stop]}
        got = spec.generate(input_ids=PROMPTS[1], sampling_params=params)
        assert got["output_ids"] == free[:free.index(stop) + 1]
        assert got["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    for n in range(1, 8):
        got = spec.generate(input_ids=PROMPTS[1], sampling_params={**GREEDY, "max_new_tokens": n})
        assert got["output_ids"] == free[:n]
        assert got["meta_info"]["finish_reason"] == {"type": "length", "length": n}


def test_logprobs_of_accepted_tokens_equal_plain_decodings(plain, spec):
    kwargs = dict(input_ids=PROMPTS[:2], sampling_params=GREEDY, return_logprob=True,
                  top_logprobs_num=3)
    want, got = plain.generate(**kwargs), spec.generate(**kwargs)
    assert ids(got) == ids(want)
    for a, b in zip(want, got):
        assert [t for _, t, _ in b["meta_info"]["output_token_logprobs"]] == b["output_ids"]
        np.testing.assert_allclose([lp for lp, _, _ in b["meta_info"]["output_token_logprobs"]],
                                   [lp for lp, _, _ in a["meta_info"]["output_token_logprobs"]],
                                   atol=1e-5)
        for x, y in zip(a["meta_info"]["output_top_logprobs"], b["meta_info"]["output_top_logprobs"]):
            assert [t for _, t, _ in x] == [t for _, t, _ in y]


def test_no_compile_while_serving_pages_come_back_and_the_prefix_cache_gives_the_same(spec):
    compiled = spec.core.runner.compile_count()
    first = spec.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    again = spec.generate(input_ids=PROMPTS, sampling_params=GREEDY)  # prompts from the cache
    assert ids(again) == ids(first)
    assert any(r["meta_info"]["cached_tokens"] > 0 for r in again)
    assert spec.core.runner.compile_count() == compiled
    assert spec.core.scheduler.token_usage() == 0


def test_streaming_delivers_every_token_once_and_an_abort_mid_stream_is_clean(spec):
    full = spec.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["output_ids"]

    async def stream(limit):
        chunks = await spec.async_generate(input_ids=PROMPTS[0], sampling_params=GREEDY,
                                           stream=True)
        seen = []
        async for chunk in chunks:
            seen.append(chunk)
            if len(seen) == limit:
                break
        await chunks.aclose()
        return seen

    whole = asyncio.run(stream(None))  # each chunk holds its new tokens
    assert [t for chunk in whole for t in chunk["output_ids"]] == full and whole[-1]["finished"]
    assert max(len(chunk["output_ids"]) for chunk in whole) > 1  # a verified row: one chunk
    cut = asyncio.run(stream(3))
    assert len(cut) == 3 and not cut[-1]["finished"]
    deadline = time.time() + 10
    while spec.core.scheduler.token_usage() != 0 and time.time() < deadline:
        time.sleep(0.05)
    assert spec.core.scheduler.token_usage() == 0
    assert spec.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["output_ids"] == full


def test_rows_whose_drafts_fail_back_off_with_the_same_output(plain, spec):
    """High-temperature rows reject most drafts and back off (their next steps overlapped
    continuations), one request at a time and several at once."""
    spec.core.scheduler.speculator.verified_rows = 0
    params = [{"temperature": 1.5, "seed": s, "max_new_tokens": 30, "ignore_eos": True,
               "logit_bias": {"7": 4.0}} for s in range(4)]  # 7 repeats: drafts keep coming
    assert ids(spec.generate(input_ids=PROMPTS, sampling_params=params)) == \
        ids(plain.generate(input_ids=PROMPTS, sampling_params=params))
    for p in params:
        assert spec.generate(input_ids=PROMPTS[1], sampling_params=p)["output_ids"] == \
            plain.generate(input_ids=PROMPTS[1], sampling_params=p)["output_ids"]
    assert spec.core.scheduler.speculator.verified_rows > 0


@pytest.mark.parametrize("family", ["gemma4_ple", "llama4"])
def test_this_years_families_with_drafts_give_transformers_greedy_tokens(family, tmp_path):
    """Verified rows through a sliding window's edge, KV-shared layers and per-layer embeddings
    (gemma4_ple: window 4), and through Llama 4's attention chunk (32: prompt and drafts cross
    it) and NoPE layers: transformers' greedy tokens, drafts accepted."""
    hf_model = make_tiny_checkpoint(str(tmp_path), family)
    with Engine(str(tmp_path), speculative_algorithm="NGRAM", speculative_num_draft_tokens=4,
                **SMALL) as engine:
        compiles = engine.core.runner.compile_count()
        results = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert engine.core.runner.compile_count() == compiles
    for prompt, result in zip(PROMPTS, results):
        assert result["output_ids"] == hf_greedy(hf_model, prompt, 24)
    assert max(r["meta_info"].get("spec_accept_length", 0) for r in results) > 1.2


# --- structured outputs: drafts the grammar takes, each sample row masked after its drafts ------

@pytest.fixture(scope="module")
def constrained_engines(tmp_path_factory):
    """A tiny model with the default model's tokenizer (a grammar needs one), with and without
    speculation."""
    from xlaserve.weights.loader import default_model_file, load_tokenizer

    directory = str(tmp_path_factory.mktemp("tiny-constrained"))
    make_tiny_checkpoint(directory, "qwen2", vocab_size=49152)
    tokenizer = load_tokenizer(default_model_file())
    tokenizer.save_pretrained(directory)
    options = dict(dtype="float32", page_size=16, max_running_requests=16, context_length=256,
                   max_total_tokens=4096, chunked_prefill_size=64, max_prefill_tokens=128,
                   log_level="warning")
    with Engine(directory, **options) as plain_engine, Engine(
            directory, speculative_algorithm="NGRAM", **options) as spec_engine:
        yield plain_engine, spec_engine, tokenizer


def test_constrained_outputs_with_drafts_equal_plain_decodings(constrained_engines):
    plain_engine, spec_engine, tokenizer = constrained_engines
    record = '{"name": "Alice", "city": "Paris", "age": 30}'
    prompt = tokenizer.encode(f"{record}\n{record}\n")
    schema = ('{"type": "object", "properties": {"name": {"type": "string"}, "city": '
              '{"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "city", '
              '"age"], "additionalProperties": false}')
    params = [{"regex": r'\{"name": "Alice", "city": "(Paris|Rome)", "age": [0-9]+\}',
               "temperature": 0, "max_new_tokens": 40},
              {"json_schema": schema, "temperature": 0, "max_new_tokens": 40},
              {"json_schema": schema, "temperature": 1.0, "seed": 4, "max_new_tokens": 40},
              {"regex": "(Alice|Bob)( (Alice|Bob)){3}", "temperature": 0.7, "seed": 5,
               "max_new_tokens": 40}]
    spec_engine.core.scheduler.speculator.verified_rows = 0
    got = spec_engine.generate(input_ids=[prompt] * len(params), sampling_params=params)
    want = plain_engine.generate(input_ids=[prompt] * len(params), sampling_params=params)
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    assert [g["meta_info"]["finish_reason"] for g in got] == \
        [w["meta_info"]["finish_reason"] for w in want]
    assert spec_engine.core.scheduler.speculator.verified_rows > 0  # constrained rows drafted


def test_a_tiny_page_pool_retracts_verified_rows_and_every_output_is_still_plain_decodings(
        plain, checkpoint, caplog):
    """Drafts take pages only when the pool has them for every draft (the plain decodes'
    come first); under pressure the scheduler retracts as without speculation, and a resumed
    request drafts again from its prompt and output."""
    import logging

    params = {**GREEDY, "max_new_tokens": 30}
    options = {**SMALL, "max_total_tokens": 64, "disable_precompile": True}
    with Engine(checkpoint[0], speculative_algorithm="NGRAM", **options) as small:
        with caplog.at_level(logging.INFO):
            got = small.generate(input_ids=PROMPTS * 2, sampling_params=params)
        assert "Retract requests" in caplog.text
        assert small.core.scheduler.speculator.verified_rows > 0
        assert small.core.scheduler.token_usage() == 0
    assert ids(got) == ids(plain.generate(input_ids=PROMPTS * 2, sampling_params=params))


# --- STANDALONE: a draft model with the target's vocabulary -----------------------------------

@pytest.fixture(scope="module")
def draft_checkpoint(tmp_path_factory):
    """Another tiny model (a qwen2, other weights, one layer) with the same 512-token vocabulary."""
    directory = str(tmp_path_factory.mktemp("draft"))
    make_tiny_checkpoint(directory, "qwen2", seed=1, num_hidden_layers=1)
    return directory


@pytest.mark.parametrize("draft", ["other", "itself"])
def test_a_draft_models_rows_give_plain_decodings_output(plain, checkpoint, draft_checkpoint,
                                                          draft):
    """Greedy, seeded, penalized and stopped rows equal plain decoding's with a draft model
    that mostly disagrees with the target ("other") and with the target as its own draft,
    whose greedy drafts the target keeps (its KV, kept in step with the target's by running
    every step's tokens, must hold exactly the target's tokens for that)."""
    path = draft_checkpoint if draft == "other" else checkpoint[0]
    params = [GREEDY, {"temperature": 0.8, "seed": 3, "max_new_tokens": 24, "ignore_eos": True,
                       "top_p": 0.9},
              {**GREEDY, "frequency_penalty": 0.4, "repetition_penalty": 1.2},
              {**GREEDY, "max_new_tokens": 7, "stop_token_ids": [300]}]
    with Engine(checkpoint[0], speculative_algorithm="STANDALONE",
                speculative_draft_model_path=path, **SMALL) as engine:
        compiled = engine.core.runner.compile_count()
        got = engine.generate(input_ids=PROMPTS, sampling_params=params)
        solo = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
        assert engine.core.runner.compile_count() == compiled
        assert engine.core.scheduler.token_usage() == 0
    assert ids(got) == ids(plain.generate(input_ids=PROMPTS, sampling_params=params))
    assert solo["output_ids"] == got[0]["output_ids"]
    if draft == "itself":  # 4 drafts a row, all kept: 5 tokens a verified row at most
        assert solo["meta_info"]["spec_accept_length"] > 4


def test_a_draft_model_with_another_vocabulary_stops_start_up(checkpoint, tmp_path):
    make_tiny_checkpoint(str(tmp_path), "llama", vocab_size=600)
    with pytest.raises(ValueError, match="vocabulary has 600 tokens"):
        Engine(checkpoint[0], speculative_algorithm="STANDALONE",
               speculative_draft_model_path=str(tmp_path), **SMALL)
