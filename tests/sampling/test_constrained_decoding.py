"""Structured outputs through the engine, on a tiny random model with the default model's
vocabulary and tokenizer: its next-token distribution is near uniform over 49K tokens, so what
keeps its outputs in the language is the mask, not the model."""
import collections
import logging

import pytest

from tests.sampling.constrained_cases import CONSTRAINTS, check, is_json_prefix
from tests.tiny_models import make_tiny_checkpoint
from xlaserve.offline import Engine
from xlaserve.runtime.sampling.params import InvalidGrammar

ENGINE = dict(dtype="float32", page_size=16, max_running_requests=16, context_length=512,
              max_total_tokens=8192, chunked_prefill_size=64, max_prefill_tokens=128,
              precompile_bs_paddings="4,16", log_level="warning")
PROMPT = [1, 2, 3, 4, 5]
SAMPLES = 64


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from xlaserve.weights.loader import default_model_file, load_tokenizer

    directory = str(tmp_path_factory.mktemp("tiny-constrained"))
    make_tiny_checkpoint(directory, "qwen2", vocab_size=49152)
    load_tokenizer(default_model_file()).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def engine(checkpoint):
    with Engine(checkpoint, **ENGINE) as engine:
        yield engine


def constrained(kind, seed, **extra):
    field, text = CONSTRAINTS[kind]
    return {field: text, "temperature": 1.0, "max_new_tokens": 160, "seed": seed, **extra}


@pytest.mark.parametrize("kind", ["json_schema", "regex", "ebnf"])
def test_every_sample_at_temperature_one_is_in_the_language_and_stops(engine, kind):
    outs = engine.generate(input_ids=[PROMPT] * SAMPLES,
                           sampling_params=[constrained(kind, seed) for seed in range(SAMPLES)])
    assert [o["meta_info"]["finish_reason"] for o in outs] == [{"type": "stop", "matched": None}] * SAMPLES
    for out in outs:
        check(kind, out["text"])
    assert len({o["text"] for o in outs}) > SAMPLES // 2  # the samples differ: the model samples


def test_json_object_samples_are_objects_or_their_truncated_starts(engine):
    # Any JSON object: nothing bounds a key's length, and a near-uniform model rarely closes a
    # string, so many hit max_new_tokens; those must still be the start of a JSON document.
    outs = engine.generate(input_ids=[PROMPT] * SAMPLES,
                           sampling_params=[constrained("json_object", s) for s in range(SAMPLES)])
    reasons = collections.Counter(o["meta_info"]["finish_reason"]["type"] for o in outs)
    assert set(reasons) <= {"stop", "length"} and reasons["stop"] >= 5, reasons
    for out in outs:
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            check("json_object", out["text"])
        else:
            assert out["text"].startswith("{") and is_json_prefix(out["text"]), out["text"]


def test_an_unconstrained_greedy_neighbour_gets_its_solo_tokens(engine):
    greedy = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    solo = engine.generate(input_ids=[7, 8, 9], sampling_params=greedy)["output_ids"]
    outs = engine.generate(
        input_ids=[PROMPT] * 6 + [[7, 8, 9]],
        sampling_params=[constrained(k, s) for s, k in enumerate(["json_schema", "regex", "ebnf"] * 2)]
        + [greedy])
    assert outs[-1]["output_ids"] == solo
    for kind, out in zip(["json_schema", "regex", "ebnf"] * 2, outs[:6]):
        check(kind, out["text"])


def test_a_constrained_request_gives_the_same_tokens_alone_and_in_a_batch(engine):
    alone = engine.generate(input_ids=PROMPT, sampling_params=constrained("json_schema", 5))
    batch = engine.generate(input_ids=[PROMPT] * 4, sampling_params=[
        constrained("json_schema", s) for s in (3, 5, 7, 9)])
    assert batch[1]["output_ids"] == alone["output_ids"]


def test_outputs_are_equal_with_and_without_the_overlap_schedule(engine, checkpoint):
    params = [constrained(k, s) for s, k in enumerate(["json_schema", "regex", "ebnf"] * 3)]
    params.append({"temperature": 0.7, "seed": 11, "max_new_tokens": 30})
    overlapped = engine.generate(input_ids=[PROMPT] * len(params), sampling_params=params)
    with Engine(checkpoint, **ENGINE, disable_overlap_schedule=True) as serial:
        stepwise = serial.generate(input_ids=[PROMPT] * len(params), sampling_params=params)
    assert [o["output_ids"] for o in overlapped] == [o["output_ids"] for o in stepwise]


def test_constrained_requests_compile_nothing_after_precompile(engine):
    compiled = engine.core.runner.compile_count()
    engine.generate(input_ids=[PROMPT, [9] * 40, [3]] * 4, sampling_params=[
        constrained(k, s, logit_bias={"5": 1.0}) if k else {"max_new_tokens": 20}
        for s, k in enumerate(["json_schema", "regex", "ebnf", None] * 3)])
    assert engine.core.runner.compile_count() == compiled


def test_retracted_constrained_requests_resume_where_their_grammar_was(checkpoint, caplog):
    # 16 requests of ~75 tokens (up to 165) in a pool of 256 tokens: most are retracted.
    small = {**ENGINE, "page_size": 4, "max_total_tokens": 256, "precompile_bs_paddings": "16"}
    with caplog.at_level(logging.INFO, logger="xlaserve.runtime.scheduler.scheduler"):
        with Engine(checkpoint, **{**small, "log_level": "info"}) as engine:
            outs = engine.generate(input_ids=[PROMPT] * 16, sampling_params=[
                constrained("json_schema", s) for s in range(16)])
    assert "Retract requests" in caplog.text
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
        check("json_schema", out["text"])


def test_bad_constraints_raise_before_anything_is_queued(engine):
    with pytest.raises(InvalidGrammar, match="unclosed character class") as error:
        engine.generate(input_ids=PROMPT, sampling_params={"regex": "[a-"})
    assert error.value.param == "regex"
    with pytest.raises(InvalidGrammar) as error:
        engine.generate(input_ids=PROMPT, sampling_params={"regex": "a", "json_schema": "{}"})
    assert engine.core.scheduler.num_waiting == 0 and engine.core.scheduler.num_running == 0


def test_grammar_backend_none_refuses_constraints_with_the_flag_named(checkpoint):
    with Engine(checkpoint, **ENGINE, grammar_backend="none", disable_precompile=True) as engine:
        with pytest.raises(InvalidGrammar, match="--grammar-backend none") as error:
            engine.generate(input_ids=PROMPT, sampling_params={"ebnf": 'root ::= "a"'})
        assert error.value.param == "ebnf"
