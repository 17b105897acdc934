"""What chat, completions and /generate share: the serving context, request -> sampling
parameters with OpenAI's checks, submitting n x prompts as one group, collecting choices, usage,
SSE framing.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from typing import Any, AsyncIterator, Iterable

import orjson

from xlaserve.http.errors import APIError, bad_request, generation_error, shutting_down
from xlaserve.http.metrics import Metrics
from xlaserve.http.protocol import SamplingFields
from xlaserve.offline import Engine
from xlaserve.engine.async_requests import AsyncRequestGroup, Choice, EngineDeadError
from xlaserve.sampling.grammar import CONSTRAINT_FIELDS, InvalidGrammar, check_depth
from xlaserve.engine.core import QueueFull
from xlaserve.sampling.params import (MAX_SUPPRESSED_IDS, MAX_TOP_LOGPROBS, InvalidSamplingParam,
                                      SamplingParams, token_id)

# SamplingParams' names as OpenAI spells them, for error messages and `param`.
_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
CONSTRAINTS = CONSTRAINT_FIELDS  # SamplingParams' fields and SGLang's request keys, in order
RETRY_AFTER_S = 1  # what a client refused for a full queue is told to wait
_RESPONSE_FORMAT_KEYS = {"type", "json_schema", "schema"}
_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}


@dataclasses.dataclass
class ServingContext:
    """Everything a route needs, built once by the app factory."""

    engine: Engine
    served_model_name: str
    model_path: str
    chat_template: str | None  # None: the tokenizer's own
    template_stop_ids: frozenset[int]  # end-of-turn tokens of the chat template
    reasoning_parser: str | None
    stream_interval: int
    metrics: Metrics | None
    tool_call_parser: str | None = None  # --tool-call-parser: calls parsed out of `auto` output
    ready: bool = False  # set once the warm-up generation has passed
    draining: bool = False  # set on SIGTERM / SIGINT: no new generations (shutdown.py)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.engine.core.loaded.config.vocab_size

    @property
    def context_length(self) -> int:
        return self.engine.core.context_length

    def check_model(self, model: str | None) -> None:
        if model not in (None, "", "default", self.served_model_name):
            raise APIError(404, f"The model '{model}' does not exist", param="model",
                           code="model_not_found")


def sampling_params(ctx: ServingContext, req: SamplingFields, max_tokens: int | None,
                    prompt_len: int, extra_stop_ids: frozenset[int] = frozenset(),
                    prompt_param: str = "messages") -> SamplingParams:
    """The request's sampling fields -> engine parameters, refusing out-of-range values with
    OpenAI's 400. `max_tokens` None means "until the context (or the KV pool) is full".
    `prompt_param`: the field a prompt over the context is blamed on."""
    limit = ctx.engine.core.max_request_tokens
    if max_tokens is None:
        max_tokens = limit - prompt_len
        if max_tokens < 1:
            raise context_error(ctx, prompt_len, 1, prompt_param)
    stop_ids = list(req.stop_token_ids or ())
    if not req.ignore_eos:
        stop_ids += sorted(extra_stop_ids - set(stop_ids))
        if len(stop_ids) > MAX_SUPPRESSED_IDS >= len(req.stop_token_ids or ()):
            raise bad_request(f"stop_token_ids plus the chat template's end-of-turn ids come to "
                              f"{len(stop_ids)}; at most {MAX_SUPPRESSED_IDS} are supported",
                              "stop_token_ids")
    limits = ctx.engine.core.limits
    check_n(ctx, req.n, "n")
    params = SamplingParams(
        max_new_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k,
        min_p=req.min_p, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
        logit_bias=_logit_bias(req.logit_bias), stop=req.stop, stop_token_ids=stop_ids or None,
        ignore_eos=req.ignore_eos, min_new_tokens=req.min_tokens, seed=req.seed,
        skip_special_tokens=req.skip_special_tokens, no_stop_trim=req.no_stop_trim)
    try:  # the engine's range checks, in OpenAI's names
        params.validate(ctx.vocab_size, names=_OPENAI_NAMES, limits=limits)
    except InvalidSamplingParam as error:
        raise bad_request(str(error), error.param) from None
    if req.stream_options and not req.stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")
    constraint = request_constraint(req)
    if constraint is not None:
        setattr(params, constraint[0], constraint[1])
    if prompt_len + max_tokens > limit:
        raise context_error(ctx, prompt_len, max_tokens, prompt_param)
    return params


def request_constraint(req: SamplingFields) -> tuple[str, str] | None:
    """The request's output constraint as (SamplingParams field, text), or None: SGLang's
    `regex`, `ebnf`, `json_schema` (JSON text) keys, or OpenAI's `response_format`; at most one."""
    given = [(name, name, getattr(req, name)) for name in CONSTRAINTS
             if getattr(req, name, None) is not None]
    from_format = response_format_constraint(req.response_format)
    if from_format is not None:
        given.append(("response_format", *from_format))
    if len(given) > 1:
        raise bad_request("Only one of regex, json_schema, or ebnf can be set.", given[1][0])
    return given[0][1:] if given else None


def constraint_param(req: SamplingFields) -> str | None:
    """The request parameter that set the constraint (an invalid grammar's 400 names it)."""
    kind = (req.response_format or {}).get("type", "text")
    return "response_format" if kind != "text" else None


def response_format_constraint(response_format: dict | None) -> tuple[str, str] | None:
    """OpenAI's `response_format` -> the constraint it asks for (SamplingParams field, text), or
    None (text). SGLang's `structural_tag` type is the structures and triggers as JSON text."""
    if response_format is None:
        return None
    param = "response_format"
    kind = response_format.get("type")
    if kind == "structural_tag":
        unknown = set(response_format) - {"type", "structures", "triggers"}
        if unknown:
            raise bad_request(f"unknown response_format fields: {sorted(unknown)}", param)
        check_schema_depth(response_format, param, param)
        return "structural_tag", json.dumps(
            {"structures": response_format.get("structures"),
             "triggers": response_format.get("triggers")})
    if kind not in ("text", "json_object", "json_schema"):
        raise bad_request(f"response_format.type must be 'text', 'json_object', 'json_schema' or "
                          f"'structural_tag', got {kind!r}", param)
    unknown = set(response_format) - _RESPONSE_FORMAT_KEYS
    if unknown:
        raise bad_request(f"unknown response_format fields: {sorted(unknown)}", param)
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_schema", '{"type": "object"}'  # as SGLang: any JSON object
    spec = response_format.get("json_schema")
    if spec is None and "schema" in response_format:  # SGLang's shorthand
        spec = {"schema": response_format["schema"]}
    if not isinstance(spec, dict):
        raise bad_request("response_format 'json_schema' needs a json_schema object: "
                          '{"name": ..., "schema": {...}}', param)
    unknown = set(spec) - _JSON_SCHEMA_KEYS
    if unknown:
        raise bad_request(f"unknown response_format.json_schema fields: {sorted(unknown)}", param)
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise bad_request("response_format.json_schema.schema must be a JSON schema object", param)
    check_schema_depth(schema, param, param)
    return "json_schema", json.dumps(schema)


def check_schema_depth(value, what: str, param: str) -> None:
    """grammar.check_depth as a 400 naming `param`: a schema nested past MAX_JSON_DEPTH is
    refused before anything walks it recursively (json.dumps, closed_objects)."""
    try:
        check_depth(value, what)
    except InvalidGrammar as error:
        raise bad_request(str(error), param) from None


async def compile_constraints(ctx: ServingContext, params: Iterable[SamplingParams],
                              param: str | None = None, prefix: str = "") -> None:
    """Builds (or finds in the engine's cache) each distinct grammar of `params` in a worker
    thread, so a slow build never stalls the event loop; an invalid one is a 400 naming `param`
    (else the field, after `prefix`). Requests without a constraint cost nothing here."""
    limits = ctx.engine.core.limits
    seen = set()
    for p in params:
        key = tuple(getattr(p, name) for name in CONSTRAINTS)
        if key == (None,) * len(CONSTRAINTS) or key in seen:
            continue
        seen.add(key)
        field, text = next((f, t) for f, t in zip(CONSTRAINTS, key) if t is not None)
        name = param or prefix + field
        # Tools' schemas become one constraint: bounded as a whole, whatever each one's size.
        if len(str(text)) > limits.max_constraint_size:
            raise bad_request(f"the output constraint is longer than {limits.max_constraint_size} "
                              f"characters (--max-constraint-size)", name)
        try:
            await asyncio.wait_for(asyncio.to_thread(ctx.engine.core.compile_grammar, p),
                                   limits.grammar_compile_timeout)
        except InvalidGrammar as error:
            name = param or (prefix + error.param if error.param else None)
            raise bad_request(str(error), name) from None
        except asyncio.TimeoutError:  # the thread finishes on its own (llguidance bounds it)
            raise bad_request(f"the output constraint took longer than "
                              f"{limits.grammar_compile_timeout:g} s to compile "
                              f"(--grammar-compile-timeout)", name) from None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's string keys as token ids (ids' and values' ranges are SamplingParams.validate's)."""
    result = {}
    for key, value in (bias or {}).items():
        if (token := token_id(key)) is None:
            raise bad_request(f"logit_bias keys must be token ids, got {key[:20]!r}", "logit_bias")
        result[token] = value
    return result


def check_n(ctx: ServingContext, n: int, param: str) -> None:
    limit = ctx.engine.core.limits.max_n
    if not 1 <= n <= limit:
        raise bad_request(f"n must be between 1 and {limit} (--max-n)", param)


def client_priority(ctx: ServingContext, priority: int | None) -> int:
    """A request's `priority`, honoured only with --enable-priority-scheduling (SGLang's flag):
    otherwise one client could put itself ahead of every other."""
    if priority is None:
        return 0
    if not ctx.engine.server_args.enable_priority_scheduling:
        raise bad_request("priority is not enabled on this server (--enable-priority-scheduling)",
                          "priority")
    if not -2**31 <= priority < 2**31:
        raise bad_request("priority must be a 32-bit integer", "priority")
    return priority


def context_error(ctx: ServingContext, prompt_len: int, max_tokens: int,
                  prompt_param: str = "messages", tokens_param: str = "max_tokens") -> APIError:
    limit = ctx.engine.core.max_request_tokens
    where = "context length" if limit == ctx.context_length else "KV cache capacity"
    if prompt_len >= limit:
        message = (f"The input ({prompt_len} tokens) is longer than the model's {where} "
                   f"({limit} tokens).")
    else:
        message = (f"This model's maximum context length is {limit} tokens ({where}). However, you "
                   f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                   f"{max_tokens} for the completion). Please reduce the prompt or max_tokens.")
    return bad_request(message, tokens_param if prompt_len < limit else prompt_param,
                       code="context_length_exceeded")


def check_prompt_ids(ctx: ServingContext, ids: list[int], param: str) -> None:
    if not ids:
        raise bad_request("the prompt is empty", param)
    if any(not 0 <= t < ctx.vocab_size for t in ids):
        raise bad_request(f"prompt token ids must be in [0, {ctx.vocab_size})", param)


class Generation:
    """The requests of one API call (prompts x n), submitted at once, read as one stream."""

    def __init__(self, ctx: ServingContext, prompts: list[list[int]],
                 params: SamplingParams | list[SamplingParams], n: int,
                 *, top_logprobs_num: int = 0, return_logprob: bool = False,
                 return_prompt_logprob: bool = False,
                 priority: int = 0, rid: str | None = None, param_prefix: str = ""):
        """`param_prefix`: what the fields of a parameter the engine refuses are under
        ("sampling_params." on /generate)."""
        if ctx.draining:
            raise shutting_down()
        self.ctx = ctx
        self.prompts = prompts
        self.n = n
        self.id = rid or uuid.uuid4().hex
        self.created = int(time.time())
        limits = ctx.engine.core.limits
        if len(prompts) * n > limits.max_sequences_per_request:
            raise bad_request(f"{len(prompts)} prompts x n={n} is {len(prompts) * n} sequences; "
                              f"at most {limits.max_sequences_per_request} per request "
                              f"(--max-sequences-per-request)", "n" if n > 1 else "prompt")
        self.group = AsyncRequestGroup(ctx.engine.core)
        self.choices = [Choice(i, i // n) for i in range(len(prompts) * n)]
        self._start = time.perf_counter()
        self._last_token_at: dict[int, float] = {}
        if ctx.metrics is not None:
            ctx.metrics.request_started(sum(len(p) for p in prompts))
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        engine_rid = uuid.uuid4().hex
        try:
            for choice in self.choices:
                # Each of n samples needs its own seed, or they would all draw the same tokens.
                p = per_prompt[choice.prompt_index]
                seed = None if p.seed is None else p.seed + choice.index % n
                self.group.submit(choice.index, prompts[choice.prompt_index],
                                  dataclasses.replace(p, seed=seed),
                                  # The engine's ids stay unique whatever `rid` a client sends.
                                  rid=f"{engine_rid}-{choice.index}",
                                  return_logprob=return_logprob or top_logprobs_num > 0,
                                  top_logprobs_num=top_logprobs_num, priority=priority,
                                  return_prompt_logprob=return_prompt_logprob)
        except (InvalidGrammar, InvalidSamplingParam) as error:  # the routes checked: a miss here
            self.group.abort()
            raise bad_request(str(error), param_prefix + error.param) from None
        except ValueError as error:
            self.group.abort()
            raise bad_request(str(error)) from None
        except QueueFull as error:  # the OpenAI SDK retries a 503 after Retry-After
            self.group.abort()
            raise APIError(503, str(error), code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except RuntimeError as error:  # the engine loop is not running
            self.group.abort()
            raise APIError(503, str(error)) from None

    async def stream(self) -> AsyncIterator[tuple[Choice, dict]]:
        """(choice, chunk) as chunks arrive; aborts whatever is unfinished if the consumer stops."""
        try:
            async for index, chunk in self.group.chunks():
                choice = self.choices[index]
                choice.add(chunk)
                self._observe(index, chunk)
                yield choice, chunk
        finally:
            self.group.abort()

    async def collect(self) -> list[Choice]:
        try:
            async for _ in self.stream():
                pass
        except EngineDeadError as error:
            raise APIError(503, str(error)) from None
        for choice in self.choices:
            if choice.meta_info.get("error"):
                raise generation_error(choice.meta_info["error"])
        return self.choices

    def _observe(self, index: int, chunk: dict) -> None:
        metrics = self.ctx.metrics
        if metrics is None:
            return
        now = time.perf_counter()
        if chunk["token_id"] is not None:
            last = self._last_token_at.get(index)
            if last is None:
                metrics.time_to_first_token.observe(now - self._start)
            else:
                metrics.inter_token_latency.observe(now - last)
            self._last_token_at[index] = now
        if chunk["finished"]:
            meta = chunk["meta_info"]
            metrics.request_finished(meta["finish_reason"]["type"], meta["completion_tokens"],
                                     now - self._start)

    def usage(self) -> dict:
        """Prompt tokens counted once per prompt, not per choice; cached tokens are the least
        any of a prompt's choices had (the choices after the first hit the first one's pages)."""
        prompt_tokens = sum(len(p) for p in self.prompts)
        completion_tokens = sum(c.meta_info["completion_tokens"] for c in self.choices)
        cached = 0
        for p in range(len(self.prompts)):
            cached += min(c.meta_info.get("cached_tokens", 0) for c in self.choices[p * self.n:(p + 1) * self.n])
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}


class StreamBuffer:
    """One choice's chunks since its last SSE event: `--stream-interval` tokens go out together,
    and whatever is left goes out with the final chunk."""

    def __init__(self, interval: int):
        self.interval = interval
        self._chunks: list[dict] = []

    def add(self, chunk: dict) -> bool:
        """Holds the chunk; says whether the held ones should go out now."""
        self._chunks.append(chunk)
        return chunk["finished"] or sum(c["token_id"] is not None for c in self._chunks) >= self.interval

    def take(self) -> tuple[str, list[tuple]]:
        """(their text, (token id, logprob, alternatives) of each token), and empties it."""
        chunks, self._chunks = self._chunks, []
        return ("".join(c["text"] for c in chunks),
                [(c["token_id"], c["logprob"], c.get("top_logprobs", [])) for c in chunks
                 if c["token_id"] is not None])


def check_prompt_logprob_entries(ctx: ServingContext, prompts: list[list[int]], n: int,
                                 num_top: int, param: str) -> None:
    """Prompt logprobs cost a whole-prompt prefill per sequence (no prefix reuse) and an entry
    per prompt token and alternative in the response: bounded by --max-prompt-logprob-entries."""
    limit = ctx.engine.core.limits.max_prompt_logprob_entries
    entries = sum(len(p) for p in prompts) * n * (1 + num_top)
    if entries > limit:
        raise bad_request(f"prompt logprobs asked for {entries} entries (prompt tokens x n x "
                          f"(1 + top logprobs)); at most {limit} (--max-prompt-logprob-entries)",
                          param)


def check_top_logprobs(num: int | None, param: str) -> int:
    num = num or 0
    if not 0 <= num <= MAX_TOP_LOGPROBS:
        raise bad_request(f"{param} must be in [0, {MAX_TOP_LOGPROBS}]", param)
    return num


def sse(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def sse_error(error: APIError) -> bytes:
    return sse(error.body())
