"""gpt-oss chat: OpenAI chat requests rendered in OpenAI's Harmony format by `openai-harmony`.

The server takes this path for a gpt-oss checkpoint (`is_gpt_oss`: architecture
`GptOssForCausalLM`, Hugging Face model_type `gpt_oss`) unless `--chat-template` names a template.
A request becomes, as harmony renders it:

    <|start|>system<|message|>You are ChatGPT, ...\\nKnowledge cutoff: 2024-06\\nCurrent date: DATE
    \\n\\nReasoning: EFFORT\\n\\n# Valid channels: analysis, commentary, final. ...<|end|>
    <|start|>developer<|message|># Instructions\\n\\nINSTRUCTIONS\\n\\n# Tools\\n\\n## functions
    \\n\\nnamespace functions {...TypeScript-like signatures...}<|end|>
    ...the messages...<|start|>assistant

- the first message, when it is a system or developer message, gives the developer message's
  instructions (the system message is harmony's own: identity, dates, reasoning effort, channels);
  a later system or developer message is a Harmony message of that role;
- `reasoning_effort` ("low", "medium" or "high", default "medium") is the system message's
  `Reasoning:` line; `chat_template_kwargs` may carry it too, and `model_identity` (the first line),
  as gpt-oss's own Jinja template takes them;
- user: a user message; assistant: its `reasoning_content` on the analysis channel, its content on
  the final channel (the commentary channel, a preamble, when the message also calls tools), each
  tool call to `functions.NAME` on the commentary channel, `<|constrain|>json`, its arguments;
- tool: a message from `functions.NAME` (the call that its tool_call_id answers) to the assistant.
Analysis messages before the last final answer are dropped: Harmony's rule (the model never saw
an earlier turn's reasoning in training); harmony itself drops them only when that final answer
is the conversation's last message, so they are dropped here, as vLLM does.

The prompt is harmony's token ids when the model's tokenizer is o200k_harmony (a real gpt-oss:
`native_ids`), so text in a message that spells a marker (`<|end|>`) stays text; otherwise (a
test model with its own vocabulary) the decoded text, encoded by the model's tokenizer. The
model's output is read by the `gpt-oss` reasoning parser (reasoning.py) and tool-call parser
(tool_parsers.py). An assistant turn ends with `<|return|>` (answered) or `<|call|>` (a tool
call): both stop generation (`STOP_TOKENS`); `<|end|>`, which ends the analysis message, does not.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from xlaserve.http.errors import bad_request
from xlaserve.http.parsing.chat_template import message_text, parse_arguments, template_stop_ids
from xlaserve.http.parsing.harmony_vocab import load_encoding

GPT_OSS_ARCHITECTURES = frozenset({"GptOssForCausalLM"})
REASONING_EFFORTS = ("low", "medium", "high")
DEFAULT_REASONING_EFFORT = "medium"
STOP_TOKENS = ("<|return|>", "<|call|>")  # harmony's stop_tokens_for_assistant_actions()
TEMPLATE_KWARGS = ("reasoning_effort", "model_identity")  # gpt-oss's template kwargs honoured here


def is_gpt_oss(architecture: str | None) -> bool:
    return architecture in GPT_OSS_ARCHITECTURES


def stop_token_ids(tokenizer) -> frozenset[int]:
    """The ids of `<|return|>` and `<|call|>` in the model's vocabulary; a tokenizer without them
    cannot end a gpt-oss turn, and is refused."""
    vocab = tokenizer.get_vocab()
    missing = [token for token in STOP_TOKENS if token not in vocab]
    if missing:
        raise ValueError(f"a gpt-oss model's tokenizer needs the Harmony tokens {missing} "
                         "(they end an assistant turn)")
    return frozenset(vocab[token] for token in STOP_TOKENS)


def chat_format(architecture: str, tokenizer, template: str | None):
    """The server's chat format: (a HarmonyChat or None, the token ids that end an assistant
    turn). gpt-oss: Harmony unless --chat-template names a template, its turns ending at
    <|return|> or <|call|> either way (never at <|end|>, which ends its reasoning). Other models:
    their template, and its end-of-turn tokens."""
    if tokenizer is None:  # --skip-tokenizer-init: no chat
        return None, frozenset()
    if not is_gpt_oss(architecture):
        return None, template_stop_ids(tokenizer, template)
    stop_ids = stop_token_ids(tokenizer)
    if template is not None:
        return None, stop_ids
    encoding, native_ids = load_encoding(tokenizer)
    return HarmonyChat(encoding, native_ids), stop_ids


def harmony_options(reasoning_effort: str | None,
                    template_kwargs: Mapping[str, Any] | None) -> dict[str, str | None]:
    """The request's reasoning effort and model identity; `chat_template_kwargs` may give them as
    gpt-oss's template takes them; any other key is a 400 naming it (nothing renders it here)."""
    kwargs = dict(template_kwargs or {})
    unknown = sorted(set(kwargs) - set(TEMPLATE_KWARGS))
    if unknown:
        raise bad_request(f"chat_template_kwargs {unknown} are not used by gpt-oss's Harmony "
                          f"format (it takes {list(TEMPLATE_KWARGS)})", "chat_template_kwargs")
    if reasoning_effort is not None and reasoning_effort not in REASONING_EFFORTS:
        raise bad_request(f"reasoning_effort {reasoning_effort!r}: gpt-oss's Harmony format takes "
                          f"{', '.join(REASONING_EFFORTS)}", "reasoning_effort")
    effort = kwargs.get("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise bad_request(f"chat_template_kwargs.reasoning_effort must be one of "
                          f"{list(REASONING_EFFORTS)}", "chat_template_kwargs")
    if effort is not None and reasoning_effort is not None and effort != reasoning_effort:
        raise bad_request("reasoning_effort and chat_template_kwargs.reasoning_effort differ; "
                          "give one", "reasoning_effort")
    identity = kwargs.get("model_identity")
    if identity is not None and not isinstance(identity, str):
        raise bad_request("chat_template_kwargs.model_identity must be a string",
                          "chat_template_kwargs")
    return {"reasoning_effort": reasoning_effort or effort or DEFAULT_REASONING_EFFORT,
            "model_identity": identity}


@dataclass(frozen=True)
class HarmonyChat:
    """gpt-oss's chat format: harmony's encoding (harmony_vocab.load_encoding), built once."""
    encoding: Any  # openai_harmony.HarmonyEncoding
    native_ids: bool = False  # the model's tokenizer is o200k_harmony: harmony's ids are its own

    def prompt(self, messages: Sequence, tools: list[dict] | None, *, today: str,
               reasoning_effort: str = DEFAULT_REASONING_EFFORT,
               model_identity: str | None = None) -> tuple[str, list[int] | None]:
        """OpenAI messages (protocol.ChatMessage) and tools -> (the prompt text, ending with
        `<|start|>assistant`; its token ids when `native_ids`, else None: the model's tokenizer
        encodes the text). `today`: the system message's current date (YYYY-MM-DD)."""
        ids = self.prompt_ids(messages, tools, today=today, reasoning_effort=reasoning_effort,
                              model_identity=model_identity)
        return self.encoding.decode_utf8(ids), (ids if self.native_ids else None)

    def render(self, messages: Sequence, tools: list[dict] | None, **options) -> str:
        """The prompt text (`prompt`'s options)."""
        return self.prompt(messages, tools, **options)[0]

    def prompt_ids(self, messages: Sequence, tools: list[dict] | None, *, today: str,
                   reasoning_effort: str = DEFAULT_REASONING_EFFORT,
                   model_identity: str | None = None) -> list[int]:
        """The prompt as harmony renders it: o200k_harmony token ids. What harmony cannot render
        (a tool schema it rejects, say) is the client's 400."""
        from openai_harmony import Conversation, HarmonyError, Role

        conversation = Conversation.from_messages(
            _header(messages, tools, today, reasoning_effort, model_identity)
            + _drop_old_analysis(_messages(messages)))
        try:
            return self.encoding.render_conversation_for_completion(conversation, Role.ASSISTANT)
        except HarmonyError as error:
            raise bad_request(f"gpt-oss's Harmony format could not render these messages: {error}",
                              "messages") from None


def _header(messages, tools, today: str, reasoning_effort: str, model_identity: str | None) -> list:
    """The system message, and the developer message when there are instructions or tools."""
    from openai_harmony import (DeveloperContent, Message, ReasoningEffort, Role, SystemContent,
                                ToolDescription)

    system = SystemContent.new().with_reasoning_effort(ReasoningEffort(reasoning_effort.capitalize())) \
        .with_conversation_start_date(today)
    if model_identity is not None:
        system = system.with_model_identity(model_identity)
    header = [Message.from_role_and_content(Role.SYSTEM, system)]
    developer = DeveloperContent.new()
    if messages and messages[0].role in ("system", "developer"):
        developer = developer.with_instructions(message_text(messages[0]))
    if tools:  # their shape checked by tools.check_tools
        descriptions = []
        for i, tool in enumerate(tools):
            function = tool["function"]
            if not isinstance(function.get("description") or "", str):
                raise bad_request(f"tools[{i}].function.description must be a string", "tools")
            descriptions.append(ToolDescription.new(function["name"], function.get("description") or "",
                                                    parameters=function.get("parameters")))
        developer = developer.with_function_tools(descriptions)
    if developer.instructions is not None or tools:
        header.append(Message.from_role_and_content(Role.DEVELOPER, developer))
    return header


def _messages(messages) -> list:
    """The conversation after the header, as Harmony messages."""
    from openai_harmony import Author, Message, Role

    names = {call["id"]: call["function"].get("name") for m in messages for call in m.tool_calls or ()
             if isinstance(call.get("id"), str) and isinstance(call.get("function"), dict)}
    result = []
    for at, m in enumerate(messages):
        if at == 0 and m.role in ("system", "developer"):
            continue  # the developer message's instructions
        text = message_text(m)
        if m.role in ("system", "developer", "user"):
            result.append(Message.from_role_and_content(Role(m.role), text))
        elif m.role == "assistant":
            if m.reasoning_content:
                result.append(_assistant(m.reasoning_content, "analysis"))
            if text or not m.tool_calls:
                result.append(_assistant(text, "commentary" if m.tool_calls else "final"))
            for call in m.tool_calls or ():
                name, arguments = _call(call)
                result.append(_assistant(arguments, "commentary")
                              .with_recipient(f"functions.{name}")
                              .with_content_type("<|constrain|>json"))
        else:  # tool, or the deprecated function role: a tool's result
            name = names.get(m.tool_call_id) or m.name
            if not name:
                raise bad_request(f"messages[{at}]: a tool message needs the tool_call_id of an "
                                  "earlier assistant tool call (or a name)", "messages")
            result.append(Message.from_author_and_content(Author.new(Role.TOOL, f"functions.{name}"),
                                                          text)
                          .with_channel("commentary").with_recipient("assistant"))
    return result


def _assistant(text: str, channel: str):
    from openai_harmony import Message, Role

    return Message.from_role_and_content(Role.ASSISTANT, text).with_channel(channel)


def _call(call: dict) -> tuple[str, str]:
    """An assistant message's tool call -> (name, arguments: the client's JSON text, checked)."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
            or not function["name"]:
        raise bad_request("a tool call needs function.name", "messages")
    arguments = function.get("arguments")
    if isinstance(arguments, str) and arguments.strip():
        parse_arguments(arguments)
        return function["name"], arguments
    return function["name"], json.dumps(arguments or {}, ensure_ascii=False)


def _drop_old_analysis(messages: list) -> list:
    """Without the analysis messages that come before the last final answer."""
    finals = [at for at, m in enumerate(messages) if m.channel == "final"]
    if not finals:
        return messages
    return [m for at, m in enumerate(messages) if at > finals[-1] or m.channel != "analysis"]
