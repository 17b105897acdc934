"""--enable-return-hidden-states: SGLang's `return_hidden_states`, the last layer's hidden states
of a request's prompt and of each token it generates, after the final norm (what SGLang's
logits processor captures and transformers' last `hidden_states` is).

SGLang's shape, one entry per output token (`meta_info["hidden_states"]`, async_requests.py):
- with the first output token, the prompt's rows, [prompt tokens][hidden]: the last of them is
  the row whose logits chose that token;
- with each later token, the row of the token before it (the row whose logits chose it),
  [hidden].
So the entries cover prompt + output[:-1], as transformers' forward over those tokens does. A
request that asks computes its whole prompt (no prefix reuse, as prompt logprobs: a cached
prefix's rows are not in any step's output), and a prompt run in chunks gathers its rows over
their steps (`PromptRows`, by position, so a retracted request's recomputed prompt changes
nothing).

Start-up (startup.py) builds `HiddenStates` with the flag, and the ModelRunner's programs then
return every token row's hidden state (step_program.StepOutput.hidden), which `read` copies to
the host only in a step where a request that asked has a row; without the flag, its do-nothing
form (steps.NoHiddenStates, in a file every request runs through already) refuses a request that
asks, in SGLang's words, and reads nothing. The bound: at most
--max-hidden-state-values values per request (`rows_for`), and per response (`check_rows`,
which the HTTP layer calls).
"""
from __future__ import annotations

import numpy as np

# SGLang's refusal, word for word (its tokenizer manager's).
NOT_ENABLED = ("The server is not configured to return the hidden states. Please set "
               "`--enable-return-hidden-states` to enable this feature.")


class HiddenStatesRefused(ValueError):
    """A request's hidden states this server does not return: the flag is off, or they would be
    more values than --max-hidden-state-values. The HTTP layer answers a 400."""


class PromptRows:
    """One request's prompt rows [prompt tokens, hidden], filled by position as its chunks run;
    whole once the chunk that samples its first token has run, and never written after."""

    def __init__(self, prompt_len: int, hidden_size: int):
        self.rows = np.zeros((prompt_len, hidden_size), np.float32)
        self.filled = 0  # rows in, from position 0 (a prompt's chunks run in order)

    def take(self, num_cached: int, rows: np.ndarray, samples: bool) -> np.ndarray | None:
        """Takes the rows of a chunk that starts at position `num_cached`; returns the entry of
        the token it samples (`samples`), else None: the prompt's rows where the chunk ends the
        prompt, else the chunk's last row."""
        prompt_len = len(self.rows)
        if self.filled < prompt_len and num_cached < prompt_len:
            end = min(prompt_len, num_cached + len(rows))
            self.rows[num_cached:end] = rows[:end - num_cached]
            self.filled = max(self.filled, end)
        if not samples:
            return None
        if num_cached + len(rows) == prompt_len:
            return self.rows
        return rows[-1].copy()  # not a view: the step's array is let go


class HiddenStates:
    """The feature, on: each request that asks gets its `PromptRows`, and each step's rows go to
    them (`read`)."""

    def __init__(self, hidden_size: int, max_values: int):
        self.hidden_size = hidden_size
        self.max_values = max_values

    def check_rows(self, rows: int) -> None:
        """HiddenStatesRefused where `rows` token rows (a response's, all its entries) are more
        values than the bound."""
        if rows * self.hidden_size > self.max_values:
            raise HiddenStatesRefused(
                f"the hidden states asked for would be {rows * self.hidden_size} values ({rows} "
                f"tokens x the hidden size {self.hidden_size}); at most {self.max_values} "
                "(--max-hidden-state-values)")

    def rows_for(self, prompt_len: int, max_new_tokens: int, asked: bool) -> PromptRows | None:
        """A request's PromptRows where it asks (None where it does not); one whose rows (a
        row per token but its last) would be over the bound is refused."""
        if not asked:
            return None
        self.check_rows(prompt_len + max(max_new_tokens, 1) - 1)
        return PromptRows(prompt_len, self.hidden_size)

    def read(self, batch, out, collecting: list[tuple[int, PromptRows]]) -> dict | None:
        """The entries of a step's sampled tokens for the requests that asked, by sample row
        (without speculation, row i is `batch.requests[i]`); `collecting` (row, PromptRows) of
        each running request that asked. None when none has a row: the step's hidden states
        stay on the device."""
        if not collecting:
            return None
        hidden = np.asarray(out.hidden)
        if batch.decode is not None:  # a row per request, one token each
            starts = range(len(batch.requests) + 1)
        else:
            starts = np.cumsum([0] + [len(c.token_ids) for c in batch.chunks]).tolist()
        entries = {}
        for i, rows in collecting:
            chunk = batch.chunks[i]
            entry = rows.take(chunk.num_cached, hidden[starts[i]:starts[i + 1]], chunk.sample)
            if entry is not None:
                entries[i] = entry
        return entries
