"""gpt-oss served through the OpenAI SDK, as a user starts it (`--reasoning-parser gpt-oss
--tool-call-parser gpt-oss`): Harmony prompts, the answer split into `reasoning_content` and
`content` (plain and streamed), `reasoning_effort`, and `tool_calls`.

A random tiny model writes no Harmony, so this one is made to: its attention and experts add
nothing to the residual stream (zero output projections and biases), so each next token is a
function of the current one alone, and its embeddings and LM head make that function walk a
Harmony answer from the prompt's last token (`<|start|>assistant`): an analysis message then the
final text on one server, a function call on the other. Everything else (the sinks, YaRN, the
routers, the experts' gate|up weights) is random and runs as usual; transformers' greedy tokens on
the same weights are checked to be the same walk."""
import datetime
import json

import pytest
import torch

from tests.hf_reference import hf_greedy
from tests.http.conftest import RunningServer
from tests.http.harmony_support import small_harmony_tokenizer, write_o200k_vocab
from tests.tiny_models import make_tiny_checkpoint

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
REASONING, ANSWER = "Check weather", "Sunny"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string", "enum": ["Paris", "London"]}}}}}]


def _walk(tokenizer) -> list[int]:
    """The answer's tokens after the prompt's last one: analysis message, then the final text."""
    ids = tokenizer.convert_tokens_to_ids
    return [ids("<|channel|>"), *tokenizer.encode("analysis", add_special_tokens=False),
            ids("<|message|>"), *tokenizer.encode(REASONING, add_special_tokens=False),
            ids("<|end|>"), *tokenizer.encode(" " + ANSWER, add_special_tokens=False),
            ids("<|return|>")]


def _make_it_walk(model, start: int, walk: list[int]) -> None:
    """Token `start`, then each token of `walk`, leads to the next one (see the module's text)."""
    chain = [start, *walk]
    assert len(set(chain)) == len(chain), "each token of the walk must have one successor"
    hidden = model.config.hidden_size
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.self_attn.o_proj.bias.zero_()
            layer.mlp.experts.down_proj.zero_()
            layer.mlp.experts.down_proj_bias.zero_()
        model.model.norm.weight.fill_(1.0)
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        # The walk's tokens own the first len(chain) dimensions; every other token stays off them.
        embed[:, :len(chain)] = 0.0
        head[:, :len(chain)] = 0.0
        for i, token in enumerate(chain):
            embed[token] = 0.0
            embed[token, i] = hidden ** 0.5  # unit RMS: the final norm leaves it as is
            if i + 1 < len(chain):
                head[chain[i + 1], i] = 5.0  # a logit of 40, against ~1 for any other token


def _tool_call_walk(tokenizer) -> list[int]:
    """The answer's tokens: a call of get_weather (Harmony's commentary channel, to a function)."""
    ids = tokenizer.convert_tokens_to_ids
    return [ids("<|channel|>"), *tokenizer.encode("commentary to=functions.get_weather ",
                                                  add_special_tokens=False),
            ids("<|constrain|>"), *tokenizer.encode("json", add_special_tokens=False),
            ids("<|message|>"), *tokenizer.encode('{"city": "Paris"}', add_special_tokens=False),
            ids("<|call|>")]


def _serve(tmp_path_factory, walk_of):
    """A server on a tiny gpt-oss that walks `walk_of(tokenizer)`; -> (server, hf model,
    tokenizer)."""
    directory = str(tmp_path_factory.mktemp("tiny-gpt-oss"))
    tokenizer = small_harmony_tokenizer()
    hf_model = make_tiny_checkpoint(directory, "gpt_oss", vocab_size=len(tokenizer))
    last_prompt_token = tokenizer.encode("<|start|>assistant", add_special_tokens=False)[-1]
    _make_it_walk(hf_model, last_prompt_token, walk_of(tokenizer))
    hf_model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    with pytest.MonkeyPatch.context() as patch:  # the o200k vocabulary, offline
        patch.setenv("TIKTOKEN_ENCODINGS_BASE",
                     write_o200k_vocab(str(tmp_path_factory.mktemp("o200k"))))
        running = RunningServer(directory, served_model_name="tiny-gpt-oss",
                                reasoning_parser="gpt-oss", tool_call_parser="gpt-oss")
    return running, hf_model, tokenizer


@pytest.fixture(scope="module")
def gpt_oss_server(tmp_path_factory):
    running = _serve(tmp_path_factory, _walk)
    yield running
    running[0].close()


@pytest.fixture(scope="module")
def gpt_oss_tool_server(tmp_path_factory):
    running = _serve(tmp_path_factory, _tool_call_walk)
    yield running
    running[0].close()


def _prompt_ids(server, tokenizer, **options) -> list[int]:
    from xlaserve.http.protocol import ChatCompletionRequest

    request = ChatCompletionRequest(model="tiny-gpt-oss", messages=MESSAGES)
    text = server.ctx.harmony.render(request.messages, None,
                                     today=datetime.date.today().isoformat(), **options)
    return tokenizer.encode(text, add_special_tokens=False)


def test_chat_answer_is_split_into_reasoning_and_content(gpt_oss_server):
    server, hf_model, tokenizer = gpt_oss_server
    prompt = _prompt_ids(server, tokenizer)
    walk = _walk(tokenizer)
    # transformers walks the same way on these weights (its stop token ends the walk).
    assert hf_greedy(hf_model, prompt, len(walk)) == walk
    response = server.openai().chat.completions.create(
        model="tiny-gpt-oss", messages=MESSAGES, temperature=0, max_tokens=32)
    choice = response.choices[0]
    assert response.usage.prompt_tokens == len(prompt)
    assert choice.message.reasoning_content == REASONING
    assert choice.message.content.strip() == ANSWER
    assert choice.finish_reason == "stop" and response.usage.completion_tokens == len(walk)


def test_streamed_chat_gives_the_same_reasoning_and_content(gpt_oss_server):
    server, _, _ = gpt_oss_server
    stream = server.openai().chat.completions.create(
        model="tiny-gpt-oss", messages=MESSAGES, temperature=0, max_tokens=32, stream=True)
    reasoning, content, finish = [], [], None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning.append(getattr(delta, "reasoning_content", None) or "")
        content.append(delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(reasoning) == REASONING
    assert "".join(content).strip() == ANSWER and finish == "stop"


def test_reasoning_effort_goes_into_the_harmony_system_message(gpt_oss_server):
    server, _, tokenizer = gpt_oss_server
    client = server.openai()
    usage = {}
    for effort in ("low", "high"):
        response = client.chat.completions.create(
            model="tiny-gpt-oss", messages=MESSAGES, temperature=0, max_tokens=4,
            reasoning_effort=effort)
        usage[effort] = response.usage.prompt_tokens
        assert usage[effort] == len(_prompt_ids(server, tokenizer, reasoning_effort=effort))
    assert "Reasoning: high" in tokenizer.decode(_prompt_ids(server, tokenizer,
                                                             reasoning_effort="high"))
    with pytest.raises(Exception) as refused:
        client.chat.completions.create(model="tiny-gpt-oss", messages=MESSAGES, max_tokens=4,
                                       reasoning_effort="extreme")
    assert refused.value.status_code == 400 and "reasoning_effort" in str(refused.value)


def test_a_named_tool_choice_comes_back_as_tool_calls(gpt_oss_server):
    server, _, _ = gpt_oss_server
    response = server.openai().chat.completions.create(
        model="tiny-gpt-oss", messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=40,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "London")



def test_a_harmony_tool_call_the_model_writes_comes_back_as_tool_calls(gpt_oss_tool_server):
    server, hf_model, tokenizer = gpt_oss_tool_server
    walk = _tool_call_walk(tokenizer)
    assert hf_greedy(hf_model, _prompt_ids(server, tokenizer), len(walk)) == walk
    client = server.openai()
    response = client.chat.completions.create(model="tiny-gpt-oss", messages=MESSAGES,
                                              tools=TOOLS, temperature=0, max_tokens=40)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content, choice
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather", {"city": "Paris"})
    stream = client.chat.completions.create(model="tiny-gpt-oss", messages=MESSAGES, tools=TOOLS,
                                            temperature=0, max_tokens=40, stream=True)
    names, arguments, finish = [], [], None
    for chunk in stream:
        if not chunk.choices:
            continue
        for delta in chunk.choices[0].delta.tool_calls or ():
            names.append(delta.function.name or "")
            arguments.append(delta.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(names) == "get_weather" and finish == "tool_calls"
    assert json.loads("".join(arguments)) == {"city": "Paris"}
