"""One `POST /v1/messages`: the request as a chat completion request (convert.py), run by the
chat route's own ChatCall, and its answer as a Messages `message`.

    MessagesRequest -> ChatCompletionRequest -> ChatCall -> chat.completion dict -> `message`
"""
from __future__ import annotations

from xlaserve.http.chat import ChatCall
from xlaserve.http.errors import APIError, renamed_errors
from xlaserve.http.messages import convert
from xlaserve.http.messages.protocol import CountTokensRequest, MessagesRequest
from xlaserve.http.protocol import ChatCompletionRequest
from xlaserve.http.request_fields import validate_body
from xlaserve.http.serving import ServingContext

# The chat request's names of what a 400 blames -> the Messages request's.
_PARAMS = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens",
           "chat_template_kwargs": "thinking", "user": "metadata.user_id",
           "parallel_tool_calls": "tool_choice"}


class MessageCall:
    """The checked request, its chat request, and its ChatCall once created."""

    def __init__(self, ctx: ServingContext, req: MessagesRequest | CountTokensRequest):
        self.ctx, self.req = ctx, req
        with renamed_errors(_renamed):
            conversion = convert.Conversion(req)
            self.chat_request = validate_body(conversion.chat_body(req), ChatCompletionRequest)
        # What was accepted and does nothing here, for X-Ignored-Fields.
        self.ignored = list(dict.fromkeys([*req.ignored_fields, *conversion.ignored]))
        self.show_thinking = conversion.show_thinking
        # max_tokens 0 (Anthropic's cache pre-warming): the prompt is prefilled, and the one
        # token the engine samples is dropped, as completions' echo with max_tokens 0 does.
        self.prefill_only = isinstance(req, MessagesRequest) and req.max_tokens == 0
        self.chat: ChatCall | None = None

    async def create(self) -> None:
        """Templates, checks, compiles the grammar and submits (ChatCall.create)."""
        with renamed_errors(_renamed):
            self.chat = await ChatCall.create(self.ctx, self.chat_request)
        self.id = f"msg_{self.chat.generation.id}"

    async def input_tokens(self) -> int:
        """The prompt's tokens, as a request would send them (count_tokens): its images'
        included, nothing submitted."""
        with renamed_errors(_renamed):
            return len((await ChatCall.checked(self.ctx, self.chat_request)).prompt_ids)

    def message(self, content: list[dict], stop: tuple[str | None, str | None],
                usage: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant",
                "model": self.ctx.served_model_name, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1], "stop_details": None,
                "usage": usage}

    def finished(self, chat_body: dict) -> dict:
        """The chat.completion of this call -> the `message`."""
        choice = chat_body["choices"][0]
        content = [] if self.prefill_only else convert.content_blocks(choice["message"],
                                                                      self.show_thinking)
        return self.message(content, self.stop_reason(choice["finish_reason"],
                                                      choice["matched_stop"]),
                            self.usage(chat_body["usage"]))

    def stop_reason(self, finish_reason: str | None, matched_stop) -> tuple[str, str | None]:
        if self.prefill_only:
            return "max_tokens", None
        return convert.stop_reason(finish_reason, matched_stop, self.req.stop_sequences)

    def usage(self, chat_usage: dict) -> dict:
        usage = convert.usage(chat_usage)
        return {**usage, "output_tokens": 0} if self.prefill_only else usage


def _renamed(error: APIError) -> APIError:
    """`error` in this API's names."""
    error.param = _PARAMS.get(error.param, error.param)
    return error
