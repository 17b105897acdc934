"""What one request may ask (runtime/sampling/params.RequestLimits takes these fields by name;
a request over one is refused with a 400 naming the field), the seed it gets by default, and
--log-level, which --help lists after them."""
from __future__ import annotations

import dataclasses
from typing import Optional

from xlaserve.server_args.flag import flag


@dataclasses.dataclass
class RequestFlags:
    """Each request's limits and defaults."""

    max_n: int = flag(128, "most choices (n) per prompt of one request")
    max_sequences_per_request: int = flag(
        256, "most sequences one request generates: prompts x n (completions and /generate take "
             "lists of prompts)")
    max_stop_sequences: int = flag(16, "most stop strings per request (OpenAI allows 4)")
    max_stop_sequence_length: int = flag(256, "longest stop string, in characters")
    max_constraint_size: int = flag(
        256 * 1024, "longest JSON schema, regex or EBNF grammar (structured outputs, and each "
                    "tool's parameters schema), in characters")
    grammar_compile_timeout: float = flag(
        10.0, "seconds a request's grammar (structured outputs, strict tools) may take to compile "
              "before the request is refused with a 400")
    max_tools: int = flag(128, "most tools per chat request (OpenAI's limit)")
    max_prompt_logprob_entries: int = flag(
        1 << 20, "most prompt logprob entries one request may ask for (completions' echo with "
                 "logprobs, /generate's logprob_start_len 0): prompt tokens x (1 + top "
                 "logprobs), summed over its sequences")
    max_queued_requests: int = flag(
        4096, "most requests waiting for a running slot, all clients together; beyond it a "
              "request is refused with 503 and Retry-After (never an unbounded queue)")
    enable_priority_scheduling: bool = flag(
        False, "honour a request's `priority` (larger runs first); without it a request that "
               "sets one is refused with a 400")
    strict_request_fields: bool = flag(
        False, "refuse a request with a field this server does not know (a 400 naming it). "
               "Default: such fields are ignored, as OpenAI-compatible servers do; each distinct "
               "name is logged once as a warning, and the answer lists the request's ignored "
               "fields in its X-Ignored-Fields header")
    random_seed: Optional[int] = flag(
        None, "seed for requests that do not give one, and of --load-format dummy's weights (0 if unset)")
    log_level: str = flag("info", "logging level", choices=["debug", "info", "warning", "error"])

    def check_request_limits(self) -> None:
        if self.max_tools < 0:
            raise ValueError(f"--max-tools must be 0 or more; got {self.max_tools}")
