"""The scheduler's log lines, in SGLang's words (`StepLog`)."""
from __future__ import annotations

import logging
import time

from xlaserve.runtime.scheduler.request import SeqChunk

logger = logging.getLogger("xlaserve.runtime.scheduler.scheduler")  # the lines' usual logger


class StepLog:
    """The scheduler's log lines, in SGLang's words (operators and their dashboards read them):
    `Prefill batch.` for every step that runs prompt tokens, and `Decode batch.` once every
    `interval` decode steps, with the generation throughput over those steps (and, with
    speculative decoding, SGLang's `accept len`: tokens a verified row kept on average)."""

    def __init__(self, interval: int):
        self.interval = interval
        self.prefix = ""  # "[DP1] " for a data parallel replica's lines
        self._decode_steps = self._decode_tokens = 0
        self._interval_start = 0.0
        self._verified_rows = self._accepted_drafts = 0

    def verified(self, accepted_drafts: int) -> None:
        """A verified row's result: its accepted drafts are tokens of the interval too."""
        self._verified_rows += 1
        self._accepted_drafts += accepted_drafts
        self._decode_tokens += accepted_drafts

    def step(self, scheduler, kind: str, num_decodes: int,
             prefill_chunks: list[SeqChunk], cached_tokens: int) -> None:
        if prefill_chunks:
            logger.info(
                "%sPrefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: "
                "%.2f, #running-req: %d, #queue-req: %d", self.prefix, len(prefill_chunks),
                sum(len(c.token_ids) for c in prefill_chunks), cached_tokens,
                scheduler.token_usage(), num_decodes, scheduler.num_waiting)
        if kind != "decode":
            return
        # Throughput over the interval: tokens of steps 2..N over the time from step 1 to step N.
        now = time.monotonic()
        if self._decode_steps == 0:
            self._interval_start = now
        else:
            self._decode_tokens += num_decodes
        self._decode_steps += 1
        if self._decode_steps >= self.interval:
            elapsed = now - self._interval_start
            throughput = self._decode_tokens / elapsed if elapsed > 0 else 0.0
            accept = (f"accept len: {1 + self._accepted_drafts / self._verified_rows:.2f}, "
                      if self._verified_rows else "")
            logger.info(
                "%sDecode batch. #running-req: %d, #token: %d, token usage: %.2f, %s"
                "gen throughput (token/s): %.2f, #queue-req: %d", self.prefix,
                scheduler.num_running, sum(r.num_computed for r in scheduler.running),
                scheduler.token_usage(), accept, throughput, scheduler.num_waiting)
            self._decode_steps = self._decode_tokens = 0
            self._verified_rows = self._accepted_drafts = 0
