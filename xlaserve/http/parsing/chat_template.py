"""Chat templates: the tokenizer's own, or `--chat-template` (a file, a built-in name, or Jinja),
and messages in OpenAI's shape turned into what HF templates expect.
"""
from __future__ import annotations

import json
import os

from xlaserve.http.errors import bad_request, not_supported

_CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
# Qwen3-Reranker's prompt as its model card writes it, for a decoder reranker (http/pooling/rerank.py):
# messages [query, document], `instruct` (the card's default where not given).
_QWEN3_RERANKER = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and "
    "the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n"
    "<|im_start|>user\n<Instruct>: {{ instruct | default('Given a web search query, retrieve "
    "relevant passages that answer the query') }}\n<Query>: {{ messages[0]['content'] }}\n"
    "<Document>: {{ messages[1]['content'] }}<|im_end|>\n<|im_start|>assistant\n"
    "<think>\n\n</think>\n\n")
BUILTIN_TEMPLATES = {"chatml": _CHATML, "llama-3-instruct": _LLAMA3,
                     "qwen3-reranker": _QWEN3_RERANKER}

# Tokens that end an assistant turn in common templates: generation stops there, as at EOS.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                      "<|end_of_text|>", "</s>")


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file path, a built-in name, or Jinja text; None keeps the tokenizer's."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            text = f.read()
        if value.endswith(".json"):  # a tokenizer_config.json-style file
            text = json.loads(text)["chat_template"]
        return text
    if value in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[value]
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is not a file, a Jinja template or one of "
                     f"{sorted(BUILTIN_TEMPLATES)}")


def template_text(tokenizer, template: str | None) -> str:
    """The Jinja source in use: `--chat-template`'s, else the tokenizer's (all of its named ones)."""
    template = template or getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates: look at all of them
        template = "".join(template.values())
    return template


def template_stop_ids(tokenizer, template: str | None) -> frozenset[int]:
    """End-of-turn tokens that appear in the template and are single tokens of the vocabulary."""
    template = template_text(tokenizer, template)
    vocab = tokenizer.get_vocab()
    return frozenset(vocab[t] for t in END_OF_TURN_TOKENS if t in template and t in vocab)


def message_text(message) -> str:
    """A message's content as one text: its text parts joined by newlines (other parts refused)."""
    content = message.content
    if not isinstance(content, list):
        return "" if content is None else content
    texts = []
    for part in content:
        if part.type != "text":
            raise not_supported("messages", f"content part of type {part.type!r} "
                                            "(this server takes text only)")
        texts.append(part.text or "")
    return "\n".join(texts)


def message_parts(message) -> list[dict] | str:
    """A vision model's message content as its template reads it: a message with images as
    parts, {"type": "text", "text"} and, for each image_url part, {"type": "image"} (the
    template writes its placeholder; http/images.py reads the image); any other message as a
    text (message_text: templates do string work on an assistant's content). Other parts are
    refused."""
    content = message.content
    if not isinstance(content, list) or all(part.type != "image_url" for part in content):
        return message_text(message)
    parts = []
    for part in content:
        if part.type == "text":
            parts.append({"type": "text", "text": part.text or ""})
        elif part.type == "image_url":
            parts.append({"type": "image"})
        else:
            raise not_supported("messages", f"content part of type {part.type!r} (this server "
                                            "takes text and image_url)")
    return parts


def template_messages(messages, images: bool = False) -> list[dict]:
    """OpenAI messages (pydantic) -> plain dicts for Jinja: `developer` is a system message to
    templates that predate it, text parts are joined, tool-call arguments become objects.
    `images` (a vision model): a message with images as a list of parts (`message_parts`)."""
    result = []
    for m in messages:
        message = {"role": "system" if m.role == "developer" else m.role,
                   "content": message_parts(m) if images else message_text(m)}
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(m, key):
                message[key] = getattr(m, key)
        if m.tool_calls:
            message["tool_calls"] = [_with_parsed_arguments(call) for call in m.tool_calls]
        result.append(message)
    return result


def parse_arguments(text: str):
    """A tool call's arguments (JSON text, as OpenAI sends them) parsed; a 400 if not JSON."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or nested past what json parses
        raise bad_request("tool call arguments must be a JSON object", "messages") from None


def _with_parsed_arguments(call: dict) -> dict:
    function = call.get("function")
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        call = {**call, "function": {**function, "arguments": parse_arguments(function["arguments"])}}
    return call


def with_reasoning_effort(tokenizer, template: str | None, template_kwargs: dict | None,
                          effort: str | None) -> dict | None:
    """The template kwargs with the request's `reasoning_effort`, as SGLang takes it: given to a
    template that reads a variable of that name (gpt-oss's own, as --chat-template); "none" turns
    thinking off (`enable_thinking: false`, Qwen3's switch); otherwise the model has no effort
    setting and it changes nothing (docs/server.md)."""
    if effort is None:
        return template_kwargs
    kwargs = dict(template_kwargs or {})
    if "reasoning_effort" in template_text(tokenizer, template):
        if kwargs.setdefault("reasoning_effort", effort) != effort:
            raise bad_request("reasoning_effort and chat_template_kwargs.reasoning_effort differ; "
                              "give one", "reasoning_effort")
    elif effort == "none":
        if kwargs.setdefault("enable_thinking", False) is not False:
            raise bad_request("reasoning_effort 'none' and chat_template_kwargs.enable_thinking "
                              "true contradict each other", "reasoning_effort")
    return kwargs


def render(tokenizer, messages: list[dict], *, template: str | None, tools, add_generation_prompt: bool,
           continue_final_message: bool, template_kwargs: dict | None) -> str:
    """Applies the template; a template error (say, roles that must alternate) is the client's."""
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template; start the server with --chat-template "
                          "or use /v1/completions", "messages")
    if continue_final_message and messages[-1]["role"] != "assistant":
        raise bad_request("continue_final_message needs an assistant message last", "messages")
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, chat_template=template, tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message, **(template_kwargs or {}))
    except Exception as error:  # jinja2's TemplateError, raise_exception(), bad kwargs
        raise bad_request(f"the chat template failed on these messages: {error}", "messages") from None
