"""What the routes share: the serving context, large work off the event loop (`run_off_loop`,
`parse_off_loop`), request -> sampling parameters with OpenAI's checks, submitting n x prompts as
one group, collecting choices, usage, SSE framing. The output constraint's checks and compiling
are constraints.py's.

Off the loop: large request work in a worker thread, so the event loop keeps answering /health
and feeding other streams: parsing a large body, templating and tokenizing a long prompt,
building and rendering a large logprob response. With the work on the loop, a 30 MB prompt blocked it for
25-40 s (2-core CPU) before its 400; a completion echoing 500 prompt tokens with 20 alternatives
each, 96 ms. Tokenizing releases the GIL (a 30 MB text: 20 s in Rust, then 0.25 s holding the
GIL to build the id lists): /health answered within 0.4 s while one was tokenized (1.8 s
with the shared CPU at a load of 7).

Small work stays on the loop: a hop to the default executor costs 20-35 us median, 0.1-2.6 ms
p99 (idle, or beside a running stream, on the shared 2-core CPU), as much as the work below the
thresholds costs on the loop.

The tokenizer may be used from several threads at once: `encode` and `decode` take shared
borrows of the Rust tokenizer (encode releases the GIL while it runs); only a change of
truncation, padding or `encode_special_tokens` takes an exclusive one ("Already borrowed"), and
transformers changes them only when they differ from the call's (none, none, its own
`split_special_tokens`), so never for a tokenizer loaded without truncation or padding. 4
threads encoding beside 2 decoding for 8 s: 26,129 encodes, no error.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from typing import Any, AsyncIterator, Callable, TypeVar

import orjson
from pydantic import BaseModel

from xlaserve.http.constraints import CONSTRAINT_REQUEST_FIELDS, request_constraint
from xlaserve.http.errors import APIError, bad_request, generation_error, shutting_down
from xlaserve.http.observability.metrics import Metrics
from xlaserve.http.observability.tracing import OtlpTracing
from xlaserve.http.parsing.harmony import HarmonyChat
from xlaserve.http.protocol import SamplingFields
from xlaserve.http.request_fields import RequestFields, parse_body
from xlaserve.offline import Engine
from xlaserve.runtime.engine.async_requests import AsyncRequestGroup, Choice, EngineDeadError
from xlaserve.runtime.engine.messages import OutputDelta
from xlaserve.runtime.sampling.params import InvalidGrammar
from xlaserve.runtime.engine.core import EngineCore, QueueFull
from xlaserve.runtime.engine.pooled_outputs import EMBEDS
from xlaserve.runtime.engine.lora_adapters import NO_ADAPTERS, UnknownAdapter
from xlaserve.runtime.sampling.params import (MAX_TOP_LOGPROBS, InvalidSamplingParam, SamplingParams,
                                      token_id)
from xlaserve.runtime.scheduler.request import RequestTooLong

T = TypeVar("T")

LARGE_BODY_BYTES = 1 << 20  # parse_body of a 1 MB chat body: 1.4 ms
LARGE_PROMPT_CHARS = 4096  # tokenizing 4 K characters: 1.6 ms (0.4 us a character)
LARGE_RESPONSE_ENTRIES = 256  # logprob entries (token + alternatives): ~10 us each to build and render


async def run_off_loop(size: int, large: int, work: Callable[..., T], *args) -> T:
    """`work(*args)` in a worker thread when `size` reaches `large`, else here."""
    if size < large:
        return work(*args)
    return await asyncio.to_thread(work, *args)


async def parse_off_loop(body: bytes, model: type[BaseModel], fields=None):
    """`request_fields.parse_body`, off the loop for a large body; `fields`: the unknown-field
    policy (request_fields.RequestFields; None refuses unknown fields)."""
    return await run_off_loop(len(body), LARGE_BODY_BYTES, parse_body, body, model, fields)


# SamplingParams' names as OpenAI spells them, for error messages and `param`.
_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
RETRY_AFTER_S = 1  # what a client refused for a full queue is told to wait


@dataclasses.dataclass
class ServingContext:
    """Everything a route needs, built once by the app factory. Routes talk to `core` (the engine
    core: an EngineCore, or the --dp-size facade with its surface); `engine`, the offline API that
    built it, is kept for its server_args and shutdown."""

    engine: Engine
    served_model_name: str
    # The model by a name fit for clients (/v1/models' root, /get_model_info): a local model's
    # directory or file name, a hub id as given; never a path on this machine's disk.
    model_name: str
    chat_template: str | None  # None: the tokenizer's own
    template_stop_ids: frozenset[int]  # end-of-turn tokens of the chat template
    reasoning_parser: str | None
    stream_interval: int
    metrics: Metrics | None
    tracing: OtlpTracing | None = None  # --otlp-traces-endpoint: a span per request
    tool_call_parser: str | None = None  # --tool-call-parser: calls parsed out of `auto` output
    harmony: HarmonyChat | None = None  # gpt-oss: chat prompts in Harmony format, not a template
    # Unknown request fields: dropped and logged once, or refused (--strict-request-fields).
    request_fields: RequestFields = dataclasses.field(default_factory=RequestFields)
    ready: bool = False  # set once the warm-up generation has passed
    draining: bool = False  # set on SIGTERM / SIGINT: no new generations (shutdown.py)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @property
    def core(self) -> EngineCore:
        return self.engine.core

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def images(self):
        """A vision model's image preparation (runtime/engine/image_prompts.py), else None."""
        return self.core.features.images

    @property
    def vocab_size(self) -> int:
        return self.core.loaded.config.vocab_size

    @property
    def context_length(self) -> int:
        return self.core.context_length

    def serves(self, model: str | None) -> bool:
        """Whether a request's `model` names the served one: its served name, "default", none,
        or --model-path exactly as the operator gave it (vLLM and SGLang serve a model under its
        path, so their clients send that)."""
        return model in (None, "", "default", self.served_model_name,
                         self.engine.server_args.model_path)

    def check_generates(self) -> None:
        """An embedding server's 400 for a generation route (before a template or a tokenizer
        could refuse it for another reason)."""
        if self.core.features.pooling is not None:
            raise bad_request(EMBEDS)

    def check_model(self, model: str | None) -> None:
        if not self.serves(model):
            raise APIError(404, f"The model '{model}' does not exist", param="model",
                           code="model_not_found")

    def adapters_of(self, model: str | None, lora_path, prompts: int = 1):
        """The LoRA adapter a request runs with (None: the base model), or one per prompt (a
        list, where `lora_path` is a list): `lora_path` (SGLang), or `model` "BASE:NAME"
        (SGLang) or "NAME" (vLLM). A name that is not loaded is a 404 (model) or 400
        (lora_path), never the base model's answer."""
        from_model = None
        if not self.serves(model):
            base, _, name = (model or "").rpartition(":")
            lora = self.core.features.lora
            loaded = set() if lora is None else {a.name for a in lora.cards()}
            if base and self.serves(base) and name in loaded:
                from_model = name
            elif model in loaded:
                from_model = model
            else:
                self.check_model(model)  # the 404
        if lora_path is None:
            return from_model
        if from_model is not None and lora_path != from_model:
            raise bad_request(f"model names the LoRA adapter {from_model!r} and lora_path "
                              f"{str(lora_path)[:64]!r}: give one", "lora_path")
        if isinstance(lora_path, list) and len(lora_path) != prompts:
            raise bad_request(f"{len(lora_path)} lora_path entries for {prompts} prompts",
                              "lora_path")
        for name in lora_path if isinstance(lora_path, list) else [lora_path]:
            if name is not None:
                self.check_adapter(name)
        return lora_path

    def check_adapter(self, name: str) -> None:
        lora = self.core.features.lora
        if lora is None:
            raise adapter_not_found(f"lora_path {name[:64]!r}: {NO_ADAPTERS}")
        try:
            with lora.lock:
                lora.resolve(name)
        except UnknownAdapter as error:
            raise adapter_not_found(str(error)) from None


def adapter_not_found(message: str) -> APIError:
    """The 400 of a lora_path that names no adapter this server serves."""
    return bad_request(message, "lora_path", code="lora_not_found")


def sampling_params(ctx: ServingContext, req: SamplingFields, max_tokens: int | None,
                    prompt_len: int, extra_stop_ids: frozenset[int] = frozenset(),
                    prompt_param: str = "messages") -> SamplingParams:
    """The request's sampling fields -> engine parameters, checked by the engine's one check
    (`check_request`) and refused with OpenAI's 400. `max_tokens` None means "until the context
    (or the KV pool) is full". `extra_stop_ids`: the chat template's end-of-turn ids, which stop
    the request too unless ignore_eos. `prompt_param`: the field a prompt over the context is
    blamed on."""
    if max_tokens is None:  # a prompt that leaves no room: the check's context_length_exceeded
        max_tokens = max(1, ctx.core.max_request_tokens - prompt_len)
    check_n(ctx, req.n, "n")
    stop_ids = list(req.stop_token_ids or ())
    params = SamplingParams(
        max_new_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k,
        min_p=req.min_p, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
        logit_bias=_logit_bias(req.logit_bias), stop=req.stop, stop_token_ids=stop_ids or None,
        ignore_eos=req.ignore_eos, min_new_tokens=req.min_tokens, seed=req.seed,
        skip_special_tokens=req.skip_special_tokens,
        no_stop_trim=req.no_stop_trim or req.include_stop_str_in_output)
    # In OpenAI's names; the template's ids are counted with the user's, then added to them.
    check_request(ctx, prompt_len, params, prompt_param, names=_OPENAI_NAMES,
                  template_stop_ids=extra_stop_ids)
    added = extra_stop_ids - set(stop_ids)
    if added and not req.ignore_eos:
        params.stop_token_ids = list(dict.fromkeys(stop_ids)) + sorted(added)
    if req.stream_options and not req.stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")
    constraint = request_constraint(req) if asks_for_constraint(req) else None
    if constraint is not None:
        setattr(params, constraint[0], constraint[1])
    return params


def asks_for_constraint(req: SamplingFields) -> bool:
    """Whether the request sets any field constraints.py reads (CONSTRAINT_REQUEST_FIELDS).
    Without one it has no constraint and nothing there could refuse it: the routes skip it."""
    return any(getattr(req, name, None) is not None for name in CONSTRAINT_REQUEST_FIELDS)


def check_request(ctx: ServingContext, prompt_len: int, params: SamplingParams,
                  prompt_param: str, tokens_param: str = "max_tokens", prefix: str = "",
                  **options) -> None:
    """The engine's one check of a request (`EngineCore.check_request`: the parameters' types
    and ranges, the stop ids, whether it fits), made before any copy is submitted; its refusals
    as OpenAI's 400s: a bad value names its field (after `prefix`), a request over what one
    request may hold is `context_length_exceeded` (`context_error`)."""
    try:
        ctx.core.check_request(prompt_len, params, **options)
    except RequestTooLong as error:
        raise context_error(error, prompt_param, tokens_param) from None
    except InvalidSamplingParam as error:
        raise bad_request(str(error), prefix + error.param) from None
    except ValueError as error:  # an empty prompt
        raise bad_request(str(error)) from None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's string keys as token ids (ids' and values' ranges are SamplingParams.validate's)."""
    result = {}
    for key, value in (bias or {}).items():
        if (token := token_id(key)) is None:
            raise bad_request(f"logit_bias keys must be token ids, got {key[:20]!r}", "logit_bias")
        result[token] = value
    return result


def check_n(ctx: ServingContext, n: int, param: str) -> None:
    limit = ctx.core.limits.max_n
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


def context_error(error: RequestTooLong, prompt_param: str = "messages",
                  tokens_param: str = "max_tokens") -> APIError:
    """The engine's RequestTooLong as OpenAI's `context_length_exceeded` 400, blaming the prompt
    if it alone is too long, else the tokens asked for."""
    prompt_len, max_tokens, limit, where = (error.prompt_tokens, error.max_new_tokens,
                                            error.limit, error.where)
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
                 priority: int = 0, rid: str | None = None, param_prefix: str = "",
                 lora_path: str | list[str | None] | None = None, embed: bool = False,
                 second_segments: list[int] | None = None, prompt_images: list | None = None,
                 operation: str = "text_completion", return_hidden_states: bool = False):
        """`param_prefix`: what the fields of a parameter the engine refuses are under
        ("sampling_params." on /generate). `lora_path`: the LoRA adapter (None: the base
        model), or one per prompt (`ServingContext.adapters_of`). `embed`: embedding requests
        (an embedding server's; each choice's `embedding` once collected), and
        `second_segments` per prompt a cross-encoder pair's document start (token type 1).
        `prompt_images`: per prompt, a vision model's PromptImages (its images) or None.
        `operation`: what a trace calls it (OpenTelemetry's gen_ai.operation.name).
        `return_hidden_states`: each choice gathers its hidden states (Choice.hidden_states)."""
        if ctx.draining:
            raise shutting_down()
        self.ctx = ctx
        self.prompts = prompts
        self.n = n
        self.id = rid or uuid.uuid4().hex
        self.created = int(time.time())
        limits = ctx.core.limits
        if len(prompts) * n > limits.max_sequences_per_request:
            raise bad_request(f"{len(prompts)} prompts x n={n} is {len(prompts) * n} sequences; "
                              f"at most {limits.max_sequences_per_request} per request "
                              f"(--max-sequences-per-request)", "n" if n > 1 else "prompt")
        self.group = AsyncRequestGroup(ctx.core)
        self.choices = [Choice(i, i // n) for i in range(len(prompts) * n)]
        self._start = time.perf_counter()
        self._last_token_at: dict[int, float] = {}
        if ctx.metrics is not None:
            ctx.metrics.request_started(sum(len(p) for p in prompts))
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        self._trace = None if ctx.tracing is None else ctx.tracing.start(
            operation, ctx.served_model_name, prompts, per_prompt[0], len(self.choices), self.id)
        adapters = lora_path if isinstance(lora_path, list) else [lora_path] * len(prompts)
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
                                  return_prompt_logprob=return_prompt_logprob,
                                  lora_path=adapters[choice.prompt_index],
                                  **({"prompt_images": prompt_images[choice.prompt_index]}
                                     if prompt_images and prompt_images[choice.prompt_index]
                                     else {}),
                                  **({"embed": True, "second_segment": second_segments[
                                      choice.prompt_index] if second_segments else 0}
                                     if embed else {}),
                                  **({"return_hidden_states": True}
                                     if return_hidden_states else {}))
        except (InvalidGrammar, InvalidSamplingParam) as error:  # the routes checked: a miss here
            self.group.abort()
            raise bad_request(str(error), param_prefix + error.param) from None
        except UnknownAdapter as error:  # unloaded since the route's check
            self.group.abort()
            raise adapter_not_found(str(error)) from None
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

    async def stream(self) -> AsyncIterator[tuple[Choice, OutputDelta]]:
        """(choice, output) as outputs arrive; aborts whatever is unfinished if the consumer stops."""
        try:
            async for index, output in self.group.outputs():
                choice = self.choices[index]
                choice.add(output)
                self._observe(index, output)
                yield choice, output
        finally:
            self.group.abort()
            if self._trace is not None:
                self._trace.end()  # a trace still open: the generation was cut short

    async def collect(self) -> list[Choice]:
        try:
            async for _ in self.stream():
                pass
        except EngineDeadError as error:
            raise APIError(503, str(error)) from None
        for choice in self.choices:
            if choice.error:
                raise generation_error(choice.error)
        return self.choices

    def _observe(self, index: int, output: OutputDelta) -> None:
        elapsed = time.perf_counter() - self._start
        if self._trace is not None:
            self._trace.observe(index, output, elapsed)
        if self.ctx.metrics is not None:
            self.ctx.metrics.observe(self._last_token_at, index, output, elapsed)

    def usage(self) -> dict:
        """Prompt tokens counted once per prompt, not per choice; cached tokens are the least
        any of a prompt's choices had (the choices after the first hit the first one's pages)."""
        prompt_tokens = sum(len(p) for p in self.prompts)
        completion_tokens = sum(c.finish.completion_tokens for c in self.choices)
        cached = 0
        for p in range(len(self.prompts)):
            cached += min(c.finish.cached_tokens for c in self.choices[p * self.n:(p + 1) * self.n])
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}


def check_prompt_logprob_entries(ctx: ServingContext, prompts: list[list[int]], n: int,
                                 num_top: int, param: str) -> None:
    """Prompt logprobs cost a whole-prompt prefill per sequence (no prefix reuse) and an entry
    per prompt token and alternative in the response: bounded by --max-prompt-logprob-entries."""
    limit = ctx.core.limits.max_prompt_logprob_entries
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
