"""A prompt text provably longer than the context, refused without tokenizing it.

Tokenizing is the slow part of a huge request: 30 MB of text took 30 s (2-core CPU, the default
model's byte-level BPE), all to answer `context_length_exceeded`. But one token stands for at
most `chars_per_token(tokenizer)` characters of the text, so a text longer than
`max_request_tokens * chars_per_token` characters has more tokens than any request may hold.

The bound follows the `tokenizers` pipeline, and is None (no early refusal) wherever a stage
could make a token stand for unboundedly many characters:
- added tokens cover their own text, unless `lstrip`/`rstrip` let them swallow any whitespace;
- the normalizer may shrink the text by at most a factor: NFC/NFKC compose at most
  `_most_composed()` code points into one, a string `Replace` by its pattern's length over its
  content's; Strip, StripAccents, BERT's, SentencePiece's precompiled map, regex replaces can
  delete text, so they give no bound;
- the pre-tokenizer must keep every character (no `Removed` splits, no whitespace splitting);
  ByteLevel maps a character to 1-4 characters, so the text only grows;
- the model is BPE: each token is a vocabulary string (or one unknown character, or one byte
  of byte fallback) covering at most as many characters as the string has; unknown characters
  fused into one token (`fuse_unk`) give no bound, nor do WordPiece, Unigram and WordLevel, where
  an unknown word is one token;
- the post-processor only adds tokens, and truncation (which would cap the count) must be off.
"""
from __future__ import annotations

import functools
import json
import math
import sys
import unicodedata

from xlaserve.http.errors import bad_request
from xlaserve.http.serving import LARGE_PROMPT_CHARS, ServingContext

_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}


def check_not_too_long(ctx: ServingContext, text: str, param: str) -> None:
    """The `context_length_exceeded` 400 for a text that must have more tokens than a request
    may hold; a text that may fit passes (tokenizing it decides)."""
    if len(text) < LARGE_PROMPT_CHARS:  # cheap to tokenize, on the loop: the bound's first
        return                          # computation waits for a text tokenized off it
    limit = ctx.core.max_request_tokens
    per_token = chars_per_token(ctx.tokenizer)
    if per_token is not None and len(text) > limit * per_token:
        where = "context length" if limit == ctx.context_length else "KV cache capacity"
        raise bad_request(f"The input ({len(text)} characters, so more than {limit} tokens) is "
                          f"longer than the model's {where} ({limit} tokens).", param,
                          code="context_length_exceeded")


@functools.cache
def chars_per_token(tokenizer) -> int | None:
    """The most characters of text one token can stand for, or None if no bound can be proved."""
    backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast (Rust) tokenizer
    if backend is None or backend.truncation is not None:
        return None
    spec = json.loads(backend.to_str())  # 63 ms for the default model's, once
    shrink = _normalizer_shrink(spec.get("normalizer"))
    longest = _longest_model_token(spec.get("model") or {})
    if shrink is None or longest is None or not _keeps_every_char(spec.get("pre_tokenizer")):
        return None
    added = spec.get("added_tokens") or []
    if any(token.get("lstrip") or token.get("rstrip") for token in added):
        return None
    longest = max([longest, *(len(token["content"]) for token in added)])
    return math.ceil(shrink * longest)


def _normalizer_shrink(spec: dict | None) -> float | None:
    """How many times shorter (in characters) the normalizer can make a text, or None."""
    if spec is None:
        return 1
    kind = spec["type"]
    if kind in ("NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"):
        return 1  # decompositions and lowercasing are never empty; the others only add
    if kind in ("NFC", "NFKC"):
        return _most_composed()
    if kind == "Replace":
        pattern, content = spec["pattern"].get("String"), spec["content"]
        if pattern is None or not content:  # a regex (runs of any length) or a deletion
            return None
        return max(1, len(pattern) / len(content))
    if kind == "Sequence":
        total = 1
        for part in spec["normalizers"]:
            shrink = _normalizer_shrink(part)
            if shrink is None:
                return None
            total *= shrink
        return total
    return None


def _keeps_every_char(spec: dict | None) -> bool:
    if spec is None:
        return True
    if spec["type"] == "Sequence":
        return all(_keeps_every_char(part) for part in spec["pretokenizers"])
    return spec["type"] in _KEEPING_PRE_TOKENIZERS and spec.get("behavior") != "Removed"


def _longest_model_token(spec: dict) -> int | None:
    if spec.get("type") != "BPE" or (spec.get("fuse_unk") and spec.get("unk_token")):
        return None
    return max([1, *(len(token) for token in spec["vocab"])])


@functools.cache
def _most_composed() -> int:
    """Canonical composition turns a character's full decomposition back into it: 4 code points
    at most in Python's Unicode tables (Hangul LVT syllables take 3). 0.3 s, once."""
    return max(len(unicodedata.normalize("NFD", chr(c))) for c in range(sys.maxunicode + 1))
