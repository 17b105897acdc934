"""POST /v1/chat/completions: chat template -> generation -> `chat.completion` or SSE chunks."""
from __future__ import annotations

from typing import AsyncIterator

from xlaserve.http import chat_template
from xlaserve.http.errors import APIError, bad_request, not_supported
from xlaserve.http.logprobs import chat_logprobs
from xlaserve.http.protocol import ChatCompletionRequest
from xlaserve.http.reasoning import THINK_START, ReasoningParser
from xlaserve.http.serving import (SSE_DONE, Choice, Generation, ServingContext, StreamBuffer,
                                   check_prompt_ids, check_top_logprobs, compile_constraints,
                                   constraint_param, sampling_params, sse, sse_error)
from xlaserve.runtime.async_requests import EngineDeadError


class ChatCall:
    """One chat request: its prompt, its generation, and the response in either shape."""

    def __init__(self, ctx: ServingContext, req: ChatCompletionRequest):
        """The synchronous checks; `create` builds the grammar and submits."""
        ctx.check_model(req.model)
        if ctx.tokenizer is None:
            raise bad_request("chat needs the tokenizer (the server runs with --skip-tokenizer-init)")
        self.ctx, self.req = ctx, req
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        self.num_top = check_top_logprobs(req.top_logprobs, "top_logprobs")
        if req.max_tokens is not None and req.max_completion_tokens is not None \
                and req.max_tokens != req.max_completion_tokens:
            raise bad_request("max_tokens and max_completion_tokens differ; give one", "max_tokens")
        self.prompt_text = self._render()
        prompt_ids = ctx.tokenizer.encode(self.prompt_text, add_special_tokens=False)
        check_prompt_ids(ctx, prompt_ids, "messages")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        self.prompt_ids = prompt_ids
        self.params = sampling_params(ctx, req, max_tokens, len(prompt_ids), ctx.template_stop_ids)
        self.generation: Generation | None = None

    @classmethod
    async def create(cls, ctx: ServingContext, req: ChatCompletionRequest, priority: int = 0) -> "ChatCall":
        """Checks the request, builds its grammar off the event loop, submits it."""
        call = cls(ctx, req)
        await compile_constraints(ctx, [call.params], constraint_param(req))
        call.generation = Generation(ctx, [call.prompt_ids], call.params, req.n,
                                     top_logprobs_num=call.num_top, return_logprob=req.logprobs,
                                     priority=priority + req.priority, rid=req.rid)
        call.id = f"chatcmpl-{call.generation.id}"
        return call

    def _render(self) -> str:
        req, ctx = self.req, self.ctx
        if req.tool_choice is not None and req.tools is None:
            raise bad_request("tool_choice needs tools", "tool_choice")
        if req.tool_choice not in (None, "none", "auto"):
            raise not_supported("tool_choice", f"tool_choice {req.tool_choice!r}")
        tools = None if req.tool_choice == "none" else req.tools
        return chat_template.render(
            ctx.tokenizer, chat_template.template_messages(req.messages), template=ctx.chat_template,
            tools=tools, add_generation_prompt=True,
            continue_final_message=req.continue_final_message,
            template_kwargs=req.chat_template_kwargs)

    def _parser(self) -> ReasoningParser | None:
        if self.ctx.reasoning_parser is None or not self.req.separate_reasoning:
            return None
        # A template that opened the thinking block in the prompt: the output starts inside it.
        thinking_in_prompt = self.prompt_text.rstrip().endswith(THINK_START)
        return ReasoningParser(self.ctx.reasoning_parser, thinking_in_prompt=thinking_in_prompt)

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.generation.created,
                 "model": self.ctx.served_model_name, "system_fingerprint": None, "choices": choices}
        if self.req.stream_options and self.req.stream_options.include_usage:
            chunk["usage"] = usage
        return chunk

    # --- one JSON body ------------------------------------------------------------------------

    async def response(self) -> dict:
        choices = await self.generation.collect()
        return {"id": self.id, "object": "chat.completion", "created": self.generation.created,
                "model": self.ctx.served_model_name, "system_fingerprint": None,
                "choices": [self._choice(c) for c in choices], "usage": self.generation.usage()}

    def _choice(self, choice: Choice) -> dict:
        parser = self._parser()
        reasoning, content = parser.parse(choice.text) if parser else (None, choice.text)
        logprobs = None
        if self.req.logprobs:
            logprobs = chat_logprobs(self.ctx.tokenizer, choice.token_ids, choice.logprobs,
                                     choice.top_logprobs, self.num_top)
        return {"index": choice.index,
                "message": {"role": "assistant", "content": content, "reasoning_content": reasoning,
                            "tool_calls": None},
                "logprobs": logprobs, "finish_reason": choice.finish_reason,
                "matched_stop": choice.matched_stop}

    # --- SSE --------------------------------------------------------------------------------

    async def stream(self) -> AsyncIterator[bytes]:
        req = self.req
        num_choices = len(self.generation.choices)
        splits = [_ReasoningSplit(self._parser(), req.stream_reasoning) for _ in range(num_choices)]
        pending = [StreamBuffer(self.ctx.stream_interval) for _ in range(num_choices)]
        for index in range(num_choices):
            yield sse(self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}]))
        try:
            async for choice, chunk in self.generation.stream():
                if pending[choice.index].add(chunk):
                    text, tokens = pending[choice.index].take()
                    reasoning, content = splits[choice.index].split(text, chunk["finished"])
                    if reasoning or content or tokens:
                        yield sse(self._chunk([self._delta_choice(choice.index, reasoning, content, tokens)],
                                              self._running_usage()))
                if chunk["finished"]:
                    if "error" in chunk:
                        yield sse_error(APIError(500, f"generation failed: {chunk['error']}"))
                    yield sse(self._chunk([{"index": choice.index, "delta": {}, "logprobs": None,
                                            "finish_reason": choice.finish_reason,
                                            "matched_stop": choice.matched_stop}],
                                          self._running_usage()))
        except EngineDeadError as error:
            yield sse_error(APIError(503, str(error)))
            yield SSE_DONE
            return
        if req.stream_options and req.stream_options.include_usage:
            yield sse(self._chunk([], self.generation.usage()))
        yield SSE_DONE

    def _running_usage(self) -> dict | None:
        options = self.req.stream_options
        if not (options and options.continuous_usage_stats):
            return None
        prompt = sum(len(p) for p in self.generation.prompts)
        completion = sum(len(c.token_ids) for c in self.generation.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def _delta_choice(self, index: int, reasoning: str, content: str, tokens: list) -> dict:
        delta = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content or not reasoning:
            delta["content"] = content
        logprobs = None
        if self.req.logprobs:
            logprobs = chat_logprobs(self.ctx.tokenizer, *zip(*tokens), self.num_top) if tokens \
                else {"content": []}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}


class _ReasoningSplit:
    """One choice's streamed text -> (reasoning, content) deltas; with stream_reasoning=false the
    reasoning is held back and leaves in one piece once the block has closed (or output ended)."""

    def __init__(self, parser: ReasoningParser | None, stream_reasoning: bool):
        self.parser = parser
        self.stream_reasoning = stream_reasoning
        self._held_reasoning = ""

    def split(self, text: str, finished: bool) -> tuple[str, str]:
        if self.parser is None:
            return "", text
        reasoning, content = self.parser.feed(text)
        if finished:
            more_reasoning, more_content = self.parser.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        if not self.stream_reasoning:
            self._held_reasoning += reasoning
            reasoning = ""
            if self.parser.state == "content" or finished:
                reasoning, self._held_reasoning = self._held_reasoning, ""
        return reasoning, content
