"""A request's output constraint: SGLang's `regex` / `ebnf` / `json_schema` keys, OpenAI's
`response_format` or vLLM's `guided_*` / `structured_outputs` (vllm_constraints.py), checked and
turned into one SamplingParams field, and its grammar compiled off the event loop with the
server's size and time bounds."""
from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Iterable

from xlaserve.http.errors import bad_request
from xlaserve.http.protocol import SamplingFields
from xlaserve.http.vllm_constraints import vllm_constraints
from xlaserve.runtime.sampling.grammar import CONSTRAINT_FIELDS, InvalidGrammar, check_depth
from xlaserve.runtime.sampling.params import SamplingParams

if TYPE_CHECKING:
    from xlaserve.runtime.engine.core import EngineCore

CONSTRAINTS = CONSTRAINT_FIELDS  # SamplingParams' fields and SGLang's request keys, in order
_RESPONSE_FORMAT_KEYS = {"type", "json_schema", "schema"}
_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}


def request_constraint(req: SamplingFields) -> tuple[str, str] | None:
    """The request's output constraint as (SamplingParams field, text), or None: SGLang's
    `regex`, `ebnf`, `json_schema` (JSON text) keys, OpenAI's `response_format`, or vLLM's
    `guided_*` keys and `structured_outputs` (vllm_constraints.py); at most one."""
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


async def compile_constraints(core: EngineCore, params: Iterable[SamplingParams],
                              param: str | None = None, prefix: str = "") -> None:
    """Builds (or finds in the engine's cache) each distinct grammar of `params` in a worker
    thread, so a slow build never stalls the event loop; an invalid one is a 400 naming `param`
    (else the field, after `prefix`). Requests without a constraint cost nothing here."""
    limits = core.limits
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
            await asyncio.wait_for(asyncio.to_thread(core.compile_grammar, p),
                                   limits.grammar_compile_timeout)
        except InvalidGrammar as error:
            name = param or (prefix + error.param if error.param else None)
            raise bad_request(str(error), name) from None
        except asyncio.TimeoutError:  # the thread finishes on its own (llguidance bounds it)
            raise bad_request(f"the output constraint took longer than "
                              f"{limits.grammar_compile_timeout:g} s to compile "
                              f"(--grammar-compile-timeout)", name) from None
