"""Per-request sampling parameters with SGLang's names, and their range checks."""
from __future__ import annotations

import dataclasses

from xlaserve.runtime.model_runner import MAX_LOGIT_BIAS, MAX_SUPPRESSED_IDS


@dataclasses.dataclass
class SamplingParams:
    """Per-request sampling parameters, with SGLang's names."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = dataclasses.field(default_factory=dict)
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_new_tokens: int = 0
    seed: int | None = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False

    def validate(self, vocab_size: int) -> None:
        checks = [
            # 0 (prompt only, for prompt logprobs) needs echo/prompt logprobs: not served yet.
            (self.max_new_tokens >= 1, "max_new_tokens must be >= 1"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k == -1 or self.top_k >= 1, "top_k must be -1 (off) or >= 1"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (0 < self.repetition_penalty <= 2, "repetition_penalty must be in (0, 2]"),
            (0 <= self.min_new_tokens, "min_new_tokens must be >= 0"),
            (len(self.logit_bias) <= MAX_LOGIT_BIAS,
             f"logit_bias takes at most {MAX_LOGIT_BIAS} entries"),
            (len(self.stop_token_ids or ()) <= MAX_SUPPRESSED_IDS,
             f"stop_token_ids takes at most {MAX_SUPPRESSED_IDS} ids"),
            (all(0 <= int(t) < vocab_size for t in self.logit_bias),
             f"logit_bias token ids must be in [0, {vocab_size})"),
            (all(0 <= t < vocab_size for t in self.stop_token_ids or ()),
             f"stop_token_ids must be in [0, {vocab_size})"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
