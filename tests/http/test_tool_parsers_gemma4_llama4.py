"""Gemma 4's and Llama 4's tool-call formats (issue 74), through the checks every format goes
through (tool_parser_support.py: whole, per character, per token, random pieces, cut in two at
every position, ended early), on outputs written as the models' chat templates write calls:

- `gemma4`: Gemma 4's template renders an assistant's call as
  `<|tool_call>call:NAME{` + for each argument, keys sorted, `key:` + `format_argument(value,
  escape_keys=False)` joined by `,` + `}<tool_call|>`; format_argument writes a string between
  `<|"|>` tokens, a bool as true/false, a mapping as `{k:v,...}` (keys sorted, bare), a sequence
  as `[v,...]`, anything else as Jinja prints it (3, -7, 0.25, 1e+16, None). The strings below
  are those renderings (checked against the template's macros when this was written).
- `llama4_json`: Llama 4's own template (transformers' Llama4Processor.chat_template) renders
  a call turn as `<|python_start|>` + content + `<|python_end|>` + for each call
  `{"name": "NAME", "parameters": ` + arguments | tojson + `}`.
- `llama4`: the pythonic parser (`[f(a=1)]`, maybe inside `<|python_start|>`/`<|python_end|>`)."""
from __future__ import annotations

import argparse
import json

import pytest

from tests.http.tool_parser_support import (TOOLS, W, as_pairs, case_tests, check_random_outputs,
                                            check_unknown_function, stream)
from xlaserve.http.parsing.tool_parsers import TOOL_CALL_PARSERS
from xlaserve.http.parsing.tool_regions import ToolCallDelta

Q = '<|"|>'  # Gemma 4's string delimiter, one token


def g4(name, arguments=""):
    """A Gemma 4 call as its template writes it."""
    return f"<|tool_call>call:{name}{{{arguments}}}<tool_call|>"


def l4(content, *calls):
    """A Llama 4 call turn as its template writes it: calls are (name, arguments dict)."""
    return (f"<|python_start|>{content}<|python_end|>"
            + "".join(f'{{"name": "{n}", "parameters": {json.dumps(a)}}}' for n, a in calls))


MARKERS = {
    "gemma4": ["<|tool_call>", "<tool_call|>", Q, "<|tool_response>"],
    "llama4_json": ["<|python_start|>", "<|python_end|>", "<|python_tag|>"],
    "llama4": ["<|python_start|>", "<|python_end|>"],
}

EVERY_TYPE = (f"count:3,exact:false,filters:{{lang:{Q}fr{Q},max:2.5,min:-7}},limit:1e+16,"
              f"query:{Q}a, b: {{c}} [d] \"e\"{Q},tags:[{Q}x{Q},{Q}y z{Q}],units:None,verbose:true")
EVERY_TYPE_ARGS = {"count": 3, "exact": False, "filters": {"lang": "fr", "max": 2.5, "min": -7},
                   "limit": 1e16, "query": 'a, b: {c} [d] "e"', "tags": ["x", "y z"],
                   "units": None, "verbose": True}

# (parser, case id, model output, expected content, expected calls as (name, arguments dict)).
CASES = [
    # --- gemma4 ---
    ("gemma4", "single", g4(W, f"city:{Q}Paris{Q}"), "", [(W, {"city": "Paris"})]),
    ("gemma4", "parallel", "Let me check both.\n" + g4(W, f"city:{Q}Paris{Q},unit:{Q}celsius{Q}")
     + g4("get_time", f"timezone:{Q}Europe/Paris{Q}"), "Let me check both.",
     [(W, {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "Europe/Paris"})]),
    ("gemma4", "every-type", g4("search", EVERY_TYPE), "", [("search", EVERY_TYPE_ARGS)]),
    ("gemma4", "nested", g4("search", f"q:{{terms:[{{w:{Q}a{Q},n:1}},[1,[2]]],empty:{{}},none:[]}}"),
     "", [("search", {"q": {"terms": [{"w": "a", "n": 1}, [1, [2]]], "empty": {}, "none": []}})]),
    ("gemma4", "no-arguments", g4("get_time"), "", [("get_time", {})]),
    ("gemma4", "unicode", g4(W, f"city:{Q}東京{Q},note:{Q}🌧 é{Q}"), "", [(W, {"city": "東京", "note": "🌧 é"})]),
    ("gemma4", "text-after", "Sure: " + g4("search", f"q:{Q}a <b> c{Q}") + "\n\nDone.", "Sure:Done.",
     [("search", {"q": "a <b> c"})]),
    ("gemma4", "tool-response", g4("get_time") + "<|tool_response>", "", [("get_time", {})]),
    ("gemma4", "quoted-keys-null", g4(W, f"{Q}city{Q}:{Q}Oslo{Q},days:null"), "", [(W, {"city": "Oslo", "days": None})]),
    ("gemma4", "spaces", "<|tool_call> call:get_weather{ city : " + Q + "Rome" + Q + " , days : 2 } <tool_call|>",
     "", [(W, {"city": "Rome", "days": 2})]),
    ("gemma4", "malformed-string", "Hmm " + g4(W, f"city:{Q}Paris") + " ok",
     "Hmm " + g4(W, f"city:{Q}Paris") + " ok", []),
    ("gemma4", "malformed-no-call", "<|tool_call>get_weather{}<tool_call|>", "<|tool_call>get_weather{}<tool_call|>", []),
    ("gemma4", "malformed-then-good", "<|tool_call>call:get_time{a:{b:1}<tool_call|>" + g4("get_time"),
     "<|tool_call>call:get_time{a:{b:1}<tool_call|>", [("get_time", {})]),
    ("gemma4", "malformed-value", "Hi " + g4("search", "q:x[1]"), "Hi " + g4("search", "q:x[1]"), []),
    ("gemma4", "cut", "Ok. " + g4("get_time") + f"<|tool_call>call:get_weather{{city:{Q}Pa", "Ok.", [("get_time", {})]),
    ("gemma4", "cut-in-end-tag", f"<|tool_call>call:get_time{{timezone:{Q}UTC{Q}}}<tool_c", "",
     [("get_time", {"timezone": "UTC"})]),
    ("gemma4", "cut-at-marker", "Checking <|tool_", "Checking <|tool_", []),
    ("gemma4", "no-call", "Plain answer: call:me {maybe} [x] <b>.", "Plain answer: call:me {maybe} [x] <b>.", []),
    # --- llama4_json ---
    ("llama4_json", "template-single", l4("", (W, {"city": "Paris"})), "", [(W, {"city": "Paris"})]),
    ("llama4_json", "template-text-parallel", l4("Let me check both.", (W, {"city": "Paris"}),
                                                 ("get_time", {"timezone": "CET"})),
     "Let me check both.", [(W, {"city": "Paris"}), ("get_time", {"timezone": "CET"})]),
    ("llama4_json", "wrapped", '<|python_start|>{"name": "get_time", "parameters": {}}<|python_end|>', "",
     [("get_time", {})]),
    ("llama4_json", "bare", '{"name": "search", "parameters": {"q": "x"}}', "", [("search", {"q": "x"})]),
    ("llama4_json", "python-tag", '<|python_tag|>{"name": "get_time", "parameters": {}}; '
     '{"name": "search", "arguments": {"q": ";"}}', "", [("get_time", {}), ("search", {"q": ";"})]),
    ("llama4_json", "text-after", l4("", ("get_time", {})) + "\nAnything else?", "Anything else?", [("get_time", {})]),
    ("llama4_json", "unicode", l4("", ("search", {"q": "naïve café ☕ 北京"})), "", [("search", {"q": "naïve café ☕ 北京"})]),
    ("llama4_json", "json-answer", '<|python_start|>Here:<|python_end|>{"name": "Alice", "age": 3}',
     'Here:{"name": "Alice", "age": 3}', []),
    ("llama4_json", "prose-with-json", 'The JSON is {"name": "get_time", "parameters": {}}.',
     'The JSON is {"name": "get_time", "parameters": {}}.', []),
    ("llama4_json", "malformed", '<|python_start|><|python_end|>{"name": "get_time", "parameters": {"tz": "UTC",}}',
     '{"name": "get_time", "parameters": {"tz": "UTC",}}', []),
    ("llama4_json", "cut", l4("", (W, {"city": "Paris"})) + '{"name": "get_ti', "", [(W, {"city": "Paris"})]),
    ("llama4_json", "cut-json-answer", '<|python_start|><|python_end|>{"answer": [1, 2', '{"answer": [1, 2', []),
    # --- llama4 (the pythonic parser) ---
    ("llama4", "wrapped", '<|python_start|>[get_weather(city="Paris"), get_time(timezone="CET")]<|python_end|>',
     "", [(W, {"city": "Paris"}), ("get_time", {"timezone": "CET"})]),
    ("llama4", "bare", '[search(q="San Francisco", n=3, exact=True)]', "", [("search", {"q": "San Francisco", "n": 3,
                                                                                   "exact": True})]),
]
(test_whole_output, test_per_character_and_per_token_streams_match_the_whole,
 test_cut_in_two_anywhere, test_output_ended_early_never_gives_a_half_call) = case_tests(CASES, MARKERS)


@pytest.mark.parametrize("name,text,content,calls", [
    ("gemma4", g4("delete_all") + g4("get_time"), g4("delete_all"), [("get_time", {})]),
    ("llama4_json", l4("", ("delete_all", {})), '{"name": "delete_all", "parameters": {}}', []),
    ("llama4", "[delete_all()]", "[delete_all()]", []),
])
def test_a_call_to_a_function_not_in_tools_stays_content(name, text, content, calls):
    check_unknown_function(name, text, content, calls)


FUZZ_VOCAB = {
    "gemma4": ["<|tool_call>", "<tool_call|>", "call:", "f", "{", "}", "a:", Q, "x", ",", "[", "]", " ",
               "<|tool_response>", "<|tool", "1", "true", "<|\""],
    "llama4_json": ["<|python_start|>", "<|python_end|>", "<|python_tag|>", "<|py", ";", " ", "\n",
                    '{"name": "f", "parameters": {"a": "}"}}', '{"name": ', "{", "}", '"', "x"],
}


@pytest.mark.parametrize("name", sorted(FUZZ_VOCAB))
def test_random_outputs_and_random_pieces_agree_with_the_whole(name):
    check_random_outputs(name, FUZZ_VOCAB[name])


@pytest.mark.parametrize("arguments, expected", [
    ("", {}),
    (f"s:{Q}{Q}", {"s": ""}),  # the empty string
    (f"s:{Q}<b>a:b, c}}{Q}", {"s": "<b>a:b, c}"}),  # no escapes inside <|"|>
    ("n:0,m:-12,x:0.5,y:-1.25e-05,z:1e+16", {"n": 0, "m": -12, "x": 0.5, "y": -1.25e-05, "z": 1e16}),
    ("a:true,b:false,c:None,d:null", {"a": True, "b": False, "c": None, "d": None}),
    ("a:[],b:{},c:[[]],d:[{}]", {"a": [], "b": {}, "c": [[]], "d": [{}]}),
    (f"{Q}a b{Q}:1,{Q}c{Q}:{{{Q}d{Q}:2}}", {"a b": 1, "c": {"d": 2}}),  # keys as format_argument escapes them
    ("word:Paris,time:10:30", {"word": "Paris", "time": "10:30"}),  # bare text: a string (SGLang, vLLM)
    ("a:1,a:2", {"a": 2}),  # the last of a repeated key
    ("a:1,", {"a": 1}),
])
def test_gemma4_argument_syntax(arguments, expected):
    content, calls = TOOL_CALL_PARSERS["gemma4"]().parse(g4("f", arguments))
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", expected)]


@pytest.mark.parametrize("arguments", [
    f"a:{Q}x",  # an unterminated string
    "a:{b:1", "a:[1,2", "a:1]", "a:1}", "{", "}",  # unbalanced
    "a", "a:", ":1", "a 1", ",a:1",  # no key, no value
    "a:1 b:{}", "a:x[1]", f"a:x{Q}y{Q}",  # a bare value running into a structure
    "a:1e400",  # past a float's range: not JSON
    "a:" + "[" * 3000 + "]" * 3000,  # deeper than Python recurses
])
def test_gemma4_malformed_arguments_leave_the_block_in_the_content(arguments):
    text = "Hi " + g4("f", arguments) + " bye"
    assert TOOL_CALL_PARSERS["gemma4"]().parse(text) == (text, [])
    assert stream("gemma4", list(text[:400]) + [text[400:]])[:2] == (text, [])


@pytest.mark.parametrize("block", [
    "call:f{}x", "call: f{}", "call:f(){}", "call:{}", "call:f", "cal:f{}", "call:f{}call:g{}",
])
def test_gemma4_malformed_blocks_stay_content(block):
    text = f"<|tool_call>{block}<tool_call|>"
    assert TOOL_CALL_PARSERS["gemma4"]().parse(text) == (text, [])


def test_gemma4_names_keep_dots_and_dashes():
    _, calls = TOOL_CALL_PARSERS["gemma4"]().parse(g4("web.search-v2", f"q:{Q}x{Q}"))
    assert as_pairs(calls) == [("web.search-v2", {"q": "x"})]


def test_gemma4_streams_each_call_as_a_name_delta_then_its_arguments():
    parser = TOOL_CALL_PARSERS["gemma4"](TOOLS)
    pieces = ["Let me", " check.", "<|tool_call>", "call", ":get", "_weather{city:", Q, "Paris", Q, "}",
              "<tool_call|>", "<|tool_call>", "call:get_time{}", "<tool_call|>"]
    out = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    deltas = [d for _, ds in out for d in ds]
    assert "".join(c for c, _ in out) == "Let me check."
    assert deltas == [ToolCallDelta(0, W, ""), ToolCallDelta(0, None, '{"city": "Paris"}'),
                      ToolCallDelta(1, "get_time", ""), ToolCallDelta(1, None, "{}")]
    assert [i for i, (_, ds) in enumerate(out) if ds] == [10, 13]  # each at its <tool_call|>


def test_llama4_is_the_pythonic_parser_and_vllms_names_are_taken():
    from xlaserve.server_args import ServerArgs

    assert TOOL_CALL_PARSERS["llama4"] is TOOL_CALL_PARSERS["pythonic"]
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    for flag, tool_parser, reasoning in [("llama4_pythonic", "pythonic", None),
                                         ("llama4_json", "llama4_json", None),
                                         ("gemma4", "gemma4", "gemma4")]:
        cli = ["--tool-call-parser", flag] + (["--reasoning-parser", reasoning] if reasoning else [])
        args = ServerArgs.from_cli_args(parser.parse_args(cli))
        assert (args.tool_call_parser, args.reasoning_parser) == (tool_parser, reasoning)
