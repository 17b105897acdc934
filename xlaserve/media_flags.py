"""The vision-language server's flags read (ServerArgs' --limit-mm-per-prompt and
--mm-processor-kwargs, both JSON as vLLM takes them), checked where the server starts."""
from __future__ import annotations

import json

DEFAULT_IMAGES_PER_REQUEST = 16


def images_per_request(args) -> int:
    """--limit-mm-per-prompt's images (default DEFAULT_IMAGES_PER_REQUEST); other modalities are
    refused (this server takes images only)."""
    limits = _json_object(args.limit_mm_per_prompt, "--limit-mm-per-prompt")
    if set(limits) - {"image"}:
        raise ValueError(f"--limit-mm-per-prompt: {sorted(set(limits) - {'image'})} not "
                         "supported (images only)")
    count = limits.get("image", DEFAULT_IMAGES_PER_REQUEST)
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ValueError(f"--limit-mm-per-prompt image: a count >= 0, got {count!r}")
    return count


def processor_kwargs(args) -> dict:
    """--mm-processor-kwargs: min_pixels and max_pixels (positive integers)."""
    kwargs = _json_object(args.mm_processor_kwargs, "--mm-processor-kwargs")
    for key, value in kwargs.items():
        if key not in ("min_pixels", "max_pixels"):
            raise ValueError(f"--mm-processor-kwargs: {key!r} not supported (min_pixels, "
                             "max_pixels)")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"--mm-processor-kwargs {key}: a positive integer, got {value!r}")
    return kwargs


def _json_object(text: str | None, flag: str) -> dict:
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{flag} is not JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag}: a JSON object")
    return value
