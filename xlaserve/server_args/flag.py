"""A flag, declared once: a field of one area's dataclass made by `flag()`, whose metadata says
all the rest. The argparse option is built from it (name -> `--name-with-dashes`, its default,
its help), so nothing about a flag is written twice.

The metadata keys this package reads (the others go to argparse as they are: choices, nargs):
- "help": the --help text.
- "aliases": more option strings, SGLang's and vLLM's names for the flag (`--tensor-parallel-size`).
- "value_aliases": their names for a value, turned into ours (`deepseek_r1` -> `deepseek-r1`).
- "env": an environment variable read when the flag is not given.
- "secret": shown as "***" wherever the arguments are logged or served (ServerArgs.redacted).
- "path": served by its last component only (ServerArgs.served, `public_name`), since a path on
  the server's disk is nothing a client needs.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os

_OWN_METADATA = ("help", "env", "secret", "path", "aliases", "value_aliases")
logger = logging.getLogger("xlaserve")


def flag(default, help: str, **argparse_kwargs):
    return dataclasses.field(default=default, metadata={"help": help, **argparse_kwargs})


def add_to_parser(parser: argparse.ArgumentParser, fields) -> None:
    """An option of `parser` for each of `fields` (a flags dataclass's), in their order."""
    for field in fields:
        option = "--" + field.name.replace("_", "-")
        names = (option, *field.metadata.get("aliases", ()))
        extra = {k: v for k, v in field.metadata.items() if k not in _OWN_METADATA}
        if "choices" in extra:
            extra["choices"] = [*extra["choices"], *field.metadata.get("value_aliases", {})]
        if field.type in ("bool", bool):
            parser.add_argument(*names, dest=field.name, action="store_true",
                                help=field.metadata["help"])
            continue
        # `from __future__ import annotations` makes types strings: "int", "Optional[float]"...
        type_name = str(field.type).removeprefix("Optional[").removesuffix("]")
        kind = {"int": int, "float": float, "list[float]": float}.get(type_name, str)
        parser.add_argument(*names, dest=field.name, type=kind, default=field.default,
                            help=field.metadata["help"], **extra)


def values_of(namespace: argparse.Namespace, fields) -> dict:
    """{name: value} of `fields` from parsed arguments, each flag not given that names an
    environment variable taken from it where it is set."""
    values = {f.name: getattr(namespace, f.name) for f in fields}
    for field in fields:
        variable = field.metadata.get("env")
        if variable and values[field.name] is None and os.environ.get(variable):
            values[field.name] = os.environ[variable]
    return values


def serve_value_aliases(args) -> None:
    """SGLang's and vLLM's names for a flag's value become ours, in place (logged)."""
    for field in dataclasses.fields(args):
        aliases = field.metadata.get("value_aliases", {})
        value = getattr(args, field.name)
        if aliases and value in aliases:
            logger.info("--%s %s: served as %s", field.name.replace("_", "-"), value,
                        aliases[value])
            setattr(args, field.name, aliases[value])


def public_name(value: str | None) -> str | None:
    """What a client may see of `value`: a file or directory on this machine (an absolute path,
    ~/..., or a relative path that exists) by its own name, never the folders above it; anything
    else (a hub id such as Qwen/Qwen2.5-0.5B-Instruct, a built-in template name, Jinja text) as
    given. None stays None."""
    if value is None:
        return None
    path = os.path.expanduser(value)
    if not (os.path.isabs(path) or os.path.exists(path)):
        return value
    return os.path.basename(os.path.abspath(path))  # abspath: no trailing "/", "." named


def json_flag(text: str, name: str):
    """A flag's JSON value (--hf-overrides, --pooler-config), or a ValueError naming the flag."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{name} is not JSON: {error}") from None
