"""The flags of a vision-language server (Qwen2-VL, Qwen2.5-VL: images in chat messages), and
two of them read (--limit-mm-per-prompt and --mm-processor-kwargs, both JSON as vLLM takes them:
`images_per_request`, `processor_kwargs`), checked where the server starts, once the model is
known to have a vision tower."""
from __future__ import annotations

import dataclasses
import json
from typing import Optional

from xlaserve.server_args.flag import flag

DEFAULT_IMAGES_PER_REQUEST = 16


@dataclasses.dataclass
class ImageFlags:
    """Images: their size, how many, where they may come from."""

    mm_processor_kwargs: Optional[str] = flag(
        None, "the image processor's min_pixels and max_pixels, as JSON (vLLM's flag), e.g. "
              "{\"max_pixels\": 1003520}: images are resized to fit; the vision tower is "
              "precompiled up to max_pixels (default: the checkpoint's, at most 1280*28*28)")
    limit_mm_per_prompt: Optional[str] = flag(
        None, "images a request may carry, as vLLM's JSON {\"image\": N} (default 16); 0 serves "
              "an image checkpoint's decoder alone (Gemma 3, Gemma 4, Llama 4: the tower not "
              "read, --quantization, speculation and LoRA open)")
    max_image_bytes: int = flag(
        20 * 2**20, "the largest image a request may send (a data: URL's decoded bytes, or a "
                    "fetched URL's body)")
    disable_image_url_fetch: bool = flag(
        False, "refuse http(s) image URLs (only data: URLs, and files under "
               "--allowed-local-media-path); fetched URLs (and up to 5 redirects) must resolve "
               "to public addresses either way")
    image_fetch_timeout: float = flag(5.0, "seconds to fetch one image URL")
    allowed_local_media_path: Optional[str] = flag(
        None, "a directory whose files requests may name as images (file:// URLs; vLLM's "
              "flag); none by default", path=True)


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
