"""The reasoning parsers of SGLang's table on recorded outputs of each family: parsed whole, and
streamed cut at every character, one character at a time and one token at a time, the same
(reasoning, content) every way. Pure Python: no model, no server."""
import dataclasses
import re

import pytest

from xlaserve.http.parsing.reasoning import PARSERS, ReasoningParser, needs_special_tokens
from xlaserve.server_args import ServerArgs

ANALYSIS = "<|channel|>analysis<|message|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>"

# (parser, ReasoningParser keyword arguments, output, (reasoning_content, content))
RECORDED = [
    # --- qwen3 / qwen3-thinking / deepseek-r1 (today's parsers) ---
    ("qwen3", {}, "<think>\nThe user wants 2+2.\n</think>\n\n2 + 2 = 4.",
     ("The user wants 2+2.", "2 + 2 = 4.")),
    ("qwen3", {}, "2 + 2 = 4.", (None, "2 + 2 = 4.")),
    ("qwen3-thinking", {}, "Simple sum.\n</think>\n\n4", ("Simple sum.", "4")),
    ("deepseek-r1", {}, "<think>\nOkay, 1+3.\n</think>\n\n**4**", ("Okay, 1+3.", "**4**")),
    # --- deepseek-v3 (V3.1/V3.2): reasoning only with chat_template_kwargs thinking=true ---
    ("deepseek-v3", {"chat_template_kwargs": {"thinking": True}},
     "The user asks for 1+3. That is 4.\n</think>\n\n1 + 3 = **4**.",
     ("The user asks for 1+3. That is 4.", "1 + 3 = **4**.")),
    ("deepseek-v3", {"chat_template_kwargs": {"thinking": True}}, "Let me think about",
     ("Let me think about", "")),  # cut by max_tokens inside the reasoning
    ("deepseek-v3", {}, "1 + 3 = **4**.", (None, "1 + 3 = **4**.")),
    ("deepseek-v3", {"chat_template_kwargs": {"thinking": False}}, "Close it with </think> then.",
     (None, "Close it with </think> then.")),
    ("deepseek-v3", {"chat_template_kwargs": {"thinking": False}}, "<think>hm</think>ok",
     ("hm", "ok")),
    ("deepseek-v3", {"thinking_in_prompt": True}, "sum</think>4", ("sum", "4")),
    # --- kimi: ◁think▷ ... ◁/think▷ ---
    ("kimi", {}, "◁think▷The user wants the capital of France.◁/think▷The capital of France is Paris.",
     ("The user wants the capital of France.", "The capital of France is Paris.")),
    ("kimi", {}, "\n◁think▷\nStep 1: look.\n◁/think▷\n\nParis.", ("Step 1: look.", "Paris.")),
    ("kimi", {}, "Paris.", (None, "Paris.")),
    ("kimi", {}, "◁think▷still thinking", ("still thinking", "")),
    ("kimi", {}, "<think>not Kimi's tag</think>", (None, "<think>not Kimi's tag</think>")),
    ("kimi", {"thinking_in_prompt": True}, "look◁/think▷Paris", ("look", "Paris")),
    # --- kimi_k2: <think> ... </think>; a tool-call section also ends the reasoning ---
    ("kimi_k2", {}, "<think>The user wants Paris' weather.</think>It is sunny.",
     ("The user wants Paris' weather.", "It is sunny.")),
    ("kimi_k2", {}, "It is sunny.", (None, "It is sunny.")),
    ("kimi_k2", {}, "<think>I need the weather tool.<|tool_calls_section_begin|><|tool_call_begin|>"
     'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
     "<|tool_calls_section_end|>",
     ("I need the weather tool.", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
      '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>')),
    ("kimi_k2", {}, "<think>a</think>b<|tool_calls_section_begin|>c", ("a", "b<|tool_calls_section_begin|>c")),
    ("kimi_k2", {"thinking_in_prompt": True}, "hm</think>ok", ("hm", "ok")),
    # --- gemma4: <|channel>thought\n ... <channel|> (the channel's name is not reasoning) ---
    ("gemma4", {}, "<|channel>thought\nThe user asks 2+2. Answer 4.<channel|>2 + 2 = 4.",
     ("The user asks 2+2. Answer 4.", "2 + 2 = 4.")),
    ("gemma4", {}, "2 + 2 = 4.", (None, "2 + 2 = 4.")),  # thinking off: no channel
    ("gemma4", {}, "<|channel>thought\n<channel|>Paris.", ("", "Paris.")),  # an empty channel
    ("gemma4", {}, "<|channel>thought\nLet me think", ("Let me think", "")),  # cut inside
    ("gemma4", {}, "<|channel>thoughtful<channel|>x", ("thoughtful", "x")),  # not the label
    ("gemma4", {}, "<|channel>thought\nNeed the weather.<channel|><|tool_call>call:get_weather{city:"
     '<|"|>Paris<|"|>}<tool_call|>',
     ("Need the weather.", '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>')),
    # a call before the channel is closed ends the reasoning; the call stays for the tool parser
    ("gemma4", {}, "<|channel>thought\nNeed the weather.<|tool_call>call:get_time{}<tool_call|>",
     ("Need the weather.", "<|tool_call>call:get_time{}<tool_call|>")),
    ("gemma4", {}, "Hi <|channel>thought\nx<channel|>", (None, "Hi <|channel>thought\nx<channel|>")),
    ("gemma4", {"thinking_in_prompt": True}, "thought\nhm<channel|>ok", ("hm", "ok")),
    # --- gpt-oss: Harmony channels; analysis is reasoning, final content ---
    ("gpt-oss", {}, ANALYSIS + "User asks 2+2. Answer 4.<|end|>" + FINAL + "2 + 2 = 4.<|return|>",
     ("User asks 2+2. Answer 4.", "2 + 2 = 4.")),
    ("gpt-oss", {}, ANALYSIS + "User asks 2+2.<|end|>" + FINAL + "2 + 2 = 4.",  # <|return|> trimmed
     ("User asks 2+2.", "2 + 2 = 4.")),
    ("gpt-oss", {}, ANALYSIS + "We need to", ("We need to", "")),  # cut inside the reasoning
    ("gpt-oss", {}, ANALYSIS + "Done.<|end|><|start|>assistant<|channel|>fin", ("Done.", "")),
    ("gpt-oss", {}, "<|channel|>final<|message|>Hi!", (None, "Hi!")),
    ("gpt-oss", {}, "Hello there", (None, "Hello there")),  # no Harmony markup at all
    ("gpt-oss", {}, ANALYSIS + "one<|end|><|start|>assistant" + ANALYSIS + "two<|end|>" + FINAL + "done",
     ("one\ntwo", "done")),
    ("gpt-oss", {}, ANALYSIS + "think" + FINAL + "answer", ("think", "answer")),  # no <|end|>
    ("gpt-oss", {}, ANALYSIS + "r<|end|>\n" + FINAL + "a", ("r", "a")),  # whitespace between
    ("gpt-oss", {}, "<|channel|>final<|message|>Write a<|b|> if x < y", (None, "Write a<|b|> if x < y")),
    ("gpt-oss", {"thinking_in_prompt": True}, "r<|end|>" + FINAL + "a", ("r", "a")),
    # a tool call: the call passes into the content verbatim, for the tool-call parser
    ("gpt-oss", {}, ANALYSIS + "Need the weather.<|end|><|start|>assistant<|channel|>commentary "
     'to=functions.get_weather <|constrain|>json<|message|>{"city": "SF"}<|call|>',
     ("Need the weather.", "<|start|>assistant<|channel|>commentary to=functions.get_weather "
      '<|constrain|>json<|message|>{"city": "SF"}<|call|>')),
    ("gpt-oss", {}, '<|channel|>commentary to=functions.ping <|constrain|>json<|message|>{}',
     (None, '<|channel|>commentary to=functions.ping <|constrain|>json<|message|>{}')),
    ("gpt-oss", {}, ANALYSIS + "x<|end|><|start|>assistant to=functions.f<|channel|>commentary json"
     '<|message|>{"a": 1}<|call|>',
     ("x", '<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{"a": 1}<|call|>')),
    ("gpt-oss", {}, ANALYSIS + "x<|end|><|start|>assistant<|channel|>commentary to=functions.f <|constr",
     ("x", "<|start|>assistant<|channel|>commentary to=functions.f <|constr")),  # cut in the header
    # a call not ended by <|call|> (not a stop token here): the next message ends it
    ("gpt-oss", {}, '<|channel|>commentary to=functions.f json<|message|>{"a": 1}' + FINAL + "Done",
     (None, '<|channel|>commentary to=functions.f json<|message|>{"a": 1}<|call|>Done')),
    # a preamble (commentary without recipient) is shown to the user: content
    ("gpt-oss", {}, ANALYSIS + "plan<|end|><|start|>assistant<|channel|>commentary<|message|>"
     "Checking the weather.<|end|>" + FINAL + "Sunny.", ("plan", "Checking the weather.\nSunny.")),
]
IDS = [f"{name}-{i}" for i, (name, *_) in enumerate(RECORDED)]


def _streamed(name: str, kwargs: dict, pieces) -> tuple[str | None, str]:
    parser = ReasoningParser(name, **kwargs)
    reasoning = content = ""
    for piece in pieces:
        r, c = parser.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    reasoning, content = reasoning + r, content + c
    return (reasoning.strip() if parser.had_reasoning else None), content


def _tokens(text: str) -> list[str]:
    """A tokenizer's cut: markers whole, words with their leading space, punctuation alone."""
    pieces = re.findall(r"<\|[a-z]+\|>|<\|[a-z_]+>|<[a-z_]+\|>|◁/?think▷|</?think>|\s*\w+|\s+|.", text)
    assert "".join(pieces) == text
    return pieces


@pytest.mark.parametrize("name,kwargs,text,expected", RECORDED, ids=IDS)
def test_recorded_output_parses_whole(name, kwargs, text, expected):
    assert ReasoningParser(name, **kwargs).parse(text) == expected


@pytest.mark.parametrize("name,kwargs,text,expected", RECORDED, ids=IDS)
def test_recorded_output_streams_the_same_whatever_the_cut(name, kwargs, text, expected):
    assert _streamed(name, kwargs, list(text)) == expected, "one character at a time"
    assert _streamed(name, kwargs, _tokens(text)) == expected, "one token at a time"
    for size in (2, 3, 5, 8):
        assert _streamed(name, kwargs, [text[i:i + size] for i in range(0, len(text), size)]) \
            == expected, size
    for cut in range(len(text) + 1):
        assert _streamed(name, kwargs, [text[:cut], text[cut:]]) == expected, cut


def test_partial_markers_are_held_back_until_decided():
    parser = ReasoningParser("gpt-oss")
    assert parser.feed("<|chan") == ("", "")
    assert parser.feed("nel|>analysis<|mess") == ("", "")
    assert parser.feed("age|>a <|e") == ("a ", "")
    assert parser.feed("nd|>") == ("", "")
    assert parser.state == "content"  # the analysis message closed: held reasoning may leave
    kimi = ReasoningParser("kimi")
    assert kimi.feed("◁think▷idea◁/th") == ("idea", "")
    assert kimi.feed("ink▷ans") == ("", "ans")


def test_state_follows_the_harmony_channels():
    parser = ReasoningParser("gpt-oss")
    assert parser.state == "start"
    parser.feed(ANALYSIS + "r")
    assert parser.state == "reasoning"
    parser.feed("<|end|>" + FINAL + "a")
    assert parser.state == "content"


def test_for_request_starts_inside_a_block_the_prompt_opened():
    v3 = "<｜User｜>1+3?<｜Assistant｜>"
    assert ReasoningParser.for_request("deepseek-v3", prompt_text=v3 + "<think>").parse("s</think>4") \
        == ("s", "4")
    assert ReasoningParser.for_request("deepseek-v3", prompt_text=v3 + "</think>").parse("4") == (None, "4")
    assert ReasoningParser.for_request("deepseek-v3", prompt_text=v3,
                                       chat_template_kwargs={"thinking": True}).parse("s</think>4") \
        == ("s", "4")
    assert ReasoningParser.for_request("qwen3", prompt_text="<|im_start|>assistant\n<think>\n") \
        .parse("s</think>4") == ("s", "4")
    assert ReasoningParser.for_request("qwen3", prompt_text="<|im_start|>assistant\n",
                                       chat_template_kwargs={"thinking": True}).parse("4") == (None, "4")
    assert ReasoningParser.for_request("kimi", prompt_text="assistant◁think▷").parse("s◁/think▷4") \
        == ("s", "4")
    assert ReasoningParser.for_request("gpt-oss", prompt_text="<|start|>assistant" + ANALYSIS) \
        .parse("s<|end|>" + FINAL + "4") == ("s", "4")
    assert ReasoningParser.for_request("gpt-oss", prompt_text="<|start|>assistant") \
        .parse(ANALYSIS + "s<|end|>" + FINAL + "4") == ("s", "4")


def test_only_kimi_k2_gemma4_and_gpt_oss_need_the_special_tokens_kept():
    assert [name for name in PARSERS if needs_special_tokens(name)] == ["kimi_k2", "gemma4", "gpt-oss"]
    assert not needs_special_tokens(None)


def test_every_parser_is_a_launch_choice_and_unknown_names_are_refused():
    field = next(f for f in dataclasses.fields(ServerArgs) if f.name == "reasoning_parser")
    assert sorted(field.metadata["choices"]) == sorted(PARSERS)
    with pytest.raises(ValueError, match="unknown reasoning parser 'kimi-k2'.*gpt-oss"):
        ReasoningParser("kimi-k2")
