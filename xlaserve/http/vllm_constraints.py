"""vLLM's structured-output request fields as the server's constraints (constraints.py):
`structured_outputs: {"json", "regex", "choice", "grammar", "json_object"}` (vLLM >= 0.10.2) and
the older top-level `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

Each becomes one SamplingParams constraint: a JSON schema (`json_schema`), a regex (`regex`, the
Rust syntax llguidance reads, after grammar.python_regex_to_rust as SGLang's `regex` key), or a
grammar (`ebnf`: GBNF `root ::= ...`, or Lark text whose first rule is `start:`, which
llguidance recognises as Lark). A choice is the regex of its alternatives, each escaped, so the
output is exactly one of them. The backend names (`guided_decoding_backend`,
`structured_outputs.backend`) are accepted and ignored: llguidance is the only backend here;
`guided_whitespace_pattern` is a 400 (the server's --constrained-json-whitespace-pattern holds).
"""
from __future__ import annotations

import functools
import json
import logging

from xlaserve.http.errors import bad_request, not_supported
from xlaserve.runtime.sampling.grammar import InvalidGrammar, check_depth

logger = logging.getLogger(__name__)

# structured_outputs' keys that set a constraint -> the SamplingParams field they set.
_STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "choice": "regex",
                     "grammar": "ebnf", "json_object": "json_schema"}
_STRUCTURED_IGNORED = {"backend"}  # the grammar library's name: llguidance is the only one here
# Rust regex's metacharacters (regex::escape's set): a choice is matched literally.
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")
ANY_JSON_OBJECT = '{"type": "object"}'  # json_object, as response_format's (SGLang's) grammar


def vllm_constraints(req) -> list[tuple[str, str, str]]:
    """(request parameter, SamplingParams field, text) of each vLLM constraint the request sets."""
    given = []
    for param, field in (("guided_json", "json_schema"), ("guided_regex", "regex"),
                         ("guided_choice", "regex"), ("guided_grammar", "ebnf")):
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
        try:  # refused before json.dumps walks a schema nested without end
            check_depth(value, param)
        except InvalidGrammar as error:
            raise bad_request(str(error), param) from None
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
