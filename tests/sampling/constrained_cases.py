"""Constraints of each kind and how to check an output against them without the grammar library:
`jsonschema` for JSON, `re.fullmatch` for regex, and for the EBNF grammar a regular expression
that spells out the same language by hand."""
import json
import re

import jsonschema

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                    "properties": {"city": {"type": "string", "maxLength": 10},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "score", "color", "tags", "address", "active"],
    "additionalProperties": False,
}
REGEX = r"(\+|-)?[0-9]{1,4}(\.[0-9]{1,3})? (apples|pears)"
EBNF = ('root ::= "The " animal " is " color "."\n'
        'animal ::= "cat" | "dog" | "horse"\n'
        'color ::= [a-z]{1,8}')
EBNF_AS_REGEX = r"The (cat|dog|horse) is [a-z]{1,8}\."

# kind -> (sampling parameter, its value)
CONSTRAINTS = {
    "json_schema": ("json_schema", json.dumps(SCHEMA)),
    "json_object": ("json_schema", '{"type": "object"}'),  # what response_format json_object sends
    "regex": ("regex", REGEX),
    "ebnf": ("ebnf", EBNF),
}


def check(kind: str, text: str) -> None:
    """Raises unless `text` is in the constraint's language."""
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert re.fullmatch(EBNF_AS_REGEX, text), text


def is_json_prefix(text: str) -> bool:
    """Whether `text` is the start of some JSON document (what a truncated output must be)."""
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError as error:
        return error.pos >= len(text.rstrip()) or error.msg.startswith("Unterminated string")
