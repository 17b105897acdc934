"""Incremental detokenization with stop strings.

Tokens arrive one at a time; text leaves in pieces that are safe to show:
- never half a UTF-8 character: byte-level BPE splits one character over several tokens, and the
  tokenizer decodes the partial bytes as U+FFFD, so a piece ending in U+FFFD waits for the next
  token;
- never the start of what may become a stop string: text that could be the beginning of a stop
  string is held back until it either completes the stop (and is trimmed) or cannot any more.
Decoding uses a sliding window (`prefix_offset`, `read_offset`), the technique of Hugging Face's
text-generation-inference and vLLM: decoding a few tokens of left context keeps the spaces that
SentencePiece-style tokenizers attach to word starts, without re-decoding the whole output.
"""
from __future__ import annotations

from typing import Sequence

# Tokens of context decoded in front of the new ones (enough for any tokenizer's merges).
_CONTEXT_TOKENS = 5


def _fast_decode(tokenizer):
    """The Rust `tokenizers` decode when it gives what `tokenizer.decode` gives (a fast tokenizer
    without the WordPiece space clean-up): the Python wrapper around it costs 4x the decode, and
    the engine decodes twice per token of every running request."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return tokenizer.decode
    return backend.decode


class IncrementalDetokenizer:
    def __init__(self, tokenizer, *, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True,
                 stop_strings: Sequence[str] = (), no_stop_trim: bool = False):
        self.skip_special_tokens = skip_special_tokens
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.no_stop_trim = no_stop_trim
        # The prompt's last tokens are context only: the first output word keeps its leading space.
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # the output text so far (trimmed at a stop string once one matched)
        self.emitted = 0  # characters of `text` already handed out
        self.matched_stop: str | None = None
        self._decode_ids = _fast_decode(tokenizer)

    def _decode(self, ids) -> str:
        return self._decode_ids(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, token_id: int) -> str:
        """Adds one token; returns the text that can be emitted now (possibly empty)."""
        if self.matched_stop is not None:
            return ""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self._check_stop_strings()
        return self._take(final=False)

    def finish(self) -> str:
        """The request ended (length, stop token, abort): release whatever was held back,
        including bytes of a character the output never completed."""
        if self.matched_stop is None and self.read_offset < len(self.ids):
            prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
            self.text += self._decode(self.ids[self.prefix_offset:])[len(prefix_text):]
            self.read_offset = len(self.ids)
            self._check_stop_strings()
        return self._take(final=True)

    def _check_stop_strings(self) -> None:
        if not self.stop_strings:
            return
        # Only a stop string that ends in the newly added text can be new.
        longest = max(len(s) for s in self.stop_strings)
        search_from = max(0, self.emitted - longest)
        best = None
        for stop in self.stop_strings:
            at = self.text.find(stop, search_from)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is not None:
            at, stop = best
            self.matched_stop = stop
            self.text = self.text[:at + len(stop)] if self.no_stop_trim else self.text[:at]

    def _take(self, final: bool) -> str:
        end = len(self.text)
        if not final and self.matched_stop is None:
            end -= self._partial_stop_suffix()
        piece = self.text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return piece

    def _partial_stop_suffix(self) -> int:
        """Length of the longest end of `text` that is a proper prefix of some stop string."""
        held = 0
        for stop in self.stop_strings:
            for n in range(min(len(stop) - 1, len(self.text)), held, -1):
                if self.text.endswith(stop[:n]):
                    held = n
                    break
        return held
