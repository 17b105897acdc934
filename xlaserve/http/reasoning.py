"""Reasoning parsers (`--reasoning-parser`): split a model's thinking from its answer.

Models like Qwen3 and DeepSeek-R1 write their reasoning between `<think>` and `</think>`. With
`separate_reasoning` (the default) the reasoning goes to `reasoning_content` and the rest to
`content`. The parsers differ in where reasoning starts:
- `qwen3`: only where the output opens a `<think>` block (with `enable_thinking: false` the
  template closes the block in the prompt, and everything is content);
- `deepseek-r1`, `qwen3-thinking`: from the first token, because their templates put `<think>`
  in the prompt; everything up to `</think>` is reasoning, all of it if the tag never comes.
Streaming text arrives in arbitrary pieces, so a piece that may be the start of a tag is held
back until the next piece decides it.
"""
from __future__ import annotations

THINK_START, THINK_END = "<think>", "</think>"

# name -> does the reasoning start at the first token (the template opened the block)?
PARSERS = {"qwen3": False, "qwen3-thinking": True, "deepseek-r1": True}


def _held_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningParser:
    def __init__(self, name: str, *, thinking_in_prompt: bool = False):
        if name not in PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}; choose one of {sorted(PARSERS)}")
        # Reasoning from the first token: the parser says so, or the prompt left `<think>` open.
        self.forced = PARSERS[name] or thinking_in_prompt
        self.state = "start"  # -> "reasoning" -> "content", or "start" -> "content"
        self.had_reasoning = False
        self._buffer = ""
        self._skip_newlines = False  # right after a tag: the newlines that set it apart


    def feed(self, text: str) -> tuple[str, str]:
        """A new piece of output -> (reasoning delta, content delta)."""
        self._buffer += text
        reasoning, content = [], []
        while self._buffer:
            if self._skip_newlines:
                self._buffer = self._buffer.lstrip("\n")
                if not self._buffer:
                    break
                self._skip_newlines = False
            if self.state == "start":
                stripped = self._buffer.lstrip()
                if stripped.startswith(THINK_START):  # the model opens the block itself
                    self._buffer = stripped[len(THINK_START):]
                    self.state, self._skip_newlines = "reasoning", True
                elif THINK_START.startswith(stripped):
                    break  # only whitespace or a partial `<think>` so far
                else:
                    self.state = "reasoning" if self.forced else "content"
                self.had_reasoning = self.state == "reasoning"
            elif self.state == "reasoning":
                at = self._buffer.find(THINK_END)
                if at != -1:
                    reasoning.append(self._buffer[:at])
                    self._buffer = self._buffer[at + len(THINK_END):]
                    self.state, self._skip_newlines = "content", True
                    continue
                keep = _held_suffix(self._buffer, THINK_END)
                reasoning.append(self._buffer[:len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            else:
                content.append(self._buffer)
                self._buffer = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The output ended: whatever was held back goes where it was heading."""
        rest, self._buffer = self._buffer, ""
        if self.state == "reasoning" or (self.state == "start" and self.forced and rest.strip()):
            self.had_reasoning = True
            return rest, ""
        return "", rest

    def parse(self, text: str) -> tuple[str | None, str]:
        """The whole output at once -> (reasoning, or None if there was none; content)."""
        reasoning, content = self.feed(text)
        more_reasoning, more_content = self.finish()
        reasoning = (reasoning + more_reasoning).strip()
        return (reasoning if self.had_reasoning else None), content + more_content
