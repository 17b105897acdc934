"""Logprobs in OpenAI's two shapes.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`.
Completions: `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`,
where echoed prompt tokens come first and the very first one has no logprob (None).
A token's text is its own decoding, as vLLM gives it; a token that is part of a multi-byte
character decodes to U+FFFD, and `bytes` are those of the decoded text.
"""
from __future__ import annotations

from typing import Sequence


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer, token_ids: Sequence[int], logprobs: Sequence[float],
                  top: Sequence[Sequence[tuple[float, int]]], num_top: int) -> dict:
    content = []
    for token_id, logprob, alternatives in zip(token_ids, logprobs, top, strict=True):
        entry = _entry(token_text(tokenizer, token_id), logprob)
        entry["top_logprobs"] = [_entry(token_text(tokenizer, t), lp) for lp, t in alternatives[:num_top]]
        content.append(entry)
    return {"content": content}


class CompletionLogprobs:
    """Accumulates the completions shape; `text_offset` counts characters from the choice's text
    start (echoed prompt included)."""

    def __init__(self, tokenizer, num_top: int, offset: int = 0):
        self.tokenizer = tokenizer
        self.num_top = num_top
        self.offset = offset

    def build(self, token_ids: Sequence[int], logprobs: Sequence[float | None],
              top: Sequence[Sequence[tuple[float, int]] | None]) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, logprob, alternatives in zip(token_ids, logprobs, top, strict=True):
            text = token_text(self.tokenizer, token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(logprob)
            out["text_offset"].append(self.offset)
            if alternatives is None:
                out["top_logprobs"].append(None)
            else:
                # Tokens that decode alike collide in the dict; the most likely one is kept.
                alt = {}
                for lp, t in alternatives[:self.num_top]:
                    alt.setdefault(token_text(self.tokenizer, t), lp)
                out["top_logprobs"].append(alt)
            self.offset += len(text)
        return out
