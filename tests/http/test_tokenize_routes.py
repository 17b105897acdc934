"""POST /tokenize and /detokenize (and under /v1/): vLLM's and SGLang's shapes, checked against the
tokenizer and the chat template directly, round trips, and bad input (http/tokenize.py)."""
import httpx
import pytest

from tests.http.conftest import AppServer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo 世界"}]


def _post(server, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=30, **kwargs)


def _error(response: httpx.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["param"] == param
    return error


@pytest.mark.parametrize("path", ["/tokenize", "/v1/tokenize"])
def test_tokenize_a_prompt_answers_the_tokenizers_ids_and_count(server, path):
    tokenizer = server.ctx.tokenizer
    text = "The capital of France is Paris. héllo 世界 <|im_end|>"
    out = _post(server, path, {"model": "tiny", "prompt": text}).json()
    ids = tokenizer.encode(text, add_special_tokens=True)
    assert out == {"count": len(ids), "max_model_len": 512, "tokens": ids, "token_strs": None}
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")  # special tokens parsed
    strs = _post(server, path, {"prompt": text, "return_token_strs": True}).json()["token_strs"]
    assert strs == tokenizer.convert_ids_to_tokens(ids) and len(strs) == len(ids)


def test_tokenize_a_list_of_prompts_answers_lists_as_sglang_does(server):
    tokenizer = server.ctx.tokenizer
    texts = ["one", "two words", ""]
    out = _post(server, "/tokenize", {"prompt": texts, "add_special_tokens": False}).json()
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    assert out["tokens"] == ids and out["count"] == [len(i) for i in ids] and out["count"][2] == 0
    assert out["max_model_len"] == 512 and out["token_strs"] is None


def test_tokenize_messages_equals_the_chat_templates_prompt_and_chats_prompt_tokens(server, client):
    tokenizer = server.ctx.tokenizer
    out = _post(server, "/tokenize", {"messages": MESSAGES}).json()
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert out["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 512
    usage = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1).usage
    assert usage.prompt_tokens == out["count"]  # the very prompt a chat request runs

    without = _post(server, "/v1/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=False)
    assert without["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert out["tokens"][:without["count"]] == without["tokens"] and without["count"] < out["count"]

    prefill = MESSAGES + [{"role": "assistant", "content": "Sure: bonjour"}]
    continued = _post(server, "/tokenize", {"messages": prefill, "continue_final_message": True}).json()
    text = tokenizer.apply_chat_template(prefill, tokenize=False, continue_final_message=True)
    assert text.endswith("Sure: bonjour") and continued["tokens"] == tokenizer.encode(text)


def test_tokenize_messages_with_tools_counts_the_prompt_chat_runs_with_those_tools(server, client):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    out = _post(server, "/tokenize", {"messages": MESSAGES, "tools": tools}).json()
    text = server.ctx.tokenizer.apply_chat_template(MESSAGES, tools=tools, tokenize=False,
                                                    add_generation_prompt=True)
    assert out["tokens"] == server.ctx.tokenizer.encode(text)
    usage = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=tools,
                                           max_tokens=1).usage
    assert usage.prompt_tokens == out["count"]


def test_detokenize_round_trips_and_answers_vllm_and_sglang_names(server):
    tokenizer = server.ctx.tokenizer
    ids = _post(server, "/tokenize", {"messages": MESSAGES}).json()["tokens"]
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    for path in ("/detokenize", "/v1/detokenize"):
        out = _post(server, path, {"model": "tiny", "tokens": ids}).json()
        assert out == {"prompt": text, "text": text}  # special tokens kept, as vLLM does
    assert tokenizer.encode(text, add_special_tokens=False) == ids

    skipped = _post(server, "/detokenize", {"tokens": ids, "skip_special_tokens": True}).json()
    assert skipped["text"] == tokenizer.decode(ids, skip_special_tokens=True)
    assert "<|im_start|>" not in skipped["text"] and "héllo 世界" in skipped["text"]

    batch = [tokenizer.encode("one"), tokenizer.encode("héllo 世界"), []]
    out = _post(server, "/detokenize", {"tokens": batch}).json()
    assert out["text"] == out["prompt"] == ["one", "héllo 世界", ""]
    assert _post(server, "/detokenize", {"tokens": []}).json() == {"prompt": "", "text": ""}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ("/tokenize", {"prompt": "word " * 600}, "prompt"),  # over the 512-token context
    ("/tokenize", {"prompt": ["ok", "word " * 600]}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "word " * 600}]}, "messages"),
    ("/tokenize", {"prompt": ["x"] * 257}, "prompt"),  # --max-sequences-per-request 256
    ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ messages }}"}, "chat_template"),
    ("/tokenize", {"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools"),
    ("/tokenize", {"messages": MESSAGES, "tool_choice": {"type": "function",
                                                         "function": {"name": "nope"}}}, "tool_choice"),
    ("/tokenize", {"messages": MESSAGES[:1] + [{"role": "user", "content": "x"}],
                   "continue_final_message": True}, "messages"),
    ("/detokenize", {"tokens": [5, 49152]}, "tokens"),  # the vocabulary has 49152 ids
    ("/detokenize", {"tokens": [[5], [-1]]}, "tokens"),
    ("/detokenize", {"tokens": [5] * 513}, "tokens"),
    ("/detokenize", {"tokens": [[5]] * 257}, "tokens"),
    ("/detokenize", {"tokens": "hello"}, "tokens"),
    ("/detokenize", {"tokens": [1.5]}, "tokens"),
    ("/detokenize", {}, "tokens"),
])
def test_bad_input_is_an_openai_400_naming_the_parameter(server, path, body, param):
    error = _error(_post(server, path, body), 400, param)
    assert error["type"] == "invalid_request_error"
    if "word " in str(body) or body.get("tokens") == [5] * 513:
        assert error["code"] == "context_length_exceeded"


@pytest.mark.parametrize("path, body", [("/tokenize", {"prompt": "x", "bogus": 1}),
                                        ("/detokenize", {"tokens": [5], "bogus": 1})])
def test_an_unknown_field_is_ignored_and_named_in_the_header_as_on_chat(server, path, body):
    response = _post(server, path, body)
    assert response.status_code == 200 and response.headers["X-Ignored-Fields"] == "bogus"


def test_an_unknown_model_is_a_404_and_a_long_prompt_that_fits_is_counted(server):
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [5]})):
        error = _error(_post(server, path, {**body, "model": "other"}), 404, "model")
        assert error["code"] == "model_not_found"
    text = "word " * 500  # 4096+ characters: tokenized off the event loop, and fits in 512 tokens
    out = _post(server, "/tokenize", {"prompt": text}).json()
    assert out["tokens"] == server.ctx.tokenizer.encode(text) and out["count"] <= 512


def test_without_a_tokenizer_both_routes_answer_a_400_naming_the_flag(server, monkeypatch):
    monkeypatch.setattr(server.ctx.engine, "tokenizer", None)  # as --skip-tokenizer-init leaves it
    for path, body in (("/tokenize", {"prompt": "x"}), ("/v1/detokenize", {"tokens": [5]})):
        assert "--skip-tokenizer-init" in _error(_post(server, path, body), 400, None)["message"]


def test_the_api_key_guards_both_routes(server):
    from xlaserve.http.app import create_app

    guarded = AppServer(create_app(server.ctx, api_key="sk-tok"), server.ctx)
    try:
        for path, body in (("/tokenize", {"prompt": "x"}), ("/v1/detokenize", {"tokens": [5]})):
            assert _error(_post(guarded, path, body), 401, None)["code"] == "invalid_api_key"
            ok = _post(guarded, path, body, headers={"Authorization": "Bearer sk-tok"})
            assert ok.status_code == 200, ok.text
    finally:
        guarded.close()


def test_on_gpt_oss_messages_tokenize_as_the_harmony_prompt_chat_runs(server, tmp_path):
    import dataclasses
    import datetime

    from tests.http.harmony_support import harmony_chat, write_o200k_vocab
    from xlaserve.http.app import create_app
    from xlaserve.http.protocol import ChatMessage

    chat = harmony_chat(write_o200k_vocab(str(tmp_path)))
    ctx = dataclasses.replace(server.ctx, harmony=chat)
    gpt_oss = AppServer(create_app(ctx), ctx)
    try:
        out = _post(gpt_oss, "/tokenize", {"messages": MESSAGES, "reasoning_effort": "low"}).json()
        text = chat.render([ChatMessage(**m) for m in MESSAGES], None, reasoning_effort="low",
                           today=datetime.date.today().isoformat())
        assert text.endswith("<|start|>assistant")
        assert out["tokens"] == server.ctx.tokenizer.encode(text, add_special_tokens=False)
        chat_usage = _post(gpt_oss, "/v1/chat/completions", {
            "messages": MESSAGES, "reasoning_effort": "low", "max_tokens": 1}).json()["usage"]
        assert chat_usage["prompt_tokens"] == out["count"]
        refused = _post(gpt_oss, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
        assert _error(refused, 400, "add_generation_prompt")["code"] == "unsupported_parameter"
    finally:
        gpt_oss.close()
