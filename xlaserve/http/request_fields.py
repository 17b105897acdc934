"""Which fields of a request body are honoured, ignored or refused: the JSON parsed into its
protocol.py model (`parse_body`, `validate_body`), what the server does with the fields it does
not know, and the OpenAI and SGLang fields it knows but has no mechanism for.

OpenAI adds request fields over time and its SDK sends what the caller gives it; vLLM and SGLang
accept fields they do not know (vLLM logs them). So by default a body's unknown top-level fields,
and unknown keys of `stream_options`, are dropped before the body is validated: each distinct
name is logged once per server (a WARNING, not one line per request), and the answer names them
in the `X-Ignored-Fields` header, so the client that sent them can see they did nothing.
`--strict-request-fields` refuses them instead (a 400 naming the field, as before).

Some fields peers know would change what answers a request if they were dropped: which weights
(SGLang's internal `lora_id`; `lora_path` is honoured), what the logits go through
(`custom_logit_processor`), what the prompt is (`session_params`' continued session,
`image_data` but on /generate of a vision model, `video_data`, `audio_data`). This server serves
none of them, so a body that asks for one (any value but null, or a list of nulls) is a 400
naming it, whatever the flag (`ANSWER_CHANGING_FIELDS`), before anything reaches the engine.

Nested objects: messages keep extra keys (clients echo assistant messages back with `refusal`,
`annotations`, `audio`: protocol.ChatMessage); tools are passed to the template as given;
`response_format` and `structured_outputs` refuse unknown keys whatever the flag, since a key
there would change what the output may be; `/generate`'s `sampling_params` refuses unknown keys,
as SGLang's SamplingParams(**params) does.

Known fields of OpenAI's Chat Completions and SGLang's /generate that the server accepts without
a mechanism of its own are each either a documented no-op (they cannot change what a self-hosted
server generates) or a 400 naming them when set (they ask for output this server cannot give,
and dropping them would hand back something the client did not ask for).

Chat no-ops, and why:
- `store`, `metadata`: storing chat completions for OpenAI's dashboard and evals; chat
  completions are not stored here (`/v1/responses` has its own `store`, which is honoured).
- `service_tier`: OpenAI's billing/latency tier; one tier here.
- `user`, `safety_identifier`: abuse monitoring ids on OpenAI's service.
- `prompt_cache_key`, `prompt_cache_retention`, `prompt_cache_options`: the prefix cache here is
  automatic (every request's prefix is matched), its lifetime the pool's LRU eviction.
- `verbosity`: a GPT-5 hint with no equivalent in other models' templates.
- `prediction`: Predicted Outputs only speed OpenAI up (predicted tokens that differ are
  discarded); the generated text is the model's either way, so here it is the same, unsped.
- `stream_options.include_obfuscation`: padding against length side channels on a shared
  service; no padding is added here.
Chat 400s when set (`check_chat_fields`): `modalities` other than ["text"], `audio` (audio
output), `web_search_options` (search-grounded answers), `moderation` (no moderation model),
`functions`/`function_call` (the deprecated function-calling shape: use `tools`/`tool_choice`).
/generate's `sampling_params` keys of SGLang's with no SamplingParams field:
`sglang_sampling_keys`.
"""
from __future__ import annotations

import logging
import threading
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError

from xlaserve.http.errors import APIError, bad_request, not_supported, validation_message
from xlaserve.http.protocol import StreamOptions

logger = logging.getLogger(__name__)

IGNORED_FIELDS_HEADER = "X-Ignored-Fields"
# Nested objects whose unknown keys follow the same policy (named "parent.key").
_NESTED = {"stream_options": StreamOptions}
NAME_CHARS = 64  # a client's field name is echoed (log, header) at most this long
MAX_LOGGED_NAMES = 256  # distinct names remembered: a client sending new names cannot grow it
MAX_HEADER_NAMES = 32  # names listed in the header (then "...")
_NO_ADAPTERS = ("{} names a LoRA adapter by SGLang's internal id: name it with lora_path (or "
                "model BASE:NAME)")
_TEXT_ONLY = "{} is not supported: this server's model takes text only"
# Unknown fields a request may not set (module docstring): name -> why, as the 400 says it.
ANSWER_CHANGING_FIELDS = {
    "lora_id": _NO_ADAPTERS.format("lora_id"),
    "custom_logit_processor": "custom_logit_processor is not supported: this server runs no "
                              "custom logit processors",
    "session_params": "session_params is not supported: this server keeps no SGLang sessions",
    # /generate knows it (a vision model's images; refused by the route on a text model)
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


# --- known fields without a mechanism here (module docstring) ----------------------------

_UNSUPPORTED_CHAT = {
    "audio": "audio output",
    "web_search_options": "web search",
    "moderation": "moderation",
    "functions": "functions (the deprecated function-calling fields; use tools)",
    "function_call": "function_call (the deprecated function-calling fields; use tool_choice)",
}


def check_chat_fields(req) -> None:
    """400 naming the first OpenAI chat field that asks for something this server cannot do."""
    if req.modalities is not None and req.modalities != ["text"]:
        raise not_supported("modalities", f"modalities {req.modalities[:4]!r} (only [\"text\"])")
    for name, what in _UNSUPPORTED_CHAT.items():
        if getattr(req, name) is not None:
            raise not_supported(name, what)


# SGLang's /generate sampling keys handled here rather than by SamplingParams.
SGLANG_SAMPLING_KEYS = ("sampling_seed", "stop_regex", "spaces_between_special_tokens",
                        "custom_params")


def sglang_sampling_keys(params, tokenizer):
    """One /generate `sampling_params` object with SGLang's keys that have no SamplingParams
    field turned into ours (or refused): `sampling_seed` is `seed`; `stop_regex` is a 400 (the
    stop machinery matches strings only); `spaces_between_special_tokens` changes nothing for a
    Rust (`tokenizers`) tokenizer, whose decode has no such option (transformers ignores it
    there too), so it is accepted for those and refused as False for any other;
    `custom_params` feeds SGLang's custom logit processors, which this server does not run:
    accepted, ignored."""
    if not isinstance(params, dict) or not any(k in params for k in SGLANG_SAMPLING_KEYS):
        return params
    params = dict(params)
    prefix = "sampling_params."
    if "sampling_seed" in params:
        seed = params.pop("sampling_seed")
        if seed is not None:
            if params.get("seed") is not None and params["seed"] != seed:
                raise bad_request("sampling_seed and seed differ; give one", prefix + "sampling_seed")
            params["seed"] = seed
    if params.pop("stop_regex", None) not in (None, [], ""):
        raise not_supported(prefix + "stop_regex",
                            "stop_regex (stop strings and stop_token_ids are)")
    spaces = params.pop("spaces_between_special_tokens", None)
    if spaces is not None:
        if not isinstance(spaces, bool):
            raise bad_request("spaces_between_special_tokens must be a boolean",
                              prefix + "spaces_between_special_tokens")
        if not spaces and getattr(tokenizer, "backend_tokenizer", None) is None:
            raise not_supported(prefix + "spaces_between_special_tokens",
                                "spaces_between_special_tokens=false with this tokenizer")
    params.pop("custom_params", None)
    return params
