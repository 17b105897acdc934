"""Per-request sampling parameters with SGLang's names, their type and range checks, the server's
bounds on what one request may ask (`RequestLimits`), and on the host the columns a step's rows
become (`SamplingMetadata`, `build_sampling_metadata`), which the on-device sampler (sampler.py)
reads.

Every check runs in the caller's thread before a request reaches the engine loop
(`EngineCore.submit`, the HTTP routes), so a bad value is that request's error, never the loop's:
a value the device columns cannot hold (a top_k past int32 once overflowed the packing and took
every running request down with it) or one that makes no sense is refused with its name.
"""
from __future__ import annotations

import dataclasses
import json
import math
import numbers
import re
import secrets
from typing import Callable, Sequence

import jax
import numpy as np

# The fields of which a request sets at most one, its output constraint (grammar.py compiles it).
CONSTRAINT_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")
MAX_TOP_LOGPROBS = 20  # OpenAI's limit; always computed, so one program serves every request
# Fixed widths of the per-row logit_bias and suppressed-id tables, so no request picks a new
# program: OpenAI accepts up to 300 logit_bias entries; suppressed ids are EOS + stop_token_ids.
MAX_LOGIT_BIAS = 300
MAX_SUPPRESSED_IDS = 64

# OpenAI's seeds are 64-bit; negative ones are accepted as vLLM does (int64), positive up to uint64.
SEED_RANGE = (-2**63, 2**64 - 1)


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for: each bound is the server flag of the same name (ServerArgs
    holds the defaults and their help)."""

    max_n: int  # choices per prompt (each one is a running request)
    max_sequences_per_request: int  # prompts x n of one call
    max_stop_sequences: int
    max_stop_sequence_length: int  # characters of one stop string
    max_constraint_size: int  # characters of a JSON schema, regex or EBNF grammar
    grammar_compile_timeout: float  # seconds
    max_tools: int
    max_prompt_logprob_entries: int  # prompt tokens x (1 + top logprobs), over the sequences
    max_queued_requests: int  # submitted requests that wait for a slot, all calls together

    @classmethod
    def from_server_args(cls, args) -> "RequestLimits":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    @classmethod
    def defaults(cls) -> "RequestLimits":
        from xlaserve.server_args import ServerArgs

        return cls.from_server_args(ServerArgs())


@dataclasses.dataclass
class SamplingParams:
    """Per-request sampling parameters, with SGLang's names."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = dataclasses.field(default_factory=dict)
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_new_tokens: int = 0
    seed: int | None = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    # Structured outputs (runtime/sampling/grammar.py), at most one: a JSON schema as a JSON string, a
    # regular expression, an EBNF grammar in GBNF syntax (`root ::= "red" | "green"`), or a
    # structural tag (JSON: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

    def validate(self, vocab_size: int, names: dict[str, str] | None = None,
                 limits: RequestLimits | None = None) -> None:
        """Raises InvalidSamplingParam for the first value of the wrong type or out of range;
        `names` renames fields in the message and `param` (the HTTP layer says max_tokens for
        max_new_tokens); `limits` bounds the stop strings and the constraint's size."""
        limits = limits or RequestLimits.defaults()

        def fail(field: str, message: str):
            name = (names or {}).get(field, field)
            raise InvalidSamplingParam(name, message.format(name))

        for field, kind in _TYPES.items():
            if not _is(getattr(self, field), kind):
                fail(field, "{} must be " + _TYPE_NAMES[kind])
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
            fail("stop", "{} must be a string or a list of strings")
        if len(stops) > limits.max_stop_sequences:
            fail("stop", f"{{}} takes at most {limits.max_stop_sequences} strings "
                         f"(--max-stop-sequences)")
        if any(len(s) > limits.max_stop_sequence_length for s in stops):
            fail("stop", f"{{}} strings must be at most {limits.max_stop_sequence_length} "
                         f"characters (--max-stop-sequence-length)")
        if not isinstance(self.logit_bias, dict) or not all(
                token_id(k) is not None and _is(v, "number") for k, v in self.logit_bias.items()):
            fail("logit_bias", "{} must map token ids (JSON keys: their decimal text) to numbers")
        if not isinstance(self.stop_token_ids, (list, tuple, type(None))) or not all(
                _is(t, "int") for t in self.stop_token_ids or ()):
            fail("stop_token_ids", "{} must be a list of token ids")
        for field in ("json_schema", "regex", "ebnf", "structural_tag"):
            text = getattr(self, field)
            if text is not None and len(text if isinstance(text, str) else str(text)) > limits.max_constraint_size:
                fail(field, f"{{}} is longer than {limits.max_constraint_size} characters "
                            f"(--max-constraint-size)")
        checks = [
            ("max_new_tokens", self.max_new_tokens >= 1, "{} must be >= 1"),
            ("temperature", 0 <= self.temperature < math.inf, "{} must be a finite number >= 0"),
            ("top_p", 0 < self.top_p <= 1, "{} must be in (0, 1]"),
            ("top_k", self.top_k == -1 or 1 <= self.top_k <= vocab_size,
             f"{{}} must be -1 (off) or in [1, {vocab_size}] (the vocabulary size)"),
            ("min_p", 0 <= self.min_p <= 1, "{} must be in [0, 1]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "{} must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "{} must be in [-2, 2]"),
            ("repetition_penalty", 0 < self.repetition_penalty <= 2, "{} must be in (0, 2]"),
            ("min_new_tokens", 0 <= self.min_new_tokens <= self.max_new_tokens,
             "{} must be in [0, " + (names or {}).get("max_new_tokens", "max_new_tokens") + "]"),
            ("seed", self.seed is None or SEED_RANGE[0] <= self.seed <= SEED_RANGE[1],
             "{} must be a 64-bit integer"),
            ("logit_bias", len(self.logit_bias) <= MAX_LOGIT_BIAS,
             f"{{}} takes at most {MAX_LOGIT_BIAS} entries"),
            ("logit_bias", all(-100 <= v <= 100 for v in self.logit_bias.values()),
             "{} values must be in [-100, 100]"),
            ("stop_token_ids", len(self.stop_token_ids or ()) <= MAX_SUPPRESSED_IDS,
             f"{{}} takes at most {MAX_SUPPRESSED_IDS} ids"),
            ("logit_bias", all(0 <= token_id(t) < vocab_size for t in self.logit_bias),
             f"{{}} token ids must be in [0, {vocab_size})"),
            ("stop_token_ids", all(0 <= t < vocab_size for t in self.stop_token_ids or ()),
             f"{{}} must be in [0, {vocab_size})"),
        ]
        for field, ok, message in checks:
            if not ok:
                fail(field, message)


# What each scalar field may hold. JSON has no int/float distinction for the float fields, but an
# integer field given 1.5 (or a bool, which Python counts as an int) is refused, not truncated.
_TYPES = {
    "max_new_tokens": "int", "temperature": "number", "top_p": "number", "top_k": "int",
    "min_p": "number", "presence_penalty": "number", "frequency_penalty": "number",
    "repetition_penalty": "number", "ignore_eos": "bool", "min_new_tokens": "int",
    "seed": "int?", "skip_special_tokens": "bool", "no_stop_trim": "bool",
    "json_schema": "text?", "regex": "str?", "ebnf": "str?", "structural_tag": "text?",
}
_TYPE_NAMES = {"int": "an integer", "int?": "an integer or null", "number": "a number",
               "bool": "a boolean", "str?": "a string or null",
               "text?": "a string (JSON text) or null"}


def prompt_token_ids(ids, vocab_size: int) -> list[int]:
    """Prompt token ids as a list of ints in [0, vocab_size), or InvalidSamplingParam."""
    ids = list(ids)
    if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids):
        raise InvalidSamplingParam("input_ids", "prompt token ids must be integers")
    if any(not 0 <= t < vocab_size for t in ids):
        raise InvalidSamplingParam("input_ids", f"prompt token ids must be in [0, {vocab_size})")
    return [int(t) for t in ids]


def token_id(key) -> int | None:
    """A logit_bias key as a token id: an int, or its decimal text (JSON object keys are
    strings, as OpenAI and SGLang send them); None for anything else."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str) and re.fullmatch(r"-?[0-9]{1,19}", key):
        return int(key)
    return None


def _is(value, kind: str) -> bool:
    if value is None:
        return kind.endswith("?")
    kind = kind.rstrip("?")
    if kind == "bool":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind == "int":
        return isinstance(value, int)
    if kind == "number":
        return isinstance(value, (int, float)) and not math.isnan(value)
    if kind == "text":  # the offline API also takes a schema as a dict
        return isinstance(value, (str, dict))
    return isinstance(value, str)


class InvalidSamplingParam(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass
class RowSamplingParams:
    """One request's parameters as Python values; the defaults switch everything off except
    temperature, which defaults to OpenAI's 1.0."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = dataclasses.field(default_factory=dict)
    suppressed_ids: Sequence[int] = ()
    seed: int | None = None  # None: a random seed is drawn when the metadata is built
    sample_index: int = 0
    return_logprob: bool = False

    @classmethod
    def from_params(cls, params: SamplingParams, seed: int,
                    return_logprob: bool) -> "RowSamplingParams":
        """A request's row, from its (validated) SamplingParams and the seed it samples with."""
        return cls(temperature=float(params.temperature), top_k=params.top_k,
                   top_p=float(params.top_p), min_p=float(params.min_p),
                   presence_penalty=float(params.presence_penalty),
                   frequency_penalty=float(params.frequency_penalty),
                   repetition_penalty=float(params.repetition_penalty),
                   logit_bias={token_id(k): float(v) for k, v in params.logit_bias.items()},
                   seed=seed, return_logprob=return_logprob)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingMetadata:
    """One row per sequence (padding rows are greedy with everything off): numpy arrays from
    `build_sampling_metadata`, device arrays once the step has sent them."""

    temperature: jax.Array  # f32[S]; 0 means greedy (argmax)
    top_k: jax.Array  # i32[S]; <= 0 means off
    top_p: jax.Array  # f32[S]; 1.0 means off
    min_p: jax.Array  # f32[S]; 0.0 means off
    presence_penalty: jax.Array  # f32[S]; subtracted once from every token in the output so far
    frequency_penalty: jax.Array  # f32[S]; subtracted per occurrence in the output so far
    repetition_penalty: jax.Array  # f32[S]; 1.0 off; prompt or output tokens: l>0 -> l/p, else l*p
    logit_bias_ids: jax.Array  # i32[S, K]; -1 pads
    logit_bias_values: jax.Array  # f32[S, K]; added to the logits
    suppressed_ids: jax.Array  # i32[S, M]; -1 pads; these tokens are never picked
    seeds: jax.Array  # u32[S]
    sample_index: jax.Array  # i32[S]; position of the token being sampled in the request's output
    return_logprob: jax.Array  # bool[S]; logprobs are computed when any row asks (else zeros)



def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def build_sampling_metadata(
    rows: Sequence[RowSamplingParams], padded_size: int,
    fixed_widths: tuple[int, int] | None = None,
) -> SamplingMetadata:
    """Pads `rows` to `padded_size` greedy rows and the bias/suppression widths to a power of two,
    so a handful of shapes covers every batch. Rows without a seed get a fresh random one, so
    every row is seeded; a caller that re-builds each step must remember the drawn seed
    (`int(metadata.seeds[i])`) to keep the request's sequence consistent."""
    if len(rows) > padded_size:
        raise ValueError(f"{len(rows)} rows do not fit in padded_size={padded_size}")
    pad = [RowSamplingParams(temperature=0.0, seed=0)] * (padded_size - len(rows))
    rows = list(rows) + pad
    k = max((len(r.logit_bias) for r in rows), default=0)
    m = max((len(r.suppressed_ids) for r in rows), default=0)
    if fixed_widths is not None:
        # A server pads to fixed widths so that a request's logit_bias never picks a new program.
        if k > fixed_widths[0] or m > fixed_widths[1]:
            raise ValueError(f"{k} logit_bias entries / {m} suppressed ids exceed the step's "
                             f"widths {fixed_widths}")
        k, m = fixed_widths
    else:
        k, m = _pow2_at_least(k), _pow2_at_least(m)

    bias_ids = np.full((padded_size, k), -1, np.int32)
    bias_values = np.zeros((padded_size, k), np.float32)
    suppressed = np.full((padded_size, m), -1, np.int32)
    for i, r in enumerate(rows):  # most rows have neither; skipping them saves ~1 ms a step
        if r.logit_bias:
            bias_ids[i, : len(r.logit_bias)] = list(r.logit_bias.keys())
            bias_values[i, : len(r.logit_bias)] = list(r.logit_bias.values())
        if r.suppressed_ids:
            suppressed[i, : len(r.suppressed_ids)] = list(r.suppressed_ids)
    # OpenAI seeds are 64-bit ints; JAX keys take 32 bits, so seeds equal mod 2**32 coincide.
    seeds = [secrets.randbits(32) if r.seed is None else r.seed % 2**32 for r in rows]

    def column(name, dtype):
        return np.array([getattr(r, name) for r in rows], dtype)

    return SamplingMetadata(
        temperature=column("temperature", np.float32),
        top_k=column("top_k", np.int32),
        top_p=column("top_p", np.float32),
        min_p=column("min_p", np.float32),
        presence_penalty=column("presence_penalty", np.float32),
        frequency_penalty=column("frequency_penalty", np.float32),
        repetition_penalty=column("repetition_penalty", np.float32),
        logit_bias_ids=bias_ids,
        logit_bias_values=bias_values,
        suppressed_ids=suppressed,
        seeds=np.array(seeds, np.uint32),
        sample_index=column("sample_index", np.int32),
        return_logprob=column("return_logprob", np.bool_),
    )


def stop_token_set(params: SamplingParams, eos_token_ids,
                   template_stop_ids: frozenset[int] = frozenset()) -> set[int]:
    """The ids that end a request: its stop_token_ids, and the model's EOS ids unless ignore_eos.
    min_new_tokens masks all of them in one table row: at most MAX_SUPPRESSED_IDS, or
    InvalidSamplingParam. `template_stop_ids`: a chat template's end-of-turn ids, which the HTTP
    layer adds to stop_token_ids (unless ignore_eos) once this passed; the error names them."""
    def check(ids: set[int], added: str) -> None:
        if len(ids) > MAX_SUPPRESSED_IDS:
            raise InvalidSamplingParam(
                "stop_token_ids", f"stop_token_ids plus {added} come to {len(ids)}; at most "
                                  f"{MAX_SUPPRESSED_IDS} are supported")

    stop_ids = set(params.stop_token_ids or ())
    if not params.ignore_eos:
        if template_stop_ids:
            stop_ids |= template_stop_ids
            check(stop_ids, "the chat template's end-of-turn ids")
        stop_ids |= eos_token_ids
    check(stop_ids, "the model's EOS ids")
    return stop_ids


def check_request(fits: Callable[[int, int], None], limits: RequestLimits, vocab_size: int,
                  eos_token_ids: frozenset[int] | set[int], prompt_len: int,
                  params: SamplingParams, top_logprobs_num: int = 0, *,
                  names: dict[str, str] | None = None,
                  template_stop_ids: frozenset[int] = frozenset()) -> None:
    """The one check of what a request asks, made before anything is built or queued for it
    (EngineCore.check_request; EngineCore.submit runs it on every request, the HTTP routes before
    submitting a call's n copies, so a bad call submits nothing). It reads only what start-up
    fixed, so any thread may call it, and compiles no grammar.

    Raises InvalidSamplingParam (a bad value, named: types and ranges under `limits`, the number
    of top logprobs, the ids that end it: `stop_token_set`), ValueError for an empty prompt, or
    what `fits(prompt_len, max_new_tokens)` raises (the scheduler's one fits decision:
    RequestTooLong). `names` renames fields in the messages and `param` (the OpenAI routes say
    max_tokens for max_new_tokens); `template_stop_ids`: the chat template's end-of-turn ids the
    caller adds to stop_token_ids after this check."""
    if not isinstance(top_logprobs_num, int) or not 0 <= top_logprobs_num <= MAX_TOP_LOGPROBS:
        raise InvalidSamplingParam(
            "top_logprobs_num", f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}]")
    params.validate(vocab_size, names=names, limits=limits)
    stop_token_set(params, eos_token_ids, template_stop_ids)
    fits(prompt_len, params.max_new_tokens)


class InvalidGrammar(ValueError):
    """A constraint that cannot be used; `param` names the request field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def has_constraint(params) -> bool:
    """Whether `params` (SamplingParams) set an output constraint."""
    return any(getattr(params, name, None) is not None for name in CONSTRAINT_FIELDS)


def constraint_of(params) -> tuple[str, str] | None:
    """(kind, text) of the one constraint `params` (SamplingParams) sets, or None. A json_schema
    given as a dict (the offline API) is taken as its JSON text."""
    given = [(name, getattr(params, name)) for name in CONSTRAINT_FIELDS
             if getattr(params, name, None) is not None]
    if len(given) > 1:
        raise InvalidGrammar(given[1][0], "Only one of regex, json_schema, ebnf or structural_tag "
                                          "can be set.")
    if not given:
        return None
    kind, text = given[0]
    if kind in ("json_schema", "structural_tag") and isinstance(text, dict):
        text = json.dumps(text)
    if not isinstance(text, str):
        raise InvalidGrammar(kind, f"{kind} must be a string, got {type(text).__name__}")
    return kind, text
