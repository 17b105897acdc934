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
    # Structured outputs (runtime/grammar.py), at most one: a JSON schema as a JSON string, a
    # regular expression, an EBNF grammar in GBNF syntax (`root ::= "red" | "green"`), or a
    # structural tag (JSON: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

    def validate(self, vocab_size: int, names: dict[str, str] | None = None) -> None:
        """Raises InvalidSamplingParam for the first value out of range; `names` renames fields in
        the message and `param` (the HTTP layer says max_tokens for max_new_tokens)."""
        checks = [
            ("max_new_tokens", self.max_new_tokens >= 1, "{} must be >= 1"),
            ("temperature", self.temperature >= 0, "{} must be >= 0"),
            ("top_p", 0 < self.top_p <= 1, "{} must be in (0, 1]"),
            ("top_k", self.top_k == -1 or self.top_k >= 1, "{} must be -1 (off) or >= 1"),
            ("min_p", 0 <= self.min_p <= 1, "{} must be in [0, 1]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "{} must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "{} must be in [-2, 2]"),
            ("repetition_penalty", 0 < self.repetition_penalty <= 2, "{} must be in (0, 2]"),
            ("min_new_tokens", 0 <= self.min_new_tokens, "{} must be >= 0"),
            ("logit_bias", len(self.logit_bias) <= MAX_LOGIT_BIAS,
             f"{{}} takes at most {MAX_LOGIT_BIAS} entries"),
            ("stop_token_ids", len(self.stop_token_ids or ()) <= MAX_SUPPRESSED_IDS,
             f"{{}} takes at most {MAX_SUPPRESSED_IDS} ids"),
            ("logit_bias", all(0 <= int(t) < vocab_size for t in self.logit_bias),
             f"{{}} token ids must be in [0, {vocab_size})"),
            ("stop_token_ids", all(0 <= t < vocab_size for t in self.stop_token_ids or ()),
             f"{{}} must be in [0, {vocab_size})"),
        ]
        for field, ok, message in checks:
            if not ok:
                name = (names or {}).get(field, field)
                raise InvalidSamplingParam(name, message.format(name))


class InvalidSamplingParam(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
