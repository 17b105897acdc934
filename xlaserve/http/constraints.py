"""A request's output constraint: SGLang's `regex` / `ebnf` / `json_schema` keys, OpenAI's
`response_format` or vLLM's `guided_*` / `structured_outputs`, checked and turned into one
SamplingParams field, and its grammar compiled off the event loop with the server's size and
time bounds. `CONSTRAINT_REQUEST_FIELDS` names every request field read here: a request that
sets none of them has no constraint, and the routes do not call here for it
(serving.asks_for_constraint; `has_constraint` of sampling/params.py before
`compile_constraints`, which skips by the same test).

vLLM's fields: `structured_outputs: {"json", "regex", "choice", "grammar", "json_object"}` (vLLM
>= 0.10.2) and the older top-level `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`. Each becomes one SamplingParams constraint: a JSON schema (`json_schema`), a
regex (`regex`, the Rust syntax llguidance reads, after grammar.python_regex_to_rust as SGLang's
`regex` key), or a grammar (`ebnf`: GBNF `root ::= ...`, or Lark text whose first rule is
`start:`, which llguidance recognises as Lark). A choice is the regex of its alternatives, each
escaped, so the output is exactly one of them. The backend names (`guided_decoding_backend`,
`structured_outputs.backend`) are accepted and ignored: llguidance is the only backend here;
`guided_whitespace_pattern` is a 400 (the server's --constrained-json-whitespace-pattern holds).
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
from typing import TYPE_CHECKING, Iterable

from xlaserve.http.errors import bad_request, not_supported
from xlaserve.http.protocol import SamplingFields
from xlaserve.runtime.sampling.grammar import check_depth
from xlaserve.runtime.sampling.params import (CONSTRAINT_FIELDS, InvalidGrammar, SamplingParams,
                                              has_constraint)

if TYPE_CHECKING:
    from xlaserve.runtime.engine.core import EngineCore

logger = logging.getLogger(__name__)

CONSTRAINTS = CONSTRAINT_FIELDS  # SamplingParams' fields and SGLang's request keys, in order
_RESPONSE_FORMAT_KEYS = {"type", "json_schema", "schema"}
_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}
# vLLM's top-level guided_* keys that set a constraint -> the SamplingParams field they set.
_GUIDED = (("guided_json", "json_schema"), ("guided_regex", "regex"),
           ("guided_choice", "regex"), ("guided_grammar", "ebnf"))
# Every request field this module reads (tests/http/test_structured_outputs.py holds it to that):
# with all of them None, a request has no constraint and nothing here can refuse or log it.
CONSTRAINT_REQUEST_FIELDS = (*CONSTRAINTS, "response_format", *(param for param, _ in _GUIDED),
                             "guided_whitespace_pattern", "guided_decoding_backend",
                             "structured_outputs")
# structured_outputs' keys that set a constraint -> the SamplingParams field they set.
_STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "choice": "regex",
                     "grammar": "ebnf", "json_object": "json_schema"}
_STRUCTURED_IGNORED = {"backend"}  # the grammar library's name: llguidance is the only one here
# Rust regex's metacharacters (regex::escape's set): a choice is matched literally.
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")
ANY_JSON_OBJECT = '{"type": "object"}'  # json_object, as response_format's (SGLang's) grammar


def request_constraint(req: SamplingFields) -> tuple[str, str] | None:
    """The request's output constraint as (SamplingParams field, text), or None: SGLang's
    `regex`, `ebnf`, `json_schema` (JSON text) keys, OpenAI's `response_format`, or vLLM's
    `guided_*` keys and `structured_outputs`; at most one."""
    given = _given_constraints(req)
    return given[0][1:] if given else None


def constraint_param(req: SamplingFields) -> str | None:
    """The request parameter that set the constraint (an invalid grammar's 400 names it)."""
    given = _given_constraints(req)
    return given[0][0] if given else None


def _given_constraints(req: SamplingFields) -> list[tuple[str, str, str]]:
    """(request parameter, SamplingParams field, text) of every constraint the request sets;
    two at once is a 400 naming both."""
    given = [(name, name, getattr(req, name)) for name in CONSTRAINTS
             if getattr(req, name, None) is not None]
    from_format = response_format_constraint(req.response_format)
    if from_format is not None:
        given.append(("response_format", *from_format))
    given += vllm_constraints(req)
    if len(given) > 1:
        raise bad_request(f"Only one of regex, json_schema, or ebnf can be set: got {given[0][0]} "
                          f"and {given[1][0]}", given[1][0])
    return given


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
        return "json_schema", ANY_JSON_OBJECT  # as SGLang: any JSON object
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


# --- vLLM's fields (module docstring) -----------------------------------------------------

def vllm_constraints(req) -> list[tuple[str, str, str]]:
    """(request parameter, SamplingParams field, text) of each vLLM constraint the request sets."""
    given = []
    for param, field in _GUIDED:
        value = getattr(req, param, None)
        if value is not None:
            given.append((param, field, _text(param, field, value)))
    if getattr(req, "guided_whitespace_pattern", None) is not None:  # it changes the output
        raise not_supported("guided_whitespace_pattern", "a per-request JSON whitespace pattern "
                            "(the server's --constrained-json-whitespace-pattern applies)")
    backend = getattr(req, "guided_decoding_backend", None)
    if backend is not None:
        _log_ignored_backend(str(backend)[:40])
    outputs = getattr(req, "structured_outputs", None)
    if outputs is not None:
        given += _structured_outputs(outputs)
    return given


@functools.lru_cache(maxsize=16)  # one line per backend name, not one per request
def _log_ignored_backend(name: str) -> None:
    logger.info("guided_decoding_backend %r ignored: llguidance is this server's only grammar "
                "backend", name)


def _structured_outputs(outputs: dict) -> list[tuple[str, str, str]]:
    unknown = sorted(set(outputs) - set(_STRUCTURED_KINDS) - _STRUCTURED_IGNORED)
    if unknown:  # they would change the output (whitespace, fallbacks): never silently dropped
        raise bad_request(f"structured_outputs fields {[k[:40] for k in unknown[:10]]} are not "
                          f"supported (it takes {sorted(_STRUCTURED_KINDS)})",
                          "structured_outputs")
    given = []
    for key, field in _STRUCTURED_KINDS.items():
        value = outputs.get(key)
        param = f"structured_outputs.{key}"
        if key == "json_object":
            if value not in (None, False, True):
                raise bad_request("structured_outputs.json_object must be a boolean", param)
            if value:
                given.append((param, field, ANY_JSON_OBJECT))
        elif value is not None:
            given.append((param, field, _text(param, field, value)))
    return given


def _text(param: str, field: str, value) -> str:
    """A vLLM field's value as the constraint text of `field`, type-checked (a 400 names it)."""
    if param.endswith("choice"):
        return choice_regex(value, param)
    if field == "json_schema" and isinstance(value, (dict, bool)):
        check_schema_depth(value, param, param)  # before json.dumps walks it
        return json.dumps(value)
    if not isinstance(value, str):
        raise bad_request(f"{param} must be a string" + (" or a JSON schema object"
                                                         if field == "json_schema" else ""), param)
    return value


def choice_regex(choices, param: str) -> str:
    """The regex matching exactly one of `choices` (each taken literally)."""
    if not isinstance(choices, list) or not choices \
            or not all(isinstance(c, str) and c for c in choices):
        raise bad_request(f"{param} must be a non-empty list of non-empty strings", param)
    return "(" + "|".join(_escape(c) for c in choices) + ")"


def _escape(text: str) -> str:
    return "".join("\\" + ch if ch in _REGEX_META else ch for ch in text)


def check_schema_depth(value, what: str, param: str) -> None:
    """grammar.check_depth as a 400 naming `param`: a schema nested past MAX_JSON_DEPTH is
    refused before anything walks it recursively (json.dumps, closed_objects)."""
    try:
        check_depth(value, what)
    except InvalidGrammar as error:
        raise bad_request(str(error), param) from None


async def compile_constraints(core: EngineCore, params: Iterable[SamplingParams],
                              param: str | None = None, prefix: str = "") -> None:
    """Builds (or finds in the engine's cache) each distinct grammar of `params` in a worker
    thread, so a slow build never stalls the event loop; an invalid one is a 400 naming `param`
    (else the field, after `prefix`). Requests without a constraint cost nothing here."""
    limits = core.limits
    seen = set()
    for p in params:
        if not has_constraint(p):
            continue
        key = tuple(getattr(p, name) for name in CONSTRAINTS)
        if key in seen:
            continue
        seen.add(key)
        field, text = next((f, t) for f, t in zip(CONSTRAINTS, key) if t is not None)
        name = param or prefix + field
        # Tools' schemas become one constraint: bounded as a whole, whatever each one's size.
        if len(str(text)) > limits.max_constraint_size:
            raise bad_request(f"the output constraint is longer than {limits.max_constraint_size} "
                              f"characters (--max-constraint-size)", name)
        try:
            await asyncio.wait_for(asyncio.to_thread(core.compile_grammar, p),
                                   limits.grammar_compile_timeout)
        except InvalidGrammar as error:
            name = param or (prefix + error.param if error.param else None)
            raise bad_request(str(error), name) from None
        except asyncio.TimeoutError:  # the thread finishes on its own (llguidance bounds it)
            raise bad_request(f"the output constraint took longer than "
                              f"{limits.grammar_compile_timeout:g} s to compile "
                              f"(--grammar-compile-timeout)", name) from None
