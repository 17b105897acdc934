"""SGLang's --watchdog-timeout: an engine loop stuck in one iteration for longer than the timeout
is declared hung, so the server answers 503 instead of leaving every request waiting forever.

The engine loop sets `last_beat` (time.monotonic()) once per iteration, a plain attribute write;
an idle loop still does every 0.5 s (it waits on its inbox that long at most). An iteration blocks for long only where something below it hangs: a
device that never finishes a step, a collective waiting for a process that stopped (a
multi-host follower that is alive but stuck, SIGSTOPped or swapping: the leader's step channel
then fills and its send blocks too), or a compile far longer than any precompiled program
takes. The watchdog calls `on_hang` once, from its own thread; the engine sets its `failure`,
which /health and the readers of running requests see within their 1 s liveness poll.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

logger = logging.getLogger(__name__)


class Watchdog:
    def __init__(self, timeout_s: float, on_hang: Callable[[str], None], name: str):
        self.timeout_s = timeout_s
        self._on_hang = on_hang
        self.last_beat = time.monotonic()  # the engine loop's, once per iteration
        self._stopped = threading.Event()
        if timeout_s > 0:
            threading.Thread(target=self._watch, name=name, daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        period = min(self.timeout_s / 4, 5.0)
        while not self._stopped.wait(period):
            stuck_s = time.monotonic() - self.last_beat
            if stuck_s > self.timeout_s:
                reason = (f"the engine loop has been stuck in one step for {stuck_s:.0f} s "
                          f"(--watchdog-timeout {self.timeout_s:g}): a hung device, or a "
                          "multi-host peer that stopped responding")
                logger.error("Watchdog: %s; the server answers 503 from now on", reason)
                self._on_hang(reason)
                return
