"""POST /v1/completions: raw prompts (text or token ids, one or a list) -> `text_completion`."""
from __future__ import annotations

from typing import AsyncIterator

from xlaserve.http.errors import APIError, bad_request, generation_error, not_supported
from xlaserve.http.logprobs import CompletionLogprobs
from xlaserve.http.constraints import compile_constraints, constraint_param
from xlaserve.http.prompt_bound import check_not_too_long
from xlaserve.http.protocol import CompletionRequest
from xlaserve.http.serving import (LARGE_PROMPT_CHARS, LARGE_RESPONSE_ENTRIES, SSE_DONE, Choice,
                                   Generation, ServingContext, check_prompt_ids,
                                   check_prompt_logprob_entries, check_top_logprobs,
                                   client_priority, run_off_loop, sampling_params, sse, sse_error)
from xlaserve.runtime.engine.async_requests import EngineDeadError, StreamBuffer


def prompt_id_lists(ctx: ServingContext, prompt) -> tuple[list[list[int]], list[str | None]]:
    """The four prompt forms -> token id lists, and the prompt texts where text was given."""
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif not prompt:
        raise bad_request("prompt is empty", "prompt")
    elif isinstance(prompt[0], int):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    ids, texts = [], []
    for p in prompts:
        if isinstance(p, str):
            if ctx.tokenizer is None:
                raise bad_request("text prompts need the tokenizer (--skip-tokenizer-init is set)", "prompt")
            check_not_too_long(ctx, p, "prompt")
            ids.append(ctx.tokenizer.encode(p))
            texts.append(p)
        else:
            ids.append(list(p))
            texts.append(None)
        check_prompt_ids(ctx, ids[-1], "prompt")
    return ids, texts


def _prompt_size(prompt) -> int:
    """Characters of text plus token ids in the prompt(s): what tokenizing and checking cost."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return len(prompt)
    return sum(len(p) for p in prompt)


class CompletionCall:
    def __init__(self, ctx: ServingContext, req: CompletionRequest):
        """The synchronous checks; `create` builds the grammar and submits."""
        ctx.adapters_of(req.model, None)  # a model not served: the 404 first
        ctx.check_generates()
        self.ctx, self.req = ctx, req
        if req.suffix:
            raise not_supported("suffix")
        if req.best_of is not None and req.best_of != req.n:
            if req.best_of < req.n:
                raise bad_request("best_of must be at least n", "best_of")
            raise not_supported("best_of", "best_of greater than n")
        if req.logprobs is not None and req.logprobs < 0:
            raise bad_request("logprobs must be non-negative", "logprobs")
        self.num_top = check_top_logprobs(req.logprobs, "logprobs")
        self.prompt_ids, texts = prompt_id_lists(ctx, req.prompt)
        self.lora = ctx.adapters_of(req.model, req.lora_path, len(self.prompt_ids))
        if req.echo and req.logprobs is not None:
            check_prompt_logprob_entries(ctx, self.prompt_ids, req.n, self.num_top, "echo")
        self.echo_texts = [t if t is not None or ctx.tokenizer is None
                           else ctx.tokenizer.decode(ids) for t, ids in zip(texts, self.prompt_ids, strict=True)]
        # echo with max_tokens=0 scores the prompt (its logprobs) without generating: the engine
        # samples one token, which is dropped.
        self.prompt_only = req.echo and req.max_tokens == 0
        max_tokens = 1 if self.prompt_only else req.max_tokens
        self.params = sampling_params(ctx, req, max_tokens, max(len(p) for p in self.prompt_ids),
                                      prompt_param="prompt")
        self.constraint_param = constraint_param(req)  # found here, off the loop for a long prompt
        self.generation: Generation | None = None

    @classmethod
    async def create(cls, ctx: ServingContext, req: CompletionRequest, priority: int = 0) -> "CompletionCall":
        """Checks the request (tokenizing a long prompt off the event loop), builds its grammar
        off the loop, submits it."""
        call = await run_off_loop(_prompt_size(req.prompt), LARGE_PROMPT_CHARS, cls, ctx, req)
        await compile_constraints(ctx.core, [call.params], call.constraint_param)
        call.generation = Generation(ctx, call.prompt_ids, call.params, req.n,
                                     top_logprobs_num=call.num_top,
                                     return_logprob=req.logprobs is not None,
                                     return_prompt_logprob=req.echo and req.logprobs is not None,
                                     priority=priority + client_priority(ctx, req.priority),
                                     rid=req.rid, lora_path=call.lora)
        call.id = f"cmpl-{call.generation.id}"
        return call

    def _echo(self, choice: Choice) -> str:
        return (self.echo_texts[choice.prompt_index] or "") if self.req.echo else ""

    def _prompt_entries(self, choice: Choice) -> list[tuple]:
        """(token id, logprob, alternatives) of each echoed prompt token: the first has no logprob."""
        first = choice.first_output
        if not (self.req.echo and first is not None and first.input_token_logprobs is not None):
            return []
        tops = first.input_top_logprobs or [None] * len(first.input_token_logprobs)
        return [(t, lp, None if top is None else [(alt_lp, alt_t) for alt_lp, alt_t, _ in top])
                for (lp, t, _), top in zip(first.input_token_logprobs, tops, strict=True)]

    def _logprobs(self, token_entries, offset: int) -> dict | None:
        if self.req.logprobs is None or self.ctx.tokenizer is None:
            return None
        builder = CompletionLogprobs(self.ctx.tokenizer, self.num_top, offset)
        return builder.build(*zip(*token_entries)) if token_entries else builder.build([], [], [])

    def _body(self, choices: list[dict], usage: dict | None, chunk: bool) -> dict:
        body = {"id": self.id, "object": "text_completion", "created": self.generation.created,
                "model": self.ctx.served_model_name, "system_fingerprint": None, "choices": choices}
        if not chunk or (self.req.stream_options and self.req.stream_options.include_usage):
            body["usage"] = usage
        return body

    def _usage(self) -> dict:
        usage = self.generation.usage()
        if self.prompt_only:
            usage["total_tokens"] -= usage["completion_tokens"]
            usage["completion_tokens"] = 0
        return usage

    def _finish(self, choice: Choice) -> dict:
        reason = "length" if self.prompt_only else choice.finish_reason
        return {"finish_reason": reason, "matched_stop": None if self.prompt_only else choice.matched_stop}

    def _chunk(self, index: int, text: str, logprobs: dict | None, finish: dict) -> dict:
        """One choice's piece of the stream."""
        return self._body([{"index": index, "text": text, "logprobs": logprobs, **finish}], None,
                          chunk=True)

    async def response(self) -> dict:
        choices = await self.generation.collect()
        return await run_off_loop(self.response_entries(), LARGE_RESPONSE_ENTRIES,
                                  self._response_body, choices)

    def response_entries(self) -> int:
        """Logprob entries (a token or an alternative, echoed prompt included) of the answer:
        what building it costs."""
        if self.req.logprobs is None:
            return 0
        echoed = sum(len(self.prompt_ids[c.prompt_index]) for c in self.generation.choices) \
            if self.req.echo else 0
        tokens = echoed + sum(len(c.token_ids) for c in self.generation.choices)
        return tokens * (1 + self.num_top)

    def _response_body(self, collected: list[Choice]) -> dict:
        choices = []
        for c in collected:
            output = [] if self.prompt_only else list(zip(c.token_ids, c.logprobs, c.top_logprobs, strict=True))
            text = self._echo(c) + ("" if self.prompt_only else c.text)
            choices.append({"index": c.index, "text": text,
                            "logprobs": self._logprobs(self._prompt_entries(c) + output, 0),
                            **self._finish(c)})
        return self._body(choices, self._usage(), chunk=False)

    async def stream(self) -> AsyncIterator[bytes]:
        """The echo first (with the prompt's logprobs), then the output `--stream-interval`
        tokens a chunk. `finish_reason` rides on the chunk of the last token, as SGLang sends
        it, so that with `logprobs` every chunk has a logprobs object with entries (clients read
        `chunk.choices[0].logprobs.tokens[0]` on each); only a choice that ended without a
        token (an abort, a failure) gets a chunk of its own, with empty logprob lists."""
        num = len(self.generation.choices)
        offsets = [0] * num
        pending = [StreamBuffer(self.ctx.stream_interval) for _ in range(num)]
        started = [False] * num
        try:
            async for choice, output in self.generation.stream():
                i = choice.index
                if output.finished and output.error is not None:
                    yield sse_error(generation_error(output.error))
                finish = self._finish(choice) if output.finished else {"finish_reason": None}
                if not started[i]:
                    started[i] = True
                    if self.req.echo:
                        # Scoring the prompt alone (max_tokens 0): the echo is the whole answer.
                        echo_finish = finish if self.prompt_only else {"finish_reason": None}
                        yield sse(self._chunk(i, self._echo(choice),
                                              self._logprobs(self._prompt_entries(choice), 0),
                                              echo_finish))
                        offsets[i] = len(self._echo(choice))
                if self.prompt_only:
                    continue
                if pending[i].add(output):
                    text, entries = pending[i].take()
                    if text or entries or output.finished:
                        logprobs = self._logprobs(entries, offsets[i])
                        offsets[i] += sum(len(t) for t in (logprobs or {}).get("tokens", ()))
                        yield sse(self._chunk(i, text, logprobs, finish))
        except EngineDeadError as error:
            yield sse_error(APIError(503, str(error)))
            yield SSE_DONE
            return
        if self.req.stream_options and self.req.stream_options.include_usage:
            yield sse(self._body([], self._usage(), chunk=True))
        yield SSE_DONE
