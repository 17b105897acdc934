"""The tool-call parsers (xlaserve/http/parsing/tool_parsers.py) on recorded outputs of each model family:
fed whole, one character at a time, one token at a time (the default model's tokenizer) and cut in
two at every position, they give the same content and the same calls; markup never reaches the
streamed content, and a call cut off by the end of the output never shows up (the checks:
tool_parser_support.py; Gemma 4's and Llama 4's formats: test_tool_parsers_gemma4_llama4.py)."""
from __future__ import annotations

import pytest

from tests.http.tool_parser_support import (TOOLS, W, case_tests, check_random_outputs,
                                            check_unknown_function, stream)
from xlaserve.http.parsing.tool_parsers import TOOL_CALL_PARSERS
from xlaserve.http.parsing.tool_regions import ToolCallDelta

# Markers of each format, for the "no markup in the content" checks.
MARKERS = {
    "qwen25": ["<tool_call>", "</tool_call>"],
    "llama3": ["<|python_tag|>"],
    "mistral": ["[TOOL_CALLS]", "[ARGS]"],
    "deepseekv3": ["<｜tool", "```"],
    "deepseekv31": ["<｜tool"],
    "kimi_k2": ["<|tool_call", "functions."],
    "pythonic": ["<|python_start|>", "<|python_end|>"],
    "gpt-oss": ["<|channel|>", "<|message|>", "<|start|>", "<|call|>", "<|constrain|>"],
}

DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"


def ds3(name, args):
    return f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"


def ds31(name, args):
    return f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{args}<｜tool▁call▁end｜>"


K2_BEGIN, K2_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"


def k2(call_id, args):
    return f"<|tool_call_begin|>{call_id}<|tool_call_argument_begin|>{args}<|tool_call_end|>"


def oss(header, body):
    """A Harmony message (`<|call|>` is a stop token: usually absent from the text)."""
    return f"<|channel|>{header}<|message|>{body}"


def qwen(body):
    return f"<tool_call>\n{body}\n</tool_call>"


# (parser, case id, model output, expected content, expected calls as (name, arguments dict)).
# Where the output has calls or a cut call and nothing malformed, the content has no markup.
CASES = [
    # --- qwen25 (Hermes) ---
    ("qwen25", "single", qwen('{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'),
     "", [(W, {"city": "Paris", "unit": "celsius"})]),
    ("qwen25", "parallel", "I'll check both.\n\n" + qwen('{"name": "get_weather", "arguments": {"city": "Paris"}}')
     + "\n" + qwen('{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}'),
     "I'll check both.", [(W, {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris"})]),
    ("qwen25", "text-after", "Sure: " + qwen('{"name": "search", "arguments": {"q": "a <b> c"}}') + "\n\nDone.",
     "Sure:Done.", [("search", {"q": "a <b> c"})]),
    ("qwen25", "unicode", qwen('{"name": "get_weather", "arguments": {"city": "東京", "note": "🌧 \\u00e9"}}'),
     "", [(W, {"city": "東京", "note": "🌧 é"})]),
    ("qwen25", "args-as-string", qwen('{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}'),
     "", [(W, {"city": "Rome"})]),
    ("qwen25", "malformed", "Hmm " + qwen('{"name": "get_weather", "arguments": {"city": "Paris"}') + " ok",
     "Hmm " + qwen('{"name": "get_weather", "arguments": {"city": "Paris"}') + " ok", []),
    ("qwen25", "malformed-then-good", qwen("{'name': 'get_time'}") + qwen('{"name": "get_time", "arguments": {}}'),
     qwen("{'name': 'get_time'}"), [("get_time", {})]),
    ("qwen25", "cut", "Let me look.\n" + qwen('{"name": "get_weather", "arguments": {}}')
     + '\n<tool_call>\n{"name": "get_time", "argu', "Let me look.", [(W, {})]),
    ("qwen25", "cut-in-end-tag", '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_',
     "", [("get_time", {"tz": "UTC"})]),
    ("qwen25", "cut-at-marker", "Checking <tool_", "Checking <tool_", []),
    ("qwen25", "no-call", "Plain answer with <b>tags</b> and a { brace.\n",
     "Plain answer with <b>tags</b> and a { brace.\n", []),
    # --- llama3 ---
    ("llama3", "single-tag", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
     "", [(W, {"city": "Paris"})]),
    ("llama3", "bare", '  {"type": "function", "name": "get_weather", "parameters": {"city": "Oslo"}}',
     "", [(W, {"city": "Oslo"})]),
    ("llama3", "parallel", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "get_time", "arguments": {"tz": "CET"}}',
     "", [(W, {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
    ("llama3", "bare-parallel", '{"name": "get_time", "parameters": {}};{"name": "search", "parameters": {"q": ";"}}',
     "", [("get_time", {}), ("search", {"q": ";"})]),
    ("llama3", "text-before", 'Let me check that.<|python_tag|>{"name": "search", "parameters": {"q": "{x}"}}',
     "Let me check that.", [("search", {"q": "{x}"})]),
    ("llama3", "text-after", '{"name": "get_time", "parameters": {"tz": "UTC"}}\nAnything else?',
     "Anything else?", [("get_time", {"tz": "UTC"})]),
    ("llama3", "unicode", '<|python_tag|>{"name": "search", "parameters": {"q": "naïve café ☕ 北京"}}',
     "", [("search", {"q": "naïve café ☕ 北京"})]),
    ("llama3", "prose-with-json", 'The JSON is {"name": "get_time", "parameters": {}}.',
     'The JSON is {"name": "get_time", "parameters": {}}.', []),
    ("llama3", "json-answer", '{"name": "Alice", "age": 30}', '{"name": "Alice", "age": 30}', []),
    ("llama3", "malformed", '<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC",}}',
     '<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC",}}', []),
    ("llama3", "cut", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_ti',
     "", [(W, {"city": "Paris"})]),
    ("llama3", "bare-cut", '{"name": "get_weather", "parameters": {"city": "Pa', "", []),
    ("llama3", "bare-json-cut", '{"answer": [1, 2', '{"answer": [1, 2', []),
    # --- mistral ---
    ("mistral", "single", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"location": "Paris, France"}}]',
     "", [(W, {"location": "Paris, France"})]),
    ("mistral", "parallel", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Nice"}}, '
     '{"name": "get_time", "arguments": {"tz": "[CET]"}}]',
     "", [(W, {"city": "Nice"}), ("get_time", {"tz": "[CET]"})]),
    ("mistral", "text-around", 'Let me see. [TOOL_CALLS] [{"name": "search", "arguments": {"q": "x"}}] Thanks.',
     "Let me see.Thanks.", [("search", {"q": "x"})]),
    ("mistral", "compact", '[TOOL_CALLS]get_weather[ARGS]{"city": "Lyon"}[TOOL_CALLS]get_time[ARGS]{}',
     "", [(W, {"city": "Lyon"}), ("get_time", {})]),
    ("mistral", "unicode", '[TOOL_CALLS] [{"name": "search", "arguments": {"q": "Zürich – 😀"}}]',
     "", [("search", {"q": "Zürich – 😀"})]),
    ("mistral", "malformed", '[TOOL_CALLS] [{"name": "search", "arguments": {q: 1}}]',
     '[TOOL_CALLS] [{"name": "search", "arguments": {q: 1}}]', []),
    ("mistral", "cut", 'Ok [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Nice"}}, {"name": "ge',
     "Ok", []),
    ("mistral", "compact-cut", '[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]get_weather[AR', "", [("get_time", {})]),
    ("mistral", "no-call", "Arrays like [1, 2] and [TOOL] stay.", "Arrays like [1, 2] and [TOOL] stay.", []),
    # --- deepseekv3 / deepseekv31 ---
    ("deepseekv3", "single", DS_BEGIN + ds3(W, '{"location": "Tokyo"}') + DS_END,
     "", [(W, {"location": "Tokyo"})]),
    ("deepseekv3", "parallel", "Checking both." + DS_BEGIN + ds3(W, '{"location": "Tokyo"}') + "\n"
     + ds3(W, '{"location": "Paris"}') + DS_END, "Checking both.",
     [(W, {"location": "Tokyo"}), (W, {"location": "Paris"})]),
    ("deepseekv3", "unicode", DS_BEGIN + ds3("search", '{"q": "東京の天気 ⛅"}') + DS_END,
     "", [("search", {"q": "東京の天気 ⛅"})]),
    ("deepseekv3", "malformed", DS_BEGIN + ds3("search", '{"q": "x"') + DS_END, ds3("search", '{"q": "x"'), []),
    ("deepseekv3", "cut", "Sure." + DS_BEGIN + ds3(W, '{"location": "Tokyo"}')
     + '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"loc',
     "Sure.", [(W, {"location": "Tokyo"})]),
    ("deepseekv31", "parallel", "Hi" + DS_BEGIN + ds31(W, '{"location": "Tokyo"}') + ds31("get_time", "{}") + DS_END,
     "Hi", [(W, {"location": "Tokyo"}), ("get_time", {})]),
    ("deepseekv31", "cut", DS_BEGIN + '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"location": "To', "", []),
    # --- kimi_k2 ---
    ("kimi_k2", "single", K2_BEGIN + k2("functions.get_weather:0", '{"city": "Beijing"}') + K2_END,
     "", [(W, {"city": "Beijing"})]),
    ("kimi_k2", "parallel", "Let me check." + K2_BEGIN + k2("functions.get_weather:0", '{"city": "東京"}')
     + k2("functions.get_time:1", "{}") + K2_END, "Let me check.",
     [(W, {"city": "東京"}), ("get_time", {})]),
    ("kimi_k2", "spaces-no-prefix", K2_BEGIN + "<|tool_call_begin|> search:3 <|tool_call_argument_begin|> "
     '{"q": "a <b>"} <|tool_call_end|>' + K2_END, "", [("search", {"q": "a <b>"})]),
    ("kimi_k2", "malformed", K2_BEGIN + k2("functions.search:0", '{"q": "x"') + K2_END,
     k2("functions.search:0", '{"q": "x"'), []),
    ("kimi_k2", "cut", "Ok." + K2_BEGIN + k2("functions.get_time:0", "{}")
     + '<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>{"ci', "Ok.", [("get_time", {})]),
    # --- pythonic ---
    ("pythonic", "single", '[get_weather(city="San Francisco", days=3)]', "", [(W, {"city": "San Francisco", "days": 3})]),
    ("pythonic", "parallel", "[get_weather(city='Paris', units=None, opts={'x': [1, -2.5, True]}), get_time(tz=\"CET\")]",
     "", [(W, {"city": "Paris", "units": None, "opts": {"x": [1, -2.5, True]}}), ("get_time", {"tz": "CET"})]),
    ("pythonic", "text-around", "Sure, see [1].\n[search(q='a ] b', n=(1, 2))]\nDone [ok].",
     "Sure, see [1].Done [ok].", [("search", {"q": "a ] b", "n": [1, 2]})]),
    ("pythonic", "llama4-tokens", '<|python_start|>[get_time(tz="UTC")]<|python_end|>', "", [("get_time", {"tz": "UTC"})]),
    ("pythonic", "unicode", '[search(q="Ωmega 🚀 日本")]', "", [("search", {"q": "Ωmega 🚀 日本"})]),
    ("pythonic", "malformed", "[get_time(tz=UTC)] and [search('positional')]",
     "[get_time(tz=UTC)] and [search('positional')]", []),
    ("pythonic", "cut", 'Ok. [get_weather(city="Paris"), get_time(tz="CE', "Ok.", []),
    ("pythonic", "prose-brackets", "a[0] + [x, y] and [see below", "a[0] + [x, y] and [see below", []),
    # --- gpt-oss (Harmony; what the gpt-oss reasoning parser leaves in the content) ---
    ("gpt-oss", "single", oss("commentary to=functions.get_weather <|constrain|>json", '{"city":"Paris"}'),
     "", [(W, {"city": "Paris"})]),
    ("gpt-oss", "call-token", oss("commentary to=functions.get_weather <|constrain|>json",
                                  '{"city":"Paris","unit":"celsius"}') + "<|call|>",
     "", [(W, {"city": "Paris", "unit": "celsius"})]),
    ("gpt-oss", "recipient-first", '<|start|>assistant to=functions.get_time<|channel|>commentary json'
                                   '<|message|>{"tz":"UTC"}<|call|>', "", [("get_time", {"tz": "UTC"})]),
    ("gpt-oss", "preamble", "Let me check.\n\n<|start|>assistant"
     + oss("commentary to=functions.search <|constrain|>json", '{"q": "a <b> c"}'),
     "Let me check.", [("search", {"q": "a <b> c"})]),
    ("gpt-oss", "unicode", oss("commentary to=functions.get_weather <|constrain|>json",
                               '{"city": "東京", "note": "🌧 \\u00e9"}'), "", [(W, {"city": "東京", "note": "🌧 é"})]),
    ("gpt-oss", "no-arguments", "<|channel|>commentary to=functions.get_time<|call|>", "", [("get_time", {})]),
    ("gpt-oss", "cut", oss("commentary to=functions.get_weather <|constrain|>json", '{"city": "Pa'), "", []),
    ("gpt-oss", "cut-header", "Sure.<|start|>assistant<|channel|>commentary to=functions.get_wea", "Sure.", []),
    ("gpt-oss", "malformed", oss("commentary to=functions.get_weather <|constrain|>json", "{city: Paris}")
     + "<|call|>", oss("commentary to=functions.get_weather <|constrain|>json", "{city: Paris}") + "<|call|>",
     []),
    ("gpt-oss", "malformed-array", oss("commentary to=functions.search json", "[1, 2]") + "<|call|>",
     oss("commentary to=functions.search json", "[1, 2]") + "<|call|>", []),
    ("gpt-oss", "builtin-tool", oss("analysis to=browser.search <|constrain|>json", '{"q":"x"}'),
     oss("analysis to=browser.search <|constrain|>json", '{"q":"x"}'), []),
    ("gpt-oss", "plain", "Plain answer with <b>tags</b> and a { brace.", "Plain answer with <b>tags</b> and a { brace.", []),
]

(test_whole_output, test_per_character_and_per_token_streams_match_the_whole,
 test_cut_in_two_anywhere, test_output_ended_early_never_gives_a_half_call) = case_tests(CASES, MARKERS)


def test_parser_names_are_sglangs():
    assert {"qwen25", "llama3", "mistral", "deepseekv3", "pythonic"} <= set(TOOL_CALL_PARSERS)


UNKNOWN = {
    "qwen25": (qwen('{"name": "delete_all", "arguments": {}}') + qwen('{"name": "get_time", "arguments": {}}'),
               qwen('{"name": "delete_all", "arguments": {}}')),
    "llama3": ('<|python_tag|>{"name": "delete_all", "parameters": {}}', '<|python_tag|>{"name": "delete_all", "parameters": {}}'),
    "mistral": ('[TOOL_CALLS] [{"name": "get_time", "arguments": {}}, {"name": "delete_all", "arguments": {}}]',
                '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}, {"name": "delete_all", "arguments": {}}]'),
    "deepseekv3": (DS_BEGIN + ds3("delete_all", "{}") + ds3("get_time", "{}") + DS_END, ds3("delete_all", "{}")),
    "kimi_k2": (K2_BEGIN + k2("functions.delete_all:0", "{}") + K2_END, k2("functions.delete_all:0", "{}")),
    "pythonic": ("[delete_all()]", "[delete_all()]"),
    "gpt-oss": (oss("commentary to=functions.delete_all <|constrain|>json", "{}") + "<|call|>",
                oss("commentary to=functions.delete_all <|constrain|>json", "{}") + "<|call|>"),
}


@pytest.mark.parametrize("name", sorted(UNKNOWN))
def test_a_call_to_a_function_not_in_tools_stays_content(name):
    text, content = UNKNOWN[name]
    expected_calls = [("get_time", {})] if name in ("qwen25", "deepseekv3") else []
    check_unknown_function(name, text, content, expected_calls)


def test_each_call_streams_as_a_name_delta_then_its_arguments():
    parser = TOOL_CALL_PARSERS["qwen25"](TOOLS)
    out = []
    for piece in ["Hi\n<tool", "_call>\n{\"name\": \"get_time\", ", '"arguments": {"tz": "UTC"}}\n</tool_call>',
                  "\n<tool_call>", '\n{"name": "search", "arguments": {}}\n</tool_call>']:
        out.append(parser.feed(piece))
    out.append(parser.finish())
    assert out == [
        ("Hi", []), ("", []),
        ("", [ToolCallDelta(0, "get_time", ""), ToolCallDelta(0, None, '{"tz": "UTC"}')]),
        ("", []),
        ("", [ToolCallDelta(1, "search", ""), ToolCallDelta(1, None, "{}")]),
        ("", []),
    ]


def test_possible_marker_starts_are_held_back_until_decided():
    parser = TOOL_CALL_PARSERS["qwen25"](TOOLS)
    assert parser.feed("Answer <tool") == ("Answer", [])  # the space too: a call may follow
    assert parser.feed("box> here\n") == (" <toolbox> here", [])
    assert parser.finish() == ("\n", [])
    llama = TOOL_CALL_PARSERS["llama3"](TOOLS)
    assert llama.feed("  {") == ("", [])  # a leading brace: maybe a bare JSON call
    assert llama.feed('"a": 1') == ("", [])
    assert llama.feed("}") == ('  {"a": 1}', [])  # a whole object, not a call: content
    assert llama.finish() == ("", [])


def test_pythonic_only_accepts_keyword_literals():
    parse = TOOL_CALL_PARSERS["pythonic"]().parse
    for text in ["[f(x=os.system('ls'))]", "[f(**kw)]", "[f(1)]", "[f(x={1, 2})]", "[obj.f(x=1)]", "[f(x=1), 2]"]:
        assert parse(text) == (text, []), text
    assert parse("[f(x=1e400)]") == ("[f(x=1e400)]", [])  # inf is not JSON


def test_non_json_numbers_are_not_arguments():
    text = qwen('{"name": "get_time", "arguments": {"x": NaN}}')
    assert TOOL_CALL_PARSERS["qwen25"](TOOLS).parse(text) == (text, [])


def test_parse_leaves_the_streaming_state_alone():
    parser = TOOL_CALL_PARSERS["qwen25"](TOOLS)
    parser.feed("<tool_call>\n")
    assert parser.parse("x")[0] == "x"
    assert parser.feed('{"name": "get_time", "arguments": {}}</tool_call>')[1][0].name == "get_time"


# Pieces of each format's markup (whole and broken) and of text, for random outputs.
FUZZ_VOCAB = {
    "qwen25": ["<tool_call>", "</tool_call>", "<tool_", "\n", " ", '{"name": "f", "arguments": {"a": 1}}',
               '{"name": "g"', "}", '"', "x", "{", "é"],
    "llama3": ["<|python_tag|>", "<|py", ";", " ", "\n", '{"name": "f", "parameters": {"a": "}"}}', '{"name": ',
               "{", "}", '"', "x", '\\"'],
    "mistral": ["[TOOL_CALLS]", "[TOOL", " [", "]", "f[ARGS]", "[ARGS]", '{"a": 1}',
                '{"name": "f", "arguments": {}}', ",", " ", "x", '"'],
    "deepseekv3": [DS_BEGIN, DS_END, "<｜tool▁call▁begin｜>", "function<｜tool▁sep｜>f\n```json\n", '{"a": 1}',
                   "\n```", "<｜tool▁call▁end｜>", "<｜tool", " ", "x"],
    "deepseekv31": [DS_BEGIN, "<｜tool▁call▁begin｜>", "f<｜tool▁sep｜>", '{"a": 1}', "<｜tool▁call▁end｜>", "<｜tool",
                    " ", "x"],
    "kimi_k2": [K2_BEGIN, K2_END, "<|tool_call_begin|>", "functions.f:0", "<|tool_call_argument_begin|>",
                '{"a": 1}', "<|tool_call_end|>", "<|tool", " ", "x"],
    "pythonic": ["[", "]", "f(", ")", "a=1", ", ", "'", '"', "x", " ", "<|python_start|>", "<|python_end|>", "<|py",
                 "g(b='])')"],
}


@pytest.mark.parametrize("name", sorted(FUZZ_VOCAB))
def test_random_outputs_and_random_pieces_agree_with_the_whole(name):
    check_random_outputs(name, FUZZ_VOCAB[name])


def test_bare_llama3_json_calling_an_unknown_function_is_content():
    text = '{"name": "delete_all", "parameters": {}}'
    assert TOOL_CALL_PARSERS["llama3"](TOOLS).parse(text) == (text, [])


def test_empty_output():
    for cls in TOOL_CALL_PARSERS.values():
        assert cls(TOOLS).parse("") == ("", [])
        assert cls(TOOLS).parse(" \n") == (" \n", [])


def test_kimi_k2_calls_keep_the_models_id_whole_and_streamed():
    """Kimi's template writes a call's id back into the next turn's prompt: the response's id is
    the model's `functions.NAME:INDEX` (SGLang's), not one of ours."""
    text = K2_BEGIN + k2("functions.get_weather:0", '{"city": "Oslo"}') + k2("functions.get_time:1", "{}") + K2_END
    _, calls = TOOL_CALL_PARSERS["kimi_k2"](TOOLS).parse(text)
    assert [c.call_id for c in calls] == ["functions.get_weather:0", "functions.get_time:1"]
    assert stream("kimi_k2", list(text), TOOLS)[1] == calls
