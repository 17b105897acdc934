"""Random JSON for the fuzz tests (tests/http/test_fuzz*.py): scalars at the edges of every range
the server checks, plausible fragments of real bodies, JSON schemas, regexes, grammars and
structural tags, and `mutated`, which puts such values at one to three places of a valid body."""
from __future__ import annotations

import copy
import json

from hypothesis import strategies as st


EDGE_INTS = [0, 1, -1, 2, 3, 20, 21, 64, 129, 257, 511, 512, 513, 49151, 49152, 2**31 - 1, 2**31,
             -2**31 - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63, -2**63 - 1, 2**64, -2**70, 10**30]
EDGE_FLOATS = [0.0, -0.0, 0.5, 1.0, 1.5, 2.0, -2.0, 2.5, 100.0, 100.5, 1e-300, 5e-324, 1e308,
               -1e308, 1.7976931348623157e308]
EDGE_TEXTS = ["", " ", "tiny", "default", "auto", "none", "required", "text", "json_object",
              "json_schema", "structural_tag", "function", "object", "string", "user", "assistant",
              "system", "tool", "developer", "batch", "24h", "/v1/chat/completions",
              "/chat/completions", "/v1/completions", "5", "-1", "49152", "1e3",
              "99999999999999999999", "<|im_end|>", "<|endoftext|>", "<tool_call>", "é 🙂 中文",
              "\x00", "\ud800", "\r\n", "../../etc/passwd", "[a-", "(a*)*b", 'root ::= "a"',
              '{"type": "object"}', "{{ messages }}", "{% for x in y %}", "a" * 3000,
              "hello world " * 300]  # over the context
PLAUSIBLE = [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "string", "pattern": "[a-"},
    {"type": "array", "minItems": 2**31},
    {"$ref": "#"},
    {"type": "function", "function": {"name": "f"}},
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}},
    [{"type": "function", "function": {"name": "g"}}],
    [{"role": "user", "content": "hi"}],
    [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}],
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
    {"type": "json_object"},
    {"include_usage": True, "continuous_usage_stats": True},
    {"5": 100, "49151": -100},
    [1, 2, 3],
    [[1, 2], [3]],
    ["a", "b"],
    {"max_new_tokens": 2, "n": 2},
]
SCHEMA_KEYWORDS = ["type", "properties", "items", "prefixItems", "required", "enum", "const",
                   "anyOf", "oneOf", "allOf", "not", "$ref", "$defs", "additionalProperties",
                   "patternProperties", "minLength", "maxLength", "pattern", "format", "minimum",
                   "maximum", "exclusiveMinimum", "multipleOf", "minItems", "maxItems",
                   "uniqueItems", "minProperties", "default"]
SCHEMA_TYPES = ["object", "string", "integer", "number", "boolean", "array", "null"]
DELETE = object()  # a value that removes the field
NEW = object()  # a path step: a random key
APPEND = object()  # a path step: a new last item of a list


def _scalars():
    return st.one_of(
        st.none(), st.booleans(), st.integers(-3, 70), st.integers(), st.sampled_from(EDGE_INTS),
        st.floats(allow_nan=False, allow_infinity=False), st.sampled_from(EDGE_FLOATS),
        st.text(max_size=12), st.sampled_from(EDGE_TEXTS))


JSON_VALUES = st.recursive(
    _scalars() | st.sampled_from(PLAUSIBLE),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8) | st.sampled_from(["type", "name", "schema"]), children,
                      max_size=4),
    max_leaves=10)
VALUES = st.one_of(JSON_VALUES, st.just(DELETE))
# JSON schemas made of schema keywords, for the fields the grammar backend compiles.
SCHEMAS = st.recursive(
    st.booleans() | st.fixed_dictionaries(
        {"type": st.sampled_from(SCHEMA_TYPES) | st.lists(st.sampled_from(SCHEMA_TYPES), max_size=3)}),
    lambda schemas: st.dictionaries(
        st.sampled_from(SCHEMA_KEYWORDS),
        schemas | _scalars() | st.lists(schemas, max_size=3)
        | st.dictionaries(st.text(max_size=4), schemas, max_size=3), max_size=4),
    max_leaves=12)
REGEXES = st.text(alphabet="ab()[]{}*+?|\\^$.-,0123456789dwsPZz<>=!:", max_size=16)
EBNFS = st.sampled_from(['root ::= "a" | "b"', "root ::= root", "root ::= x", 'root ::= "a"*',
                         'root ::= [a-', "", "root ::= %json {}", 'root ::= "x" root']) \
    | st.text(alphabet='root:=|"ab*+?()[]%{} \n', max_size=30)
STRUCTURAL_TAGS = st.builds(
    lambda begin, end, schema, triggers: json.dumps(
        {"structures": [{"begin": begin, "schema": schema, "end": end}], "triggers": triggers}),
    st.sampled_from(["<a>", "<tool_call>", ""]) | st.text(max_size=6),
    st.sampled_from(["</a>", ""]) | st.text(max_size=6), SCHEMAS,
    st.lists(st.sampled_from(["<a", "<tool_call>", ""]) | st.text(max_size=4), max_size=2))
# Text httpx can put in a URL or a form (no lone surrogates; JSON bodies carry them escaped).
PLAIN_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=30)
PLAIN_EDGE_TEXTS = [t for t in EDGE_TEXTS if t != "\ud800"]
KEYS = st.text(max_size=12) | st.sampled_from(
    ["5", "0", "-1", "49151", "49152", "1e3", "0x10", " 7", "٣", "99999999999999999999",
     "99999999999999999999999", "type", "n", "seed"])


def put(body, path: tuple, value):
    """`body` with `value` at `path` (dicts on the way are made; a path through anything else
    leaves the body as it is); DELETE removes the field."""
    if not path:
        return body if value is DELETE else value
    node = body
    for key in path[:-1]:
        if isinstance(node, dict) and isinstance(key, str):
            node = node.setdefault(key, {})
        elif isinstance(node, list) and isinstance(key, int) and key < len(node):
            node = node[key]
        else:
            return body
    key = path[-1]
    if isinstance(node, list) and key is APPEND:
        if value is not DELETE:
            node.append(value)
    elif isinstance(node, dict) and isinstance(key, str) or \
            isinstance(node, list) and isinstance(key, int) and key < len(node):
        if value is DELETE:
            node.pop(key, None) if isinstance(node, dict) else node.pop(key)
        else:
            node[key] = value
    return body


def get(body, path: tuple):
    """The value at `path`, or DELETE where there is none."""
    for key in path:
        if isinstance(body, dict) and isinstance(key, str) and key in body \
                or isinstance(body, list) and isinstance(key, int) and key < len(body):
            body = body[key]
        else:
            return DELETE
    return body


def like(value):
    """Values of `value`'s JSON type, edges included: what passes the type check and tests the
    range checks behind it."""
    if isinstance(value, bool):
        return st.booleans()
    if isinstance(value, int):
        return st.integers(-3, 70) | st.integers() | st.sampled_from(EDGE_INTS)
    if isinstance(value, float):
        return st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from(EDGE_FLOATS) \
            | st.sampled_from(EDGE_INTS)
    if isinstance(value, str):
        return st.text(max_size=30) | st.sampled_from(EDGE_TEXTS)
    if isinstance(value, list) and value:
        return st.lists(like(value[0]), max_size=5)
    return JSON_VALUES


def for_field(name, current):
    """Values made for what the field is: schemas, regexes, grammars, structural tags."""
    if name in ("schema", "parameters"):
        return SCHEMAS
    if name == "json_schema":
        return SCHEMAS.map(json.dumps) if isinstance(current, str) or current is DELETE \
            else st.fixed_dictionaries({"name": st.just("x"), "schema": SCHEMAS})
    if name == "logit_bias":  # around the engine's widths (MAX_LOGIT_BIAS, its padding)
        return st.sampled_from([63, 64, 65, 128, 129, 256, 257, 300, 301]).map(
            lambda n: {str(i): 1.0 for i in range(n)})
    if name == "stop_token_ids":
        return st.sampled_from([63, 64, 65]).map(lambda n: list(range(100, 100 + n)))
    if name == "stop":
        return st.sampled_from([(16, 256), (17, 1), (1, 257)]).map(lambda nk: ["s" * nk[1]] * nk[0])
    if name == "regex":
        return REGEXES
    if name == "ebnf":
        return EBNFS
    if name == "structural_tag":
        return STRUCTURAL_TAGS
    return st.nothing()


@st.composite
def mutated(draw, bases: list, paths: list):
    """A copy of one of `bases` with random values at one to three of `paths`: as often values
    of the type already there as any JSON value."""
    body = copy.deepcopy(draw(st.sampled_from(bases)))
    for path in draw(st.lists(st.sampled_from(paths), min_size=1, max_size=3)):
        path = tuple(draw(KEYS) if step is NEW else step for step in path)
        current = get(body, path)
        typed = like(current) if current is not DELETE and current is not None else JSON_VALUES
        body = put(body, path, draw(for_field(path[-1] if path else None, current) | typed | VALUES))
    return body
