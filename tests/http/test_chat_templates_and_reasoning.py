"""Chat templates (the tokenizer's, --chat-template, chat_template_kwargs, roles, tools) and the
reasoning parsers that split `reasoning_content` from `content`."""
import dataclasses

import httpx
import pytest

from tests.http.conftest import AppServer
from xlaserve.http.parsing.chat_template import load_chat_template
from xlaserve.http.parsing.reasoning import ReasoningParser

NO_EOS = {"logit_bias": {"2": -100}}


# --- the parsers, on text ---------------------------------------------------------------------

@pytest.mark.parametrize("name,text,expected", [
    ("qwen3", "<think>\nplan it\n</think>\n\nThe answer.", ("plan it", "The answer.")),
    ("qwen3", "No thinking here.", (None, "No thinking here.")),
    ("qwen3", "  <think>unfinished", ("unfinished", "")),
    ("deepseek-r1", "plan it</think>\n\nThe answer.", ("plan it", "The answer.")),
    ("deepseek-r1", "<think>plan</think>answer", ("plan", "answer")),
    ("deepseek-r1", "never closes", ("never closes", "")),
    ("qwen3-thinking", "a</think>b", ("a", "b")),
])
def test_parsers_split_reasoning_from_content(name, text, expected):
    assert ReasoningParser(name).parse(text) == expected


@pytest.mark.parametrize("name", ["qwen3", "deepseek-r1"])
def test_streamed_pieces_split_like_the_whole_text_whatever_the_cut(name):
    text = "<think>\nstep one </thi then </think>\n\nfinal <answer>"
    whole_reasoning, whole_content = ReasoningParser(name).parse(text)
    for size in (1, 2, 3, 5, 8):
        parser = ReasoningParser(name)
        reasoning = content = ""
        for start in range(0, len(text), size):
            r, c = parser.feed(text[start:start + size])
            reasoning, content = reasoning + r, content + c
        r, c = parser.finish()
        assert ((reasoning + r).strip(), content + c) == (whole_reasoning, whole_content), size


def test_thinking_opened_by_the_prompt_makes_qwen3_start_inside_reasoning():
    assert ReasoningParser("qwen3", thinking_in_prompt=True).parse("idea</think>done") == ("idea", "done")


# --- through the server -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def variant(server):
    """Apps over the same engine with other serving options (no second model load)."""
    from xlaserve.http.app import create_app

    started = []

    def start(**changes):
        ctx = dataclasses.replace(server.ctx, **changes)
        started.append(AppServer(create_app(ctx), ctx))
        return started[-1]

    yield start
    for running in started:
        running.close()


def _chat(base_url: str, **body):
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0, **NO_EOS, **body}
    response = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


USER = [{"role": "user", "content": "Think first."}]


def test_reasoning_parser_fills_reasoning_content_unless_separate_reasoning_is_false(server, variant):
    raw = _chat(server.base_url, messages=USER)["choices"][0]["message"]
    assert raw["reasoning_content"] is None
    r1 = variant(reasoning_parser="deepseek-r1")
    split = _chat(r1.base_url, messages=USER)["choices"][0]["message"]
    assert (split["reasoning_content"], split["content"]) == (raw["content"].strip(), "")
    joined = _chat(r1.base_url, messages=USER, separate_reasoning=False)["choices"][0]["message"]
    assert (joined["reasoning_content"], joined["content"]) == (None, raw["content"])
    with httpx.stream("POST", r1.base_url + "/v1/chat/completions", timeout=60,
                      json={"model": "tiny", "messages": USER, "max_tokens": 6, "temperature": 0,
                            "stream": True, **NO_EOS}) as response:
        import orjson
        deltas = [orjson.loads(line[6:])["choices"][0]["delta"] for line in response.iter_lines()
                  if line.startswith("data: {")]
    assert "".join(d.get("reasoning_content") or "" for d in deltas).strip() == split["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == ""


def _prompt_tokens(base_url, **body) -> int:
    return _chat(base_url, max_tokens=1, **body)["usage"]["prompt_tokens"]


def test_chat_template_flag_takes_names_files_and_jinja(server, variant, tmp_path):
    tokenizer = server.ctx.tokenizer
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}[assistant]"
    path = tmp_path / "template.jinja"
    path.write_text(template)
    for value in (str(path), template):
        custom = variant(chat_template=load_chat_template(value))
        count = _prompt_tokens(custom.base_url, messages=[{"role": "user", "content": "hi"}])
        assert count == len(tokenizer.encode("[user]hi[assistant]", add_special_tokens=False))
    chatml = variant(chat_template=load_chat_template("chatml"))
    count = _prompt_tokens(chatml.base_url, messages=[{"role": "user", "content": "hi"}])
    assert count == len(tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
                                         add_special_tokens=False))
    with pytest.raises(ValueError, match="not a file"):
        load_chat_template("no-such-template")


def test_kwargs_roles_parts_and_tools_reach_the_template(server, variant):
    tokenizer = server.ctx.tokenizer
    template = ("{% if shout %}LOUD {% endif %}{% for t in tools or [] %}tool:{{ t['function']['name'] }} "
                "{% endfor %}{% for m in messages %}{{ m['role'] }}={{ m['content'] }}"
                "{% for c in m.get('tool_calls') or [] %}call:{{ c['function']['arguments']['city'] }}"
                "{% endfor %};{% endfor %}")
    custom = variant(chat_template=load_chat_template(template))
    messages = [{"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "1", "type": "function",
                     "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "content": "rain", "tool_call_id": "1"}]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    count = _prompt_tokens(custom.base_url, messages=messages, tools=tools,
                           chat_template_kwargs={"shout": True})
    expected = "LOUD tool:weather system=be brief;user=a\nb;assistant=call:Oslo;tool=rain;"
    assert count == len(tokenizer.encode(expected, add_special_tokens=False))


def test_continue_final_message_continues_the_assistant_turn(server):
    messages = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "My answer is"}]
    count = _prompt_tokens(server.base_url, messages=messages, continue_final_message=True)
    text = server.ctx.tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert text.endswith("My answer is")
    assert count == len(server.ctx.tokenizer.encode(text, add_special_tokens=False))


def test_vllms_add_generation_prompt_shapes_the_prompt(server):
    messages = [{"role": "user", "content": "Name a color."}]
    tokenizer = server.ctx.tokenizer
    for opening in (True, False):
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=opening)
        count = _prompt_tokens(server.base_url, messages=messages, add_generation_prompt=opening)
        assert count == len(tokenizer.encode(text, add_special_tokens=False))


def test_tool_call_arguments_nested_past_what_json_parses_are_a_400():
    """Found by test_fuzz.py: arguments nested 1000 deep raised RecursionError (a 500) on Python
    3.11; 3.12's json parses 1000 and raises past a few thousand, so 100,000 on any Python."""
    from xlaserve.http.parsing.chat_template import template_messages
    from xlaserve.http.errors import APIError
    from xlaserve.http.protocol import ChatMessage

    arguments = '{"a": ' * 100_000 + "1" + "}" * 100_000
    message = ChatMessage(role="assistant", tool_calls=[
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": arguments}}])
    with pytest.raises(APIError, match="must be a JSON object") as error:
        template_messages([message])
    assert error.value.status == 400 and error.value.param == "messages"
