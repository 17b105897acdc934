"""gpt-oss chat in Harmony format (xlaserve/http/parsing/harmony.py, harmony_vocab.py): prompts
rendered by openai-harmony exactly as the Harmony format spells them, offline; the o200k
vocabulary from $TIKTOKEN_ENCODINGS_BASE or written back from gpt-oss's own tokenizer; the stop
tokens; the request options; and the parsers on output that harmony itself tokenized."""
from __future__ import annotations

import hashlib
import os

import pytest

from tests.http.harmony_support import (harmony_chat, o200k_harmony_tokenizer,
                                        small_harmony_tokenizer, write_o200k_vocab)
from xlaserve.http.errors import APIError
from xlaserve.http.parsing import harmony
from xlaserve.http.parsing.harmony_vocab import (ENCODINGS_BASE, O200K_SHA256, VOCAB_FILE,
                                                 load_encoding, o200k_from_tokenizer)
from xlaserve.http.parsing.reasoning import ReasoningParser
from xlaserve.http.parsing.tool_parsers import TOOL_CALL_PARSERS
from xlaserve.http.protocol import ChatCompletionRequest, ChatMessage
from xlaserve.http.request_fields import validate_body

TODAY = "2025-08-05"


@pytest.fixture(scope="module")
def vocab_dir(tmp_path_factory):
    return write_o200k_vocab(str(tmp_path_factory.mktemp("o200k")))


@pytest.fixture(scope="module")
def chat(vocab_dir):
    chat = harmony_chat(vocab_dir)
    assert not chat.native_ids  # no tokenizer to compare with: the text is encoded again
    return chat


@pytest.fixture(scope="module")
def encoding(chat):
    return chat.encoding


@pytest.fixture(scope="module")
def gpt_oss_tokenizer(vocab_dir):
    return o200k_harmony_tokenizer(vocab_dir)


@pytest.fixture(scope="module")
def small_tokenizer():
    return small_harmony_tokenizer()


def messages(*items: dict) -> list[ChatMessage]:
    return [ChatMessage(**item) for item in items]


def system(effort: str, tools: bool = False) -> str:
    return ("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
            f"Knowledge cutoff: 2024-06\nCurrent date: {TODAY}\n\nReasoning: {effort}\n\n"
            "# Valid channels: analysis, commentary, final. Channel must be included for every "
            "message." + ("\nCalls to these tools must go to the commentary channel: 'functions'."
                          if tools else "") + "<|end|>")


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
WEATHER_TS = ("# Tools\n\n## functions\n\nnamespace functions {\n\n// Current weather in a city.\n"
              "type get_weather = (_: {\n// The city name\ncity: string,\n"
              'unit?: "celsius" | "fahrenheit",\n}) => any;\n\n} // namespace functions')
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TOOL_CALL_TEXT = ('<|start|>assistant to=functions.get_weather<|channel|>commentary '
                  '<|constrain|>json<|message|>{"city": "Paris"}<|call|>')
TOOL_RESULT_TEXT = ('<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>'
                    '{"temp": 21}<|end|>')

# (case, messages, tools, reasoning effort, the prompt Harmony's format gives)
CONVERSATIONS = [
    ("system-and-user", messages({"role": "system", "content": "Answer in French."},
                                 {"role": "user", "content": "Hello!"}), None, "low",
     system("low") + "<|start|>developer<|message|># Instructions\n\nAnswer in French.<|end|>"
     "<|start|>user<|message|>Hello!<|end|><|start|>assistant"),
    ("user-only", messages({"role": "user", "content": "Hi"}), None, "medium",
     system("medium") + "<|start|>user<|message|>Hi<|end|><|start|>assistant"),
    ("tools", messages({"role": "developer", "content": "Be brief."},
                       {"role": "user", "content": [{"type": "text", "text": "Weather"},
                                                    {"type": "text", "text": "in Paris?"}]}),
     [WEATHER], "high",
     system("high", tools=True) + "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n"
     + WEATHER_TS + "<|end|><|start|>user<|message|>Weather\nin Paris?<|end|><|start|>assistant"),
    ("tool-result", messages(
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "Need the weather tool.",
         "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}), [WEATHER], "medium",
     system("medium", tools=True) + "<|start|>developer<|message|>" + WEATHER_TS + "<|end|>"
     "<|start|>user<|message|>Weather in Paris?<|end|>"
     "<|start|>assistant<|channel|>analysis<|message|>Need the weather tool.<|end|>"
     + TOOL_CALL_TEXT + TOOL_RESULT_TEXT + "<|start|>assistant"),
    # An earlier turn's reasoning goes (its final answer came); the current turn's stays.
    ("multi-turn", messages(
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "Use the tool.",
         "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        {"role": "assistant", "content": "21 degrees.", "reasoning_content": "It is 21."},
        {"role": "user", "content": "And in Rome?"},
        {"role": "assistant", "content": None, "reasoning_content": "Again the tool.",
         "tool_calls": [{**CALL, "id": "call_2", "function": {"name": "get_weather",
                                                               "arguments": '{"city":"Rome"}'}}]}),
     [WEATHER], "medium",
     system("medium", tools=True) + "<|start|>developer<|message|>" + WEATHER_TS + "<|end|>"
     "<|start|>user<|message|>Weather in Paris?<|end|>"
     "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>" + TOOL_CALL_TEXT
     + TOOL_RESULT_TEXT + "<|start|>assistant<|channel|>final<|message|>21 degrees.<|end|>"
     "<|start|>user<|message|>And in Rome?<|end|>"
     "<|start|>assistant<|channel|>analysis<|message|>Again the tool.<|end|>"
     '<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json'
     '<|message|>{"city":"Rome"}<|call|><|start|>assistant'),
]


@pytest.mark.parametrize("case,conversation,tools,effort,expected", CONVERSATIONS,
                         ids=[c[0] for c in CONVERSATIONS])
def test_conversations_render_as_the_harmony_format_spells_them(chat, encoding, case, conversation,
                                                                tools, effort, expected):
    text = chat.render(conversation, tools, today=TODAY, reasoning_effort=effort)
    assert text == expected
    # The text encodes back to the ids harmony rendered (what the model's o200k tokenizer reads).
    assert encoding.encode(text, allowed_special="all") == \
        chat.prompt_ids(conversation, tools, today=TODAY, reasoning_effort=effort)


def test_model_identity_and_reasoning_effort_come_from_the_request(chat):
    options = harmony.harmony_options(None, {"model_identity": "You are Oss.",
                                             "reasoning_effort": "low"})
    text = chat.render(messages({"role": "user", "content": "Hi"}), None, today=TODAY, **options)
    assert text.startswith("<|start|>system<|message|>You are Oss.\nKnowledge cutoff")
    assert "\nReasoning: low\n" in text
    assert harmony.harmony_options(None, None) == {"reasoning_effort": "medium", "model_identity": None}
    assert harmony.harmony_options("high", {"reasoning_effort": "high"})["reasoning_effort"] == "high"


@pytest.mark.parametrize("effort,kwargs,param", [
    ("high", {"reasoning_effort": "low"}, "reasoning_effort"),
    (None, {"reasoning_effort": "max"}, "chat_template_kwargs"),
    (None, {"enable_thinking": True}, "chat_template_kwargs"),
    (None, {"model_identity": 3}, "chat_template_kwargs"),
])
def test_harmony_options_a_template_kwarg_harmony_cannot_honour_is_a_400(effort, kwargs, param):
    with pytest.raises(APIError) as error:
        harmony.harmony_options(effort, kwargs)
    assert (error.value.status, error.value.param) == (400, param)


def test_reasoning_effort_outside_openais_values_is_a_400_naming_it():
    body = {"messages": [{"role": "user", "content": "Hi"}]}
    for good in ("none", "minimal", "low", "medium", "high", "xhigh", "max"):  # the SDK's
        assert validate_body({**body, "reasoning_effort": good},
                             ChatCompletionRequest).reasoning_effort == good
    for bad in ("extreme", 1):
        with pytest.raises(APIError) as error:
            validate_body({**body, "reasoning_effort": bad}, ChatCompletionRequest)
        assert (error.value.status, error.value.param) == (400, "reasoning_effort")


@pytest.mark.parametrize("effort", ["none", "minimal", "xhigh", "max"])
def test_gpt_oss_takes_only_low_medium_and_high(effort):
    with pytest.raises(APIError, match="takes low, medium, high") as error:
        harmony.harmony_options(effort, None)
    assert (error.value.status, error.value.param) == (400, "reasoning_effort")


def test_reasoning_effort_on_other_templates_is_sglangs():
    """Given to a template that reads it; "none" turns thinking off; else nothing changes."""
    from xlaserve.http.parsing.chat_template import with_reasoning_effort
    from xlaserve.weights.loader import default_model_file, load_tokenizer

    tokenizer = load_tokenizer(default_model_file())  # its template reads neither variable
    assert with_reasoning_effort(tokenizer, None, {"x": 1}, "high") == {"x": 1}
    assert with_reasoning_effort(tokenizer, None, None, "none") == {"enable_thinking": False}
    with pytest.raises(APIError, match="contradict"):
        with_reasoning_effort(tokenizer, None, {"enable_thinking": True}, "none")
    reads_it = "{{ reasoning_effort }}{% for m in messages %}{{ m.content }}{% endfor %}"
    assert with_reasoning_effort(tokenizer, reads_it, None, "low") == {"reasoning_effort": "low"}


def test_a_tool_message_must_answer_an_earlier_call(chat):
    orphan = messages({"role": "user", "content": "Hi"},
                      {"role": "tool", "tool_call_id": "call_9", "content": "x"})
    with pytest.raises(APIError, match="tool_call_id") as error:
        chat.render(orphan, None, today=TODAY)
    assert error.value.param == "messages"
    bad_arguments = messages({"role": "assistant", "tool_calls": [
        {**CALL, "function": {"name": "get_weather", "arguments": "{city: Paris"}}]})
    with pytest.raises(APIError, match="JSON"):
        chat.render(bad_arguments, None, today=TODAY)


def test_malformed_tools_and_tool_calls_are_400s_not_500s(chat):
    user = messages({"role": "user", "content": "Hi"})
    with pytest.raises(APIError, match="description must be a string") as error:
        chat.render(user, [{"type": "function", "function": {"name": "f", "description": 3}}], today=TODAY)
    assert error.value.param == "tools"
    odd_call = messages({"role": "assistant", "tool_calls": [{"id": ["x"], "function": "f"}]})
    with pytest.raises(APIError, match="function.name") as error:
        chat.render(odd_call, None, today=TODAY)
    assert error.value.param == "messages"


# --- the vocabulary, offline ------------------------------------------------------------------

def test_the_vocabulary_is_written_back_byte_exact_from_gpt_oss_tokenizer(gpt_oss_tokenizer, vocab_dir,
                                                                         chat, monkeypatch):
    vocab = o200k_from_tokenizer(gpt_oss_tokenizer)
    assert hashlib.sha256(vocab).hexdigest() == O200K_SHA256
    with open(os.path.join(vocab_dir, VOCAB_FILE), "rb") as f:
        assert vocab == f.read()
    monkeypatch.delenv(ENCODINGS_BASE, raising=False)
    encoding, native_ids = load_encoding(gpt_oss_tokenizer)
    assert native_ids and ENCODINGS_BASE not in os.environ  # put back as it was
    from_tokenizer = harmony.HarmonyChat(encoding, native_ids)
    conversation, tools = CONVERSATIONS[3][1:3]
    assert from_tokenizer.render(conversation, tools, today=TODAY) == \
        chat.render(conversation, tools, today=TODAY)


def test_without_an_o200k_tokenizer_the_vocabulary_must_be_named(small_tokenizer, monkeypatch,
                                                                 tmp_path):
    monkeypatch.delenv(ENCODINGS_BASE, raising=False)
    assert o200k_from_tokenizer(small_tokenizer) is None
    with pytest.raises(ValueError, match=f"set {ENCODINGS_BASE}"):
        load_encoding(small_tokenizer)
    monkeypatch.setenv(ENCODINGS_BASE, str(tmp_path))  # a folder without the file
    with pytest.raises(ValueError, match=f"could not load {VOCAB_FILE} from \\${ENCODINGS_BASE}"):
        load_encoding(small_tokenizer)


def test_a_vocabulary_file_that_is_not_o200k_is_refused(vocab_dir, tmp_path, monkeypatch):
    with open(os.path.join(vocab_dir, VOCAB_FILE), "rb") as f:
        lines = f.read().splitlines(keepends=True)
    lines[1000], lines[1001] = lines[1001], lines[1000]  # two ranks swapped
    (tmp_path / VOCAB_FILE).write_bytes(b"".join(lines))
    monkeypatch.setenv(ENCODINGS_BASE, str(tmp_path))
    with pytest.raises(ValueError, match="could not load"):
        load_encoding()


def test_a_tokenizer_with_o200k_ids_but_another_vocabulary_is_not_o200k(vocab_dir):
    swapped = o200k_harmony_tokenizer(vocab_dir, swap=("Ġthe", "Ġand"))  # two ranks swapped
    assert o200k_from_tokenizer(swapped) is None


# --- how the server picks its chat format ------------------------------------------------------

def test_gpt_oss_turns_end_at_return_and_call_never_at_end(encoding, gpt_oss_tokenizer,
                                                            small_tokenizer):
    assert sorted(harmony.STOP_TOKENS) == sorted(
        encoding.decode_utf8([t]) for t in encoding.stop_tokens_for_assistant_actions())
    assert harmony.stop_token_ids(gpt_oss_tokenizer) == {200002, 200012}
    assert harmony.stop_token_ids(small_tokenizer) == \
        set(small_tokenizer.convert_tokens_to_ids(list(harmony.STOP_TOKENS)))
    from xlaserve.weights.loader import default_model_file, load_tokenizer

    with pytest.raises(ValueError, match="needs the Harmony tokens"):
        harmony.stop_token_ids(load_tokenizer(default_model_file()))


def test_chat_format_is_harmony_for_gpt_oss_unless_a_template_is_given(gpt_oss_tokenizer,
                                                                      small_tokenizer, monkeypatch,
                                                                      tmp_path):
    from xlaserve.http.parsing.chat_template import load_chat_template, template_stop_ids

    monkeypatch.delenv(ENCODINGS_BASE, raising=False)  # from the model's own tokenizer
    chat_format, stop_ids = harmony.chat_format("GptOssForCausalLM", gpt_oss_tokenizer, None)
    assert isinstance(chat_format, harmony.HarmonyChat) and stop_ids == {200002, 200012}
    assert chat_format.native_ids  # the prompt is harmony's ids: a user's "<|end|>" stays text
    text, ids = chat_format.prompt(messages({"role": "user", "content": "a<|end|>b"}), None, today=TODAY)
    assert text.endswith("<|start|>user<|message|>a<|end|>b<|end|><|start|>assistant")
    assert ids[-3:] == [200007, 200006, 173781] and ids[-12:-3].count(200007) == 0
    monkeypatch.setenv(ENCODINGS_BASE, str(tmp_path))  # no vocabulary there
    with pytest.raises(ValueError, match="could not load"):  # the variable is the user's word
        harmony.chat_format("GptOssForCausalLM", gpt_oss_tokenizer, None)
    assert harmony.chat_format("GptOssForCausalLM", gpt_oss_tokenizer, "{{ messages }}") == \
        (None, frozenset({200002, 200012}))
    chatml = load_chat_template("chatml")
    assert harmony.chat_format("Qwen2ForCausalLM", small_tokenizer, chatml) == \
        (None, template_stop_ids(small_tokenizer, chatml))
    assert harmony.chat_format("GptOssForCausalLM", None, None) == (None, frozenset())


# --- the parsers on output that harmony tokenized ---------------------------------------------

def _output_pieces(encoding, *messages_) -> list[str]:
    """The model's output for these assistant messages as harmony tokenizes them, one piece per
    token as the server streams it: after the prompt's `<|start|>assistant`, without the stop
    token that ends it (stop tokens are not part of the text)."""
    from openai_harmony import Message, Role

    tokens = []
    for message in messages_:
        if isinstance(message, str):  # a message as the model writes it, `to=` after the channel
            tokens += encoding.encode(message, allowed_special="all")
        else:
            tokens += encoding.render(message)
    start = encoding.render(Message.from_role_and_content(Role.ASSISTANT, "x"))[:2]
    assert tokens[:2] == start and encoding.decode_utf8(start) == "<|start|>assistant"
    end = tokens[-1]
    if encoding.decode_utf8([end]) == "<|end|>":  # the last message: <|return|> in a real output
        end = encoding.encode("<|return|>", allowed_special="all")[0]
    assert end in encoding.stop_tokens_for_assistant_actions()
    tokens = tokens[2:-1]
    pieces, sent = [], ""
    for k in range(len(tokens)):
        text = encoding.decode(tokens[:k + 1])
        if text.endswith("\ufffd"):  # a character split over tokens: sent with its last token
            continue
        pieces.append(text[len(sent):])
        sent = text
    return pieces


def _through_parsers(pieces, tools=None):
    """As a chat response streams them: the reasoning parser, then the tool parser on its content."""
    reasoning_parser, tool_parser = ReasoningParser("gpt-oss"), TOOL_CALL_PARSERS["gpt-oss"](tools)
    reasoning, content, calls = "", "", []
    for at, piece in enumerate(pieces):
        r, c = reasoning_parser.feed(piece)
        if at == len(pieces) - 1:  # the last piece: both parsers finish (chat.py's splits)
            more_r, more_c = reasoning_parser.finish()
            r, c = r + more_r, c + more_c
        text, deltas = tool_parser.feed(c)
        if at == len(pieces) - 1:
            more_text, more_deltas = tool_parser.finish()
            text, deltas = text + more_text, deltas + more_deltas
        reasoning, content, calls = reasoning + r, content + text, calls + deltas
    return reasoning, content, [(d.name, d.arguments) for d in calls]


def _assistant(text, channel):
    from openai_harmony import Message, Role

    return Message.from_role_and_content(Role.ASSISTANT, text).with_channel(channel)


def test_reasoning_and_answer_of_a_harmony_output(encoding):
    pieces = _output_pieces(encoding, _assistant("The user greets; answer with a café ☕.", "analysis"),
                            _assistant("Bonjour ! Un café ☕ ?", "final"))
    assert len(pieces) > 10
    assert _through_parsers(pieces) == ("The user greets; answer with a café ☕.",
                                        "Bonjour ! Un café ☕ ?", [])
    assert ReasoningParser("gpt-oss").parse("".join(pieces)) == \
        ("The user greets; answer with a café ☕.", "Bonjour ! Un café ☕ ?")


@pytest.mark.parametrize("call", [
    # as harmony renders a call (recipient before the channel) ...
    pytest.param(lambda: _assistant('{"city":"Paris","unit":"celsius"}', "commentary")
                 .with_recipient("functions.get_weather").with_content_type("<|constrain|>json"),
                 id="harmony-rendered"),
    # ... and as gpt-oss writes one (after it)
    pytest.param(lambda: '<|start|>assistant<|channel|>commentary to=functions.get_weather '
                         '<|constrain|>json<|message|>{"city":"Paris","unit":"celsius"}<|call|>',
                 id="model-written"),
])
def test_a_harmony_tool_call_becomes_a_tool_call(encoding, call):
    pieces = _output_pieces(encoding, _assistant("Need the weather in Paris.", "analysis"), call())
    expected = ("Need the weather in Paris.", "",
                [("get_weather", ""), (None, '{"city": "Paris", "unit": "celsius"}')])
    assert _through_parsers(pieces, [WEATHER]) == expected
    assert _through_parsers(list("".join(pieces)), [WEATHER]) == expected  # any cut
    # A preamble to the user (commentary without recipient) stays content.
    with_preamble = _output_pieces(encoding, _assistant("Checking.", "commentary"), call())
    assert _through_parsers(with_preamble, [WEATHER])[1:] == ("Checking.", expected[2])


def test_without_the_reasoning_parser_the_other_messages_stay_in_the_content(encoding):
    pieces = _output_pieces(encoding, _assistant("Need it.", "analysis"),
                            _assistant('{"city":"Oslo"}', "commentary")
                            .with_recipient("functions.get_weather").with_content_type("json"))
    content, calls = TOOL_CALL_PARSERS["gpt-oss"]([WEATHER]).parse("".join(pieces))
    assert content == "<|channel|>analysis<|message|>Need it.<|end|>"
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Oslo"}')]


# --- through the server: the tiny model's engine behind a Harmony chat format -----------------

from tests.http.test_chat_templates_and_reasoning import variant  # noqa: E402,F401 (a fixture)

PARIS = [{"role": "user", "content": "Weather in Paris?"}]


def _post(base_url: str, **body):
    import httpx

    body = {"model": "tiny", "max_tokens": 2, "temperature": 0, **body}
    return httpx.post(base_url + "/v1/chat/completions", json=body, timeout=60)


def test_a_chat_request_renders_the_harmony_prompt_and_keeps_its_markers(server, chat):
    import dataclasses
    import datetime

    from xlaserve.http.chat import ChatCall

    ctx = dataclasses.replace(server.ctx, harmony=chat, reasoning_parser="gpt-oss",
                              tool_call_parser="gpt-oss")
    req = ChatCompletionRequest(messages=PARIS, tools=[WEATHER], reasoning_effort="high", max_tokens=4)
    call = ChatCall(ctx, req)
    assert call.prompt_text == chat.render(req.messages, [WEATHER], reasoning_effort="high",
                                           today=datetime.date.today().isoformat())
    assert call.prompt_ids == server.ctx.tokenizer.encode(call.prompt_text, add_special_tokens=False)
    assert call.params.skip_special_tokens is False  # the parsers read the Harmony markers


def test_a_gpt_oss_server_answers_and_refuses_what_harmony_cannot_render(server, chat, variant):
    import datetime

    app = variant(harmony=chat, reasoning_parser="gpt-oss", tool_call_parser="gpt-oss")
    response = _post(app.base_url, messages=PARIS, tools=[WEATHER], reasoning_effort="low")
    assert response.status_code == 200, response.text
    expected = chat.render([ChatMessage(**m) for m in PARIS], [WEATHER], reasoning_effort="low",
                           today=datetime.date.today().isoformat())
    assert response.json()["usage"]["prompt_tokens"] == \
        len(server.ctx.tokenizer.encode(expected, add_special_tokens=False))
    for body, param in [
            (dict(messages=PARIS + [{"role": "assistant", "content": "It is"}],
                  continue_final_message=True), "continue_final_message"),
            (dict(messages=PARIS, chat_template_kwargs={"enable_thinking": False}),
             "chat_template_kwargs"),
            (dict(messages=PARIS, reasoning_effort="minimal"), "reasoning_effort")]:
        response = _post(app.base_url, **body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, body


def test_reasoning_effort_reaches_only_a_template_that_reads_it(server, variant):
    from xlaserve.http.parsing.chat_template import load_chat_template

    plain = _post(server.base_url, messages=PARIS)
    response = _post(server.base_url, messages=PARIS, reasoning_effort="high")  # ChatML: no use
    assert response.status_code == 200  # as SGLang: accepted, and the prompt is unchanged
    assert response.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"]
    reads_it = variant(chat_template=load_chat_template(
        "{{ reasoning_effort }}:{% for m in messages %}{{ m['content'] }}{% endfor %}"))
    response = _post(reads_it.base_url, messages=PARIS, reasoning_effort="high")
    assert response.json()["usage"]["prompt_tokens"] == \
        len(server.ctx.tokenizer.encode("high:Weather in Paris?", add_special_tokens=False))
