"""POST /v1/completions: raw prompts (text or token ids, one or a list) -> `text_completion`."""
from __future__ import annotations

from typing import AsyncIterator

from xlaserve.http.errors import APIError, bad_request, not_supported
from xlaserve.http.logprobs import CompletionLogprobs
from xlaserve.http.protocol import CompletionRequest
from xlaserve.http.serving import (SSE_DONE, Choice, Generation, ServingContext, check_prompt_ids,
                                   check_top_logprobs, sampling_params, sse, sse_error)
from xlaserve.runtime.async_requests import EngineDeadError


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
            ids.append(ctx.tokenizer.encode(p))
            texts.append(p)
        else:
            ids.append(list(p))
            texts.append(None)
        check_prompt_ids(ctx, ids[-1], "prompt")
    return ids, texts


class CompletionCall:
    def __init__(self, ctx: ServingContext, req: CompletionRequest, priority: int = 0):
        ctx.check_model(req.model)
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
        if req.echo and req.logprobs is not None:
            raise not_supported("logprobs", "logprobs of echoed prompt tokens")
        self.prompt_ids, texts = prompt_id_lists(ctx, req.prompt)
        self.echo_texts = [t if t is not None or ctx.tokenizer is None
                           else ctx.tokenizer.decode(ids) for t, ids in zip(texts, self.prompt_ids, strict=True)]
        params = sampling_params(ctx, req, req.max_tokens, max(len(p) for p in self.prompt_ids))
        self.generation = Generation(ctx, self.prompt_ids, params, req.n,
                                     top_logprobs_num=self.num_top,
                                     return_logprob=req.logprobs is not None,
                                     priority=priority + req.priority, rid=req.rid)
        self.id = f"cmpl-{self.generation.id}"

    def _echo(self, choice: Choice) -> str:
        return (self.echo_texts[choice.prompt_index] or "") if self.req.echo else ""

    def _logprobs(self, choice: Choice, token_entries, offset: int) -> dict | None:
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

    async def response(self) -> dict:
        choices = []
        for c in await self.generation.collect():
            entries = list(zip(c.token_ids, c.logprobs, c.top_logprobs, strict=True))
            echo = self._echo(c)
            choices.append({"index": c.index, "text": echo + c.text,
                            "logprobs": self._logprobs(c, entries, len(echo)),
                            "finish_reason": c.finish_reason, "matched_stop": c.matched_stop})
        return self._body(choices, self.generation.usage(), chunk=False)

    async def stream(self) -> AsyncIterator[bytes]:
        num = len(self.generation.choices)
        offsets = [0] * num
        pending: list[list] = [[] for _ in range(num)]  # (text, token entry) since the last chunk
        if self.req.echo:
            for c in self.generation.choices:
                echo = self._echo(c)
                offsets[c.index] = len(echo)
                yield sse(self._body([{"index": c.index, "text": echo, "logprobs": None,
                                       "finish_reason": None}], None, chunk=True))
        try:
            async for choice, chunk in self.generation.stream():
                held = pending[choice.index]
                held.append(chunk)
                tokens = sum(c["token_id"] is not None for c in held)
                if chunk["finished"] or tokens >= self.ctx.stream_interval:
                    text = "".join(c["text"] for c in held)
                    entries = [(c["token_id"], c["logprob"], c.get("top_logprobs", []))
                               for c in held if c["token_id"] is not None]
                    pending[choice.index] = []
                    if text or entries:
                        logprobs = self._logprobs(choice, entries, offsets[choice.index])
                        offsets[choice.index] += sum(len(t) for t in (logprobs or {}).get("tokens", ()))
                        yield sse(self._body([{"index": choice.index, "text": text, "logprobs": logprobs,
                                               "finish_reason": None}], None, chunk=True))
                if chunk["finished"]:
                    if "error" in chunk:
                        yield sse_error(APIError(500, f"generation failed: {chunk['error']}"))
                    yield sse(self._body([{"index": choice.index, "text": "", "logprobs": None,
                                           "finish_reason": choice.finish_reason,
                                           "matched_stop": choice.matched_stop}], None, chunk=True))
        except EngineDeadError as error:
            yield sse_error(APIError(503, str(error)))
            yield SSE_DONE
            return
        if self.req.stream_options and self.req.stream_options.include_usage:
            yield sse(self._body([], self.generation.usage(), chunk=True))
        yield SSE_DONE
