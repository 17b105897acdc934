"""Request fields of OpenAI's Chat Completions and SGLang's /generate that xlaserve accepts
without a mechanism of its own: each is either a documented no-op (it cannot change what a
self-hosted server generates) or a 400 naming it when set (it asks for output this server cannot
give, and dropping it would hand back something the client did not ask for).

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
Chat 400s when set: `modalities` other than ["text"], `audio` (audio output), `web_search_options`
(search-grounded answers), `moderation` (no moderation model), `functions`/`function_call`
(the deprecated function-calling shape: use `tools`/`tool_choice`).
"""
from __future__ import annotations

from xlaserve.http.errors import bad_request, not_supported

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
