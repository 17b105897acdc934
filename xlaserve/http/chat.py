"""POST /v1/chat/completions: chat template -> generation -> `chat.completion` or SSE chunks."""
from __future__ import annotations

import contextlib
import datetime
from typing import AsyncIterator, NamedTuple

from xlaserve.http.constraints import compile_constraints, constraint_param
from xlaserve.http.errors import APIError, bad_request, generation_error, not_supported
from xlaserve.http.logprobs import chat_logprobs
from xlaserve.http.parsing import chat_template
from xlaserve.http.images import image_parts, load_images
from xlaserve.http.parsing.harmony import harmony_options
from xlaserve.http.parsing.reasoning import ReasoningParser, needs_special_tokens
from xlaserve.http.parsing.tool_parsers import TOOL_CALL_PARSERS
from xlaserve.http.parsing.tools import (ToolChoice, check_tool_schemas, check_tools, forced_calls,
                                         forced_schema, new_call_id, strict_tool_tag,
                                         tool_call_dict, tool_choice_of)
from xlaserve.http.prompt_bound import check_not_too_long
from xlaserve.http.protocol import ChatCompletionRequest
from xlaserve.http.request_fields import check_chat_fields
from xlaserve.http.serving import (LARGE_PROMPT_CHARS, LARGE_RESPONSE_ENTRIES, SSE_DONE, Choice,
                                   Generation, ServingContext, asks_for_constraint,
                                   check_prompt_ids, check_top_logprobs, client_priority,
                                   run_off_loop, sampling_params, sse, sse_error)
from xlaserve.runtime.engine.async_requests import EngineDeadError, StreamBuffer
from xlaserve.runtime.sampling.params import has_constraint

# Parsers whose call markers are special tokens of their models (`<|python_tag|>`,
# `[TOOL_CALLS]`, DeepSeek's `<｜tool▁calls▁begin｜>`, Harmony's, Llama 4's `<|python_start|>`,
# Gemma 4's `<|tool_call>` and `<|"|>`): the text must keep special tokens.
SPECIAL_TOKEN_MARKERS = ("llama3", "llama4_json", "mistral", "deepseekv3", "deepseekv31", "kimi_k2",
                         "gpt-oss", "gemma4")


class ChatCall:
    """One chat request: its prompt, its generation, and the response in either shape."""

    def __init__(self, ctx: ServingContext, req: ChatCompletionRequest, images=None):
        """The synchronous checks; `create` reads the images, builds the grammar and submits.
        `images`: the messages' images, read (http/images.py), on a vision model's server."""
        ctx.check_generates()
        if isinstance(req.lora_path, list):
            raise bad_request("lora_path takes one adapter's name on chat completions", "lora_path")
        self.lora = ctx.adapters_of(req.model, req.lora_path)
        check_chat_fields(req)
        if ctx.tokenizer is None:
            raise bad_request("chat needs the tokenizer (the server runs with --skip-tokenizer-init)")
        self.ctx, self.req = ctx, req
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        self.num_top = check_top_logprobs(req.top_logprobs, "top_logprobs")
        if req.max_tokens is not None and req.max_completion_tokens is not None \
                and req.max_tokens != req.max_completion_tokens:
            raise bad_request("max_tokens and max_completion_tokens differ; give one", "max_tokens")
        prompt = render_chat(ctx, req, add_generation_prompt=req.add_generation_prompt,
                             add_special_tokens=req.add_special_tokens)
        self.prompt_text, prompt_ids = prompt.text, prompt.ids
        self.prompt_images = None
        if ctx.images is not None:  # each image's placeholder expanded, its rows computed
            try:
                prompt_ids, self.prompt_images = ctx.images.prepare(prompt_ids, images or [])
            except ValueError as error:
                raise bad_request(str(error), "messages") from None
        self.functions, self.tool_choice = prompt.functions, prompt.tool_choice
        check_prompt_ids(ctx, prompt_ids, "messages")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        self.prompt_ids = prompt_ids
        self.params = sampling_params(ctx, req, max_tokens, len(prompt_ids), ctx.template_stop_ids)
        if req.separate_reasoning and ctx.reasoning_parser is not None \
                and needs_special_tokens(ctx.reasoning_parser):
            self.params.skip_special_tokens = False  # gpt-oss: the Harmony markers are special tokens
        # A forced tool_choice is a JSON-schema constraint on the output (http/parsing/tools.py).
        self.parallel = req.parallel_tool_calls is not False
        # No tools: the choice is "none", which forces nothing.
        self.forced = (forced_schema(self.tool_choice, self.functions, self.parallel)
                       if self.functions else None)
        # SGLang's, OpenAI's or vLLM's constraint, found once (vLLM's serialize their schemas).
        self.constraint_param = constraint_param(req) if asks_for_constraint(req) else None
        user_constraint = self.constraint_param is not None
        if self.forced is not None:
            if user_constraint:
                raise bad_request("tool_choice 'required' or a named function constrains the output "
                                  "itself: it cannot be combined with response_format, regex, ebnf, "
                                  "json_schema, guided_* or structured_outputs", "tool_choice")
            self.params.json_schema = self.forced
        elif self._tool_parser() is not None:
            if ctx.tool_call_parser in SPECIAL_TOKEN_MARKERS:
                self.params.skip_special_tokens = False  # its markers are special tokens
            if (tag := strict_tool_tag(ctx.tool_call_parser, self.functions)) is not None:
                if user_constraint:
                    raise bad_request("strict tools constrain the output: they cannot be combined "
                                      "with response_format, regex, ebnf, json_schema, guided_* or "
                                      "structured_outputs", "tools")
                self.params.structural_tag = tag
        self.generation: Generation | None = None

    @classmethod
    async def checked(cls, ctx: ServingContext, req: ChatCompletionRequest) -> "ChatCall":
        """The request checked and its prompt made (images read; templating and tokenizing a
        long one off the event loop), nothing submitted: what `create` submits, and what
        /v1/messages/count_tokens counts."""
        images = None
        if ctx.images is not None and (parts := image_parts(req.messages)):
            images = await load_images(ctx.core.args, parts, ctx.images.max_images)
        # Images run the vision tower: always off the loop.
        return await run_off_loop(LARGE_PROMPT_CHARS if images else message_chars(req),
                                  LARGE_PROMPT_CHARS, cls, ctx, req, images)

    @classmethod
    async def create(cls, ctx: ServingContext, req: ChatCompletionRequest, priority: int = 0) -> "ChatCall":
        """Checks the request (`checked`), builds its grammar off the loop, submits it."""
        call = await cls.checked(ctx, req)
        if call.functions:
            await check_tool_schemas(ctx, call.functions)
        if has_constraint(call.params):
            param = ("tool_choice" if call.forced else "tools" if call.params.structural_tag
                     and not call.constraint_param else call.constraint_param)
            await compile_constraints(ctx.core, [call.params], param)
        call.generation = Generation(ctx, [call.prompt_ids], call.params, req.n,
                                     top_logprobs_num=call.num_top, return_logprob=req.logprobs,
                                     priority=priority + client_priority(ctx, req.priority),
                                     rid=req.rid, lora_path=call.lora,
                                     prompt_images=[call.prompt_images], operation="chat")
        call.id = f"chatcmpl-{call.generation.id}"
        return call

    def _parser(self) -> ReasoningParser | None:
        if self.ctx.reasoning_parser is None or not self.req.separate_reasoning:
            return None
        # A template that opened the thinking block in the prompt (or deepseek-v3's `thinking`
        # template kwarg): the output starts inside it.
        return ReasoningParser.for_request(self.ctx.reasoning_parser, prompt_text=self.prompt_text,
                                           chat_template_kwargs=self.req.chat_template_kwargs)

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.generation.created,
                 "model": self.ctx.served_model_name, "system_fingerprint": None, "choices": choices}
        if self.req.stream_options and self.req.stream_options.include_usage:
            chunk["usage"] = usage
        return chunk

    # --- one JSON body ------------------------------------------------------------------------

    async def response(self) -> dict:
        choices = await self.generation.collect()
        return await run_off_loop(self.response_entries(), LARGE_RESPONSE_ENTRIES,
                                  self._body, choices)

    def response_entries(self) -> int:
        """Logprob entries (a token or an alternative) of the answer: what building it costs."""
        tokens = sum(len(c.token_ids) for c in self.generation.choices)
        return tokens * (1 + self.num_top) if self.req.logprobs else 0

    def _body(self, choices: list[Choice]) -> dict:
        return {"id": self.id, "object": "chat.completion", "created": self.generation.created,
                "model": self.ctx.served_model_name, "system_fingerprint": None,
                "choices": [self._choice(c) for c in choices], "usage": self.generation.usage()}

    def _tool_parser(self):
        """The --tool-call-parser for an `auto` choice with tools, else None."""
        if self.tool_choice.mode != "auto" or self.ctx.tool_call_parser is None:
            return None
        return TOOL_CALL_PARSERS[self.ctx.tool_call_parser](self.req.tools)

    def _choice(self, choice: Choice) -> dict:
        parser = self._parser()
        reasoning, content = parser.parse(choice.text) if parser else (None, choice.text)
        tool_calls = None
        if self.forced is not None:
            calls = forced_calls(self.tool_choice, content)
            if calls is not None:  # None: cut by max_tokens, the text stays content
                content, tool_calls = None, [tool_call_dict(*call) for call in calls]
        elif (tool_parser := self._tool_parser()) is not None:
            content, calls = tool_parser.parse(content)
            calls = calls if self.parallel else calls[:1]
            if calls:
                tool_calls = [tool_call_dict(c.name, c.arguments, c.call_id) for c in calls]
                content = content or None
        logprobs = None
        if self.req.logprobs:
            logprobs = chat_logprobs(self.ctx.tokenizer, choice.token_ids, choice.logprobs,
                                     choice.top_logprobs, self.num_top)
        return {"index": choice.index,
                "message": {"role": "assistant", "content": content, "reasoning_content": reasoning,
                            "tool_calls": tool_calls},
                "logprobs": logprobs, "finish_reason": _finish_reason(choice, bool(tool_calls)),
                "matched_stop": choice.matched_stop}

    # --- SSE --------------------------------------------------------------------------------

    async def stream(self) -> AsyncIterator[bytes]:
        async with contextlib.aclosing(self.chunks()) as chunks:  # aborts at once if we stop
            async for chunk in chunks:
                yield sse_error(chunk) if isinstance(chunk, APIError) else sse(chunk)
        yield SSE_DONE

    async def chunks(self) -> AsyncIterator[dict | APIError]:
        """The `chat.completion.chunk` objects of the stream, or the errors to send in their
        place (the Responses API's stream is made from these: http/responses/stream.py)."""
        req = self.req
        num_choices = len(self.generation.choices)
        splits = [_ReasoningSplit(self._parser(), req.stream_reasoning) for _ in range(num_choices)]
        tool_splits = [_ToolSplit(self) for _ in range(num_choices)]
        pending = [StreamBuffer(self.ctx.stream_interval) for _ in range(num_choices)]
        for index in range(num_choices):
            yield self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None}])
        try:
            async for choice, output in self.generation.stream():
                if pending[choice.index].add(output):
                    text, tokens = pending[choice.index].take()
                    reasoning, content = splits[choice.index].split(text, output.finished)
                    content, calls = tool_splits[choice.index].split(content, output.finished)
                    if reasoning or content or tokens or calls:
                        yield self._chunk([self._delta_choice(choice.index, reasoning, content,
                                                              tokens, calls)],
                                          self._running_usage())
                if output.finished:
                    if output.error is not None:
                        yield generation_error(output.error)
                    finish_reason = _finish_reason(choice, tool_splits[choice.index].called)
                    yield self._chunk([{"index": choice.index, "delta": {}, "logprobs": None,
                                        "finish_reason": finish_reason,
                                        "matched_stop": choice.matched_stop}],
                                      self._running_usage())
        except EngineDeadError as error:
            yield APIError(503, str(error))
            return
        if req.stream_options and req.stream_options.include_usage:
            yield self._chunk([], self.generation.usage())

    def _running_usage(self) -> dict | None:
        options = self.req.stream_options
        if not (options and options.continuous_usage_stats):
            return None
        prompt = sum(len(p) for p in self.generation.prompts)
        completion = sum(len(c.token_ids) for c in self.generation.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def _delta_choice(self, index: int, reasoning: str, content: str, tokens: list,
                      tool_calls: list[dict] = ()) -> dict:
        delta = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content or not (reasoning or tool_calls):
            delta["content"] = content
        if tool_calls:
            delta["tool_calls"] = tool_calls
        logprobs = None
        if self.req.logprobs:
            logprobs = chat_logprobs(self.ctx.tokenizer, *zip(*tokens), self.num_top) if tokens \
                else {"content": []}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}


class ChatPrompt(NamedTuple):
    text: str
    ids: list[int]
    functions: dict[str, dict]  # the request's tools by name, checked (parsing/tools.py)
    tool_choice: ToolChoice


def render_chat(ctx: ServingContext, req, *, add_generation_prompt: bool = True,
                add_special_tokens: bool = False) -> ChatPrompt:
    """A chat request's messages and tools as the prompt: through the chat template (or gpt-oss's
    Harmony format), then tokenized. `req`: a ChatCompletionRequest, or /tokenize's chat form
    (tokenize.py), which has the same field names. `add_special_tokens`: the tokenizer's own
    (BOS...) on top of what the template wrote."""
    limits = ctx.core.limits
    if req.tools is None and req.tool_choice is None:
        # What check_tools and tool_choice_of answer for no tools.
        functions, tool_choice = {}, ToolChoice("none")
    else:
        functions = check_tools(req.tools, limits)
        tool_choice = tool_choice_of(req.tool_choice, functions)
    tools = None if tool_choice.mode == "none" else req.tools
    if ctx.harmony is not None:  # gpt-oss (http/parsing/harmony.py)
        if req.continue_final_message:
            raise not_supported("continue_final_message",
                                "continue_final_message with gpt-oss's Harmony format")
        if not add_generation_prompt:  # Harmony's prompt always ends opening the assistant's turn
            raise not_supported("add_generation_prompt",
                                "add_generation_prompt false with gpt-oss's Harmony format")
        text, ids = ctx.harmony.prompt(req.messages, tools, today=datetime.date.today().isoformat(),
                                       **harmony_options(req.reasoning_effort,
                                                         req.chat_template_kwargs))
    else:
        text, ids = chat_template.render(
            ctx.tokenizer, chat_template.template_messages(
                req.messages, images=ctx.images is not None), template=ctx.chat_template,
            tools=tools, add_generation_prompt=add_generation_prompt,
            continue_final_message=req.continue_final_message,
            template_kwargs=chat_template.with_reasoning_effort(
                ctx.tokenizer, ctx.chat_template, req.chat_template_kwargs,
                req.reasoning_effort)), None
    if len(text) >= LARGE_PROMPT_CHARS:  # check_not_too_long passes any shorter text
        check_not_too_long(ctx, text, "messages")
    if ids is None:
        ids = ctx.tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return ChatPrompt(text, ids, functions, tool_choice)


def message_chars(req) -> int:
    """The characters of the messages' texts: what templating and tokenizing them cost."""
    total = 0
    for m in req.messages:
        texts = [m.content] if isinstance(m.content, str) else [p.text for p in m.content or ()]
        total += sum(len(t or "") for t in texts) + len(m.reasoning_content or "")
    return total


def _finish_reason(choice: Choice, called: bool) -> str | None:
    """OpenAI's "tool_calls" where a complete output made calls; "length" stays "length"."""
    return "tool_calls" if called and choice.finish_reason == "stop" else choice.finish_reason


class _ToolSplit:
    """One choice's streamed content -> (content delta, `delta.tool_calls` entries). A call goes
    out once complete: a first entry with its index, id, type and name, then its arguments. A
    forced choice's output is the calls' JSON: held back, and sent as calls once it ended."""

    def __init__(self, call: ChatCall):
        self.call = call
        self.parser = call._tool_parser() if call.forced is None else None
        self.held = ""
        self.ids: dict[int, str] = {}
        self.called = False

    def split(self, content: str, finished: bool) -> tuple[str, list[dict]]:
        if self.call.forced is not None:
            self.held += content
            if not finished:
                return "", []
            calls = forced_calls(self.call.tool_choice, self.held)
            if calls is None:
                return self.held, []
            self.called = True
            return "", [entry for index, (name, arguments) in enumerate(calls)
                        for entry in self._entries(index, name, arguments)]
        if self.parser is None:
            return content, []
        text, deltas = self.parser.feed(content)
        if finished:
            more_text, more_deltas = self.parser.finish()
            text, deltas = text + more_text, deltas + more_deltas
        entries = []
        for delta in deltas:
            if delta.index > 0 and not self.call.parallel:
                continue  # parallel_tool_calls: false keeps the first call only
            if delta.name is not None:
                entries += self._entries(delta.index, delta.name, delta.arguments, delta.call_id)
            elif delta.arguments:
                entries.append({"index": delta.index, "function": {"arguments": delta.arguments}})
        self.called = self.called or bool(entries)
        return text, entries

    def _entries(self, index: int, name: str, arguments: str,
                 call_id: str | None = None) -> list[dict]:
        self.ids[index] = call_id or new_call_id()
        first = {"index": index, "id": self.ids[index], "type": "function",
                 "function": {"name": name, "arguments": ""}}
        return [first] + ([{"index": index, "function": {"arguments": arguments}}] if arguments else [])


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
