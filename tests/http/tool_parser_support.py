"""What the tool-call parser tests share (test_tool_parsers.py, and
test_tool_parsers_gemma4_llama4.py): the tools, a parser fed piece by piece, and the checks every
recorded output goes through: parsed whole, fed one character at a time, one token at a time (the
default model's tokenizer), in random pieces and cut in two at every position, it gives the same
content and the same calls; markup never reaches the streamed content, and a call cut off by the
end of the output never shows up."""
from __future__ import annotations

import functools
import json
import random

import pytest

from xlaserve.http.parsing.tool_parsers import TOOL_CALL_PARSERS
from xlaserve.http.parsing.tool_regions import ToolCall, ToolCallDelta


def tool(name):
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


TOOLS = [tool(n) for n in ("get_weather", "get_time", "search")]
W = "get_weather"


@functools.cache
def tokenizer():
    from xlaserve.weights.loader import default_model_file, load_tokenizer

    return load_tokenizer(default_model_file())


def token_pieces(text: str) -> list[str]:
    """The text as a server streams it: one piece per token (a character split across tokens
    comes with the token that completes it)."""
    tok = tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    pieces, sent = [], ""
    for k in range(len(ids)):
        decoded = tok.decode(ids[:k + 1])
        if decoded.endswith("\ufffd") and k + 1 < len(ids):
            continue
        assert decoded.startswith(sent)
        pieces.append(decoded[len(sent):])
        sent = decoded
    assert "".join(pieces) == text
    return pieces


def stream(name, pieces, tools=None):
    """Feed the pieces, then finish: (content, calls, every piece's (content, deltas))."""
    parser = TOOL_CALL_PARSERS[name](tools)
    steps = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    content = "".join(c for c, _ in steps)
    deltas = [d for _, ds in steps for d in ds]
    return content, assemble(deltas), steps


def assemble(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """Calls from their deltas, checking the delta rules: a call's first delta has its index (the
    next one) and its name, its later deltas no name."""
    calls: list[ToolCall] = []
    for d in deltas:
        if d.name is not None:
            assert d.index == len(calls) and d.arguments == ""
            calls.append(ToolCall(d.name, "", d.call_id))
        else:
            assert d.index == len(calls) - 1, "fragments follow their call's first delta"
            calls[d.index].arguments += d.arguments
    return calls


def as_pairs(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def check_whole_output(name, case, text, content, calls, markers):
    got_content, got_calls = TOOL_CALL_PARSERS[name](TOOLS).parse(text)
    assert (got_content, as_pairs(got_calls)) == (content, calls)
    for call in got_calls:
        assert call.arguments == json.dumps(json.loads(call.arguments), ensure_ascii=False)
    if (calls or case.startswith("cut")) and "malformed" not in case:
        assert not any(m in got_content for m in markers), "markup left in the content"


def check_streams_match_the_whole(name, case, text):
    """Per character, per token and in random pieces: exactly what the whole output gives."""
    whole = TOOL_CALL_PARSERS[name](TOOLS).parse(text)
    rng = random.Random(case)
    splits = {
        "char": list(text),
        "token": token_pieces(text),
        "random": [],
    }
    at = 0
    while at < len(text):
        n = rng.randint(1, 9)
        splits["random"].append(text[at:at + n])
        at += n
    for how, pieces in splits.items():
        got_content, got_calls, _ = stream(name, pieces, TOOLS)
        assert (got_content, got_calls) == whole, how  # arguments: exactly the same text


def check_cut_in_two_anywhere(name, text):
    """Streamed in two pieces, cut at every position: the same result; and what the first piece
    gives is final: its content a prefix of the whole content (no markup shown, then taken back),
    its calls the first calls of the whole, complete (a call is only sent once complete)."""
    whole_content, whole_calls = TOOL_CALL_PARSERS[name](TOOLS).parse(text)
    for k in range(len(text) + 1):
        got_content, got_calls, steps = stream(name, [text[:k], text[k:]], TOOLS)
        assert (got_content, got_calls) == (whole_content, whole_calls), k
        first_content, first_deltas = steps[0]
        assert whole_content.startswith(first_content), k
        first_calls = assemble(first_deltas)
        assert first_calls == whole_calls[:len(first_calls)], k


def check_ended_early(name, text):
    """The output cut at any point (max_tokens): its calls are whole calls of the full output."""
    _, whole_calls = TOOL_CALL_PARSERS[name](TOOLS).parse(text)
    for k in range(len(text)):
        _, got = TOOL_CALL_PARSERS[name](TOOLS).parse(text[:k])
        assert got == whole_calls[:len(got)], k


def check_unknown_function(name, text, content, expected_calls):
    """A call to a function not in `tools` stays content; without `tools` it is a call."""
    got_content, got_calls = TOOL_CALL_PARSERS[name](TOOLS).parse(text)
    assert (got_content, as_pairs(got_calls)) == (content, expected_calls)
    assert stream(name, list(text), TOOLS)[:2] == (got_content, got_calls)
    assert "delete_all" in [c.name for c in TOOL_CALL_PARSERS[name]().parse(text)[1]]


def check_random_outputs(name, vocab):
    """300 outputs made of `vocab`'s pieces, fed in random pieces: what the whole gives."""
    rng = random.Random(name)
    for _ in range(300):
        text = "".join(rng.choice(vocab) for _ in range(rng.randint(0, 12)))
        whole = TOOL_CALL_PARSERS[name]().parse(text)
        pieces, at = [], 0
        while at < len(text):
            n = rng.randint(1, 6)
            pieces.append(text[at:at + n])
            at += n
        assert stream(name, pieces)[:2] == whole, text


def case_tests(cases, markers):
    """The four tests every recorded output goes through, parametrized over `cases` (parser,
    case id, output, content, calls as (name, arguments dict)); a test module assigns them to
    its own `test_*` names."""
    cases_of = pytest.mark.parametrize("name,case,text,content,calls", cases,
                                       ids=[f"{c[0]}-{c[1]}" for c in cases])

    @cases_of
    def whole_output(name, case, text, content, calls):
        check_whole_output(name, case, text, content, calls, markers[name])

    @cases_of
    def per_character_and_per_token_streams_match_the_whole(name, case, text, content, calls):
        check_streams_match_the_whole(name, case, text)

    @cases_of
    def cut_in_two_anywhere(name, case, text, content, calls):
        check_cut_in_two_anywhere(name, text)

    @cases_of
    def output_ended_early_never_gives_a_half_call(name, case, text, content, calls):
        check_ended_early(name, text)

    return (whole_output, per_character_and_per_token_streams_match_the_whole,
            cut_in_two_anywhere, output_ended_early_never_gives_a_half_call)
