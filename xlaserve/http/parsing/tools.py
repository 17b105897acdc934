"""Tools in a chat request: their checks, `tool_choice`, and the output made into `tool_calls`.

    auto      the model decides; with `--tool-call-parser` its calls are parsed out of the text
              (http/parsing/tool_parsers.py), else they stay text
    none      no calls: the tools are not shown to the model and nothing is parsed
    required  the output is constrained (structured outputs) to a JSON array of one or more
              `{"name": ..., "parameters": {...}}` of the given tools (at most one with
              `parallel_tool_calls: false`), as vLLM and SGLang do
    named     `{"type": "function", "function": {"name": "f"}}`: the output is constrained to
              f's `parameters` schema, and is f's arguments

`function.strict: true` is honoured: forced choices are always held to the schemas, and under
`auto` with `--tool-call-parser qwen25` each call's arguments are constrained (a structural tag:
free text, but from `<tool_call>` on, a call of one of the tools with its schema; non-strict
tools' arguments are then any JSON object). Other parsers refuse strict tools under `auto`.

Forced choices need no parser, so they work with any model. A forced output cut by max_tokens
ends with "length" and keeps only whole calls: none for a named function (the text is the
content), the array's complete items for `required` (a small model may repeat calls until
max_tokens), never a half call.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid

from xlaserve.http.errors import bad_request
from xlaserve.runtime.sampling.grammar import check_depth
from xlaserve.runtime.sampling.params import InvalidGrammar
from xlaserve.runtime.sampling.params import RequestLimits

NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclasses.dataclass
class ToolChoice:
    mode: str  # "auto", "none", "required" or "named"
    name: str | None = None  # the function of a named choice


def check_tools(tools: list[dict] | None, limits: RequestLimits | None = None) -> dict[str, dict]:
    """OpenAI's `tools` -> {name: function}; anything malformed, more than --max-tools tools or a
    parameters schema over --max-constraint-size (each becomes a grammar) is a 400 naming
    `tools`."""
    limits = limits or RequestLimits.defaults()
    if len(tools or ()) > limits.max_tools:
        raise bad_request(f"{len(tools)} tools given; at most {limits.max_tools} (--max-tools)",
                          "tools")
    functions = {}
    for i, tool in enumerate(tools or ()):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(f"tools[{i}]: only tools of type 'function' are supported", "tools")
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not function["name"]:
            raise bad_request(f"tools[{i}].function needs a name", "tools")
        parameters = function.get("parameters", NO_PARAMETERS)
        if not isinstance(parameters, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        try:
            check_depth(parameters, f"tools[{i}].function.parameters")
        except InvalidGrammar as error:
            raise bad_request(str(error), "tools") from None
        if len(json.dumps(parameters)) > limits.max_constraint_size:
            raise bad_request(f"tools[{i}].function.parameters is longer than "
                              f"{limits.max_constraint_size} characters (--max-constraint-size)",
                              "tools")
        if function["name"] in functions:
            raise bad_request(f"tools[{i}]: the function name {function['name']!r} is used twice",
                              "tools")
        functions[function["name"]] = function
    return functions


async def check_tool_schemas(ctx, functions: dict[str, dict]) -> None:
    """Each tool's `parameters` must be a JSON schema the grammar backend takes (cached by text,
    built off the event loop); a 400 naming `tools` otherwise. Without a grammar backend only
    their shape was checked (check_tools)."""
    backend = ctx.core.grammar_backend
    if backend is None:
        return
    timeout = ctx.core.limits.grammar_compile_timeout
    for name, function in functions.items():
        try:
            await asyncio.wait_for(asyncio.to_thread(backend.compile, "json_schema",
                                                     json.dumps(parameters_of(function))), timeout)
        except InvalidGrammar as error:
            raise bad_request(f"tool {name!r}: parameters is not a usable JSON schema: {error}",
                              "tools") from None
        except asyncio.TimeoutError:
            raise bad_request(f"tool {name!r}: parameters took longer than {timeout:g} s to "
                              f"compile (--grammar-compile-timeout)", "tools") from None


def tool_choice_of(choice, functions: dict[str, dict]) -> ToolChoice:
    """`tool_choice` (checked against the tools) -> ToolChoice. The default is auto with tools,
    none without, as OpenAI's."""
    if choice is None:
        return ToolChoice("auto" if functions else "none")
    if not functions:
        raise bad_request("tool_choice needs tools", "tool_choice")
    if choice in ("auto", "none", "required"):
        return ToolChoice(choice)
    if isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not isinstance(name, str) or name not in functions:
            raise bad_request(f"tool_choice names the function {str(name)[:64]!r}, which is not in tools "
                              f"({', '.join(sorted(functions))})", "tool_choice")
        return ToolChoice("named", name)
    raise bad_request("tool_choice must be 'none', 'auto', 'required' or "
                      '{"type": "function", "function": {"name": ...}}', "tool_choice")


def parameters_of(function: dict) -> dict:
    return function.get("parameters") or NO_PARAMETERS


def forced_schema(choice: ToolChoice, functions: dict[str, dict], parallel: bool) -> str | None:
    """The JSON schema (text) a forced choice constrains the output to; None for auto/none."""
    if choice.mode == "named":
        return json.dumps(parameters_of(functions[choice.name]))
    if choice.mode != "required":
        return None
    calls = [{"type": "object", "additionalProperties": False,
              "required": ["name", "parameters"],
              "properties": {"name": {"const": name}, "parameters": parameters_of(function)}}
             for name, function in functions.items()]
    schema = {"type": "array", "minItems": 1,
              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return json.dumps(schema)


def forced_calls(choice: ToolChoice, text: str) -> list[tuple[str, str]] | None:
    """The whole calls of a forced choice's output [(name, arguments JSON)], or None where there
    is none (the output was cut by max_tokens before a call was complete)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None if choice.mode == "named" else _complete_items(text)
    if value is None:
        return None
    if choice.mode == "named":
        return [(choice.name, json.dumps(value, ensure_ascii=False))]
    return [(call["name"], json.dumps(call["parameters"], ensure_ascii=False)) for call in value] or None


def _complete_items(text: str) -> list | None:
    """The whole items at the start of a cut JSON array (`[{...}, {...}, {"na`)."""
    decoder, items = json.JSONDecoder(), []
    at = text.find("[")
    if at == -1 or text[:at].strip():
        return None
    at += 1
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        try:
            item, at = decoder.raw_decode(text, at)
        except ValueError:
            return items or None
        items.append(item)


# Parsers whose calls can be held to their schemas under `auto`: (trigger, begin, end) of a call.
_STRICT_FORMATS = {
    "qwen25": ("<tool_call>", '<tool_call>\n{{"name": "{name}", "arguments": ', "}\n</tool_call>"),
    "qwen": ("<tool_call>", '<tool_call>\n{{"name": "{name}", "arguments": ', "}\n</tool_call>"),
}


def strict_tool_tag(parser: str | None, functions: dict[str, dict]) -> str | None:
    """The structural tag (JSON text) that holds `auto` calls to their schemas when some tool is
    strict, None when none is (or no parser parses calls out of the text)."""
    if parser is None or not any(f.get("strict") for f in functions.values()):
        return None
    if parser not in _STRICT_FORMATS:
        raise bad_request(f"strict tools under tool_choice 'auto' are enforced with "
                          f"--tool-call-parser qwen25, not {parser}; force the choice ('required' "
                          "or a named function: always held to the schema) or drop strict", "tools")
    trigger, begin, end = _STRICT_FORMATS[parser]
    structures = [{"begin": begin.format(name=name), "end": end,
                   "schema": parameters_of(f) if f.get("strict") else {"type": "object"}}
                  for name, f in functions.items()]
    return json.dumps({"structures": structures, "triggers": [trigger]})


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_dict(name: str, arguments: str, call_id: str | None = None) -> dict:
    return {"id": call_id or new_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}
