"""A request body's fields: the JSON parsed into its protocol.py model (`parse_body`,
`validate_body`), and what the server does with the fields it does not know.

OpenAI adds request fields over time and its SDK sends what the caller gives it; vLLM and SGLang
accept fields they do not know (vLLM logs them). So by default a body's unknown top-level fields,
and unknown keys of `stream_options`, are dropped before the body is validated: each distinct
name is logged once per server (a WARNING, not one line per request), and the answer names them
in the `X-Ignored-Fields` header, so the client that sent them can see they did nothing.
`--strict-request-fields` refuses them instead (a 400 naming the field, as before).

Some fields peers know would change what answers a request if they were dropped: which weights
(SGLang's `lora_path` and `lora_id`, an adapter), what the logits go through
(`custom_logit_processor`), what the prompt is (`session_params`' continued session,
`image_data`, `video_data`, `audio_data`). This server serves none of them, so a body that asks
for one (any value but null, or a list of nulls) is a 400 naming it, whatever the flag
(`ANSWER_CHANGING_FIELDS`), before anything reaches the engine.

Nested objects: messages keep extra keys (clients echo assistant messages back with `refusal`,
`annotations`, `audio`: protocol.ChatMessage); tools are passed to the template as given;
`response_format` and `structured_outputs` refuse unknown keys whatever the flag, since a key
there would change what the output may be; `/generate`'s `sampling_params` refuses unknown keys,
as SGLang's SamplingParams(**params) does.
"""
from __future__ import annotations

import logging
import threading
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError

from xlaserve.http.errors import APIError, bad_request, validation_message
from xlaserve.http.protocol import StreamOptions

logger = logging.getLogger(__name__)

IGNORED_FIELDS_HEADER = "X-Ignored-Fields"
# Nested objects whose unknown keys follow the same policy (named "parent.key").
_NESTED = {"stream_options": StreamOptions}
NAME_CHARS = 64  # a client's field name is echoed (log, header) at most this long
MAX_LOGGED_NAMES = 256  # distinct names remembered: a client sending new names cannot grow it
MAX_HEADER_NAMES = 32  # names listed in the header (then "...")
_NO_ADAPTERS = ("{} names a LoRA adapter, and this server serves none: it answers with its base "
                "model's weights only")
_TEXT_ONLY = "{} is not supported: this server's model takes text only"
# Unknown fields a request may not set (module docstring): name -> why, as the 400 says it.
ANSWER_CHANGING_FIELDS = {
    "lora_path": _NO_ADAPTERS.format("lora_path"),
    "lora_id": _NO_ADAPTERS.format("lora_id"),
    "custom_logit_processor": "custom_logit_processor is not supported: this server runs no "
                              "custom logit processors",
    "session_params": "session_params is not supported: this server keeps no SGLang sessions",
    "image_data": _TEXT_ONLY.format("image_data"),
    "video_data": _TEXT_ONLY.format("video_data"),
    "audio_data": _TEXT_ONLY.format("audio_data"),
}


class RequestFields:
    """The server's unknown-field policy: `strict` refuses them (pydantic's extra="forbid"),
    otherwise `drop_unknown` removes them and logs each distinct name once."""

    def __init__(self, strict: bool = False):
        self.strict = strict
        self._logged: set[str] = set()
        self._full_logged = False
        self._lock = threading.Lock()  # bodies are parsed on the loop and in worker threads

    def drop_unknown(self, data: Any, model: type[BaseModel]) -> tuple[Any, list[str]]:
        """(the body without the fields `model` does not know, their names); strict: as given.
        A field of ANSWER_CHANGING_FIELDS that asks for something is a 400 either way."""
        if not isinstance(data, dict):
            return data, []
        known = model.model_fields
        refuse_answer_changing(data, known)
        if self.strict:
            return data, []
        ignored = [_name(key) for key in data if key not in known]
        kept = {key: value for key, value in data.items() if key in known}
        for parent, nested in _NESTED.items():
            value = kept.get(parent)
            if parent in known and isinstance(value, dict):
                extra = [key for key in value if key not in nested.model_fields]
                if extra:
                    ignored += [_name(f"{parent}.{key}") for key in extra]
                    kept[parent] = {k: v for k, v in value.items() if k in nested.model_fields}
        if ignored:
            self._log_once(ignored)
        return (kept if ignored else data), ignored

    def _log_once(self, names: list[str]) -> None:
        with self._lock:
            new = [n for n in dict.fromkeys(names) if n not in self._logged]
            room = MAX_LOGGED_NAMES - len(self._logged)
            self._logged.update(new[:room])
            full = len(new) > room and not self._full_logged
            self._full_logged |= full
        for name in new[:room]:
            logger.warning("ignoring unknown request field %s: this server does not use it "
                           "(logged once; --strict-request-fields refuses such fields)", ascii(name))
        if full:
            logger.warning("%d distinct unknown request fields logged; further new ones are not "
                           "(the X-Ignored-Fields header still names them)", MAX_LOGGED_NAMES)


def parse_body(body: bytes, model: type[BaseModel], fields: RequestFields | None = None):
    """A JSON body as `model` (a protocol.py body); any problem is a 400 naming the field
    (FastAPI would answer 422, and misread a body sent without a JSON content type). `fields`:
    the server's unknown-field policy (None: unknown fields are refused)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        raise APIError(400, f"the request body is not valid JSON: {error}") from None
    return validate_body(data, model, fields)


def validate_body(data: Any, model: type[BaseModel], fields: RequestFields | None = None):
    """Already-parsed JSON (a batch line's `body`) as `model`, with parse_body's 400s."""
    ignored: list[str] = []
    if fields is not None:
        data, ignored = fields.drop_unknown(data, model)
    try:
        parsed = model.model_validate(data)
    except ValidationError as error:
        message, param = validation_message(error.errors())
        raise APIError(400, message, param=param) from None
    if ignored:
        parsed._ignored = ignored
    return parsed


def refuse_answer_changing(data: dict, known) -> None:
    """A 400 naming the first field of ANSWER_CHANGING_FIELDS that `data` sets and the body's
    model does not know (null, or SGLang's per-prompt list of nulls, asks for nothing)."""
    for name, message in ANSWER_CHANGING_FIELDS.items():
        value = data.get(name)
        if name in known or value is None:
            continue
        if isinstance(value, list) and all(v is None for v in value):
            continue
        raise bad_request(message, name, code="unsupported_parameter")


def _name(key: str) -> str:
    return key[:NAME_CHARS]


def header_value(names: list[str]) -> str:
    """The names as one header value: printable ASCII (a name's other characters escaped as
    Python's ascii() writes them, a comma as \\x2c), comma-separated, at most MAX_HEADER_NAMES."""
    listed = [ascii(n)[1:-1].replace(",", "\\x2c") for n in dict.fromkeys(names)]
    more = len(listed) > MAX_HEADER_NAMES
    return ", ".join(listed[:MAX_HEADER_NAMES]) + (", ..." if more else "")


def with_ignored_fields(response, ignored: list[str]):
    """The response with the X-Ignored-Fields header when fields were ignored."""
    if ignored:
        response.headers[IGNORED_FIELDS_HEADER] = header_value(ignored)
    return response
