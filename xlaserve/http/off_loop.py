"""Large request work in a worker thread, so the event loop keeps answering /health and feeding
other streams: parsing a large body, templating and tokenizing a long prompt, building and
rendering a large logprob response. With the work on the loop, a 30 MB prompt blocked it for
25-40 s (2-core CPU) before its 400; a completion echoing 500 prompt tokens with 20 alternatives
each, 96 ms. Tokenizing releases the GIL (a 30 MB text: 20 s in Rust, then 0.25 s holding the
GIL to build the id lists): /health answered within 0.4 s while one was tokenized (1.8 s
with the shared CPU at a load of 7).

Small work stays on the loop: a hop to the default executor costs 20-35 us median, 0.1-2.6 ms
p99 (idle, or beside a running stream, on the shared 2-core CPU), as much as the work below the
thresholds costs on the loop.

The tokenizer may be used from several threads at once: `encode` and `decode` take shared
borrows of the Rust tokenizer (encode releases the GIL while it runs); only a change of
truncation, padding or `encode_special_tokens` takes an exclusive one ("Already borrowed"), and
transformers changes them only when they differ from the call's (none, none, its own
`split_special_tokens`), so never for a tokenizer loaded without truncation or padding. 4
threads encoding beside 2 decoding for 8 s: 26,129 encodes, no error.
"""
from __future__ import annotations

import asyncio
from typing import Callable, TypeVar

from pydantic import BaseModel

from xlaserve.http.request_fields import parse_body

T = TypeVar("T")

LARGE_BODY_BYTES = 1 << 20  # parse_body of a 1 MB chat body: 1.4 ms
LARGE_PROMPT_CHARS = 4096  # tokenizing 4 K characters: 1.6 ms (0.4 us a character)
LARGE_RESPONSE_ENTRIES = 256  # logprob entries (token + alternatives): ~10 us each to build and render


async def run(size: int, large: int, work: Callable[..., T], *args) -> T:
    """`work(*args)` in a worker thread when `size` reaches `large`, else here."""
    if size < large:
        return work(*args)
    return await asyncio.to_thread(work, *args)


async def parse(body: bytes, model: type[BaseModel], fields=None):
    """`request_fields.parse_body`, off the loop for a large body; `fields`: the unknown-field
    policy (request_fields.RequestFields; None refuses unknown fields)."""
    return await run(len(body), LARGE_BODY_BYTES, parse_body, body, model, fields)
