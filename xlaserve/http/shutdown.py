"""Graceful shutdown: what SIGTERM and SIGINT do to `python -m xlaserve.launch_server`.

    signal    -> draining: new generations and /health answer 503 with Retry-After (the listener
                 stays open, so clients hear why); running requests and batch lines go on
    all ended, or --graceful-shutdown-timeout passed
              -> what still runs is aborted: a stream ends with an SSE error event and [DONE], a
                 waiting client gets a 503, a batch line is not written (it runs again when its
                 batch resumes at the next start)
              -> uvicorn's own shutdown: the listener closes, responses still being written get
                 RESPONSE_GRACE_S, then the lifespan stops the batch runner and the engine
              -> exit status 0

A second signal ends the drain at once; a third skips the waits after it too (uvicorn's force
exit: no lifespan shutdown). Every wait is bounded, and a watchdog thread backs them all: a
process still alive HARD_MARGIN_S after the drain's timeout (an engine step that never returns,
so the engine thread cannot be joined) is ended with status 1, logged.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time

import uvicorn
from uvicorn.config import STARTUP_FAILURE

from xlaserve.http.errors import SHUTDOWN_MESSAGE
from xlaserve.http.serving import ServingContext

logger = logging.getLogger(__name__)

POLL_S = 0.1
# After the abort: time for the error events and 503 bodies to be written (uvicorn's
# timeout_graceful_shutdown; a client that does not read is cut off then).
RESPONSE_GRACE_S = 5
# After the drain's timeout: the response grace, the batch runner's stop, the engine thread's
# last step; past it the process ends whatever still runs.
HARD_MARGIN_S = 20.0


def serve(app, ctx: ServingContext, batch_runner, args) -> int:
    """Runs `app` with uvicorn until a signal and the drain it starts; -> the exit status."""
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_keep_alive=5, timeout_graceful_shutdown=RESPONSE_GRACE_S)
    server = GracefulServer(config, ctx, batch_runner, args.graceful_shutdown_timeout)
    try:
        server.run()
    except KeyboardInterrupt:  # SIGINT before uvicorn took over the signals
        pass
    return 0 if server.started else STARTUP_FAILURE


class GracefulServer(uvicorn.Server):
    """uvicorn's server, draining the app (see the module docstring) before it shuts down."""

    def __init__(self, config: uvicorn.Config, ctx: ServingContext, batch_runner, timeout: float):
        super().__init__(config)
        self.ctx = ctx
        self.batch_runner = batch_runner  # None: an app without files and batches
        self.timeout = timeout
        self.signals = 0

    def handle_exit(self, sig: int, frame) -> None:
        # A signal handler: flags only (logging or a new thread could wait on a lock the
        # interrupted code holds). uvicorn's own handler is not called: it re-raises the signal
        # once shut down, and the exit status would read "killed by SIGTERM".
        self.signals += 1
        self.ctx.draining = True
        self.should_exit = True
        self.force_exit = self.signals >= 3

    async def main_loop(self) -> None:
        await super().main_loop()  # returns once should_exit is set
        if self.ctx.draining:
            await self._drain()

    async def _drain(self) -> None:
        _exit_if_alive_after(self.timeout + HARD_MARGIN_S)
        requests, lines = self._in_flight()
        logger.info("Shutting down: %d requests and %d batch lines may finish within %.0f s "
                    "(--graceful-shutdown-timeout); new requests get 503", requests, lines,
                    self.timeout)
        deadline = time.monotonic() + self.timeout
        while any(self._in_flight()) and time.monotonic() < deadline and self.signals < 2:
            await asyncio.sleep(POLL_S)
        requests, lines = self._in_flight()
        if requests or lines:
            logger.warning("Graceful shutdown: aborting %d requests and %d batch lines still "
                           "running", requests, lines)
            self.ctx.core.abort_all(SHUTDOWN_MESSAGE)
        else:
            logger.info("Graceful shutdown: every request has finished")

    def _in_flight(self) -> tuple[int, int]:
        """(HTTP requests being answered, batch lines running)."""
        lines = self.batch_runner.lines_in_flight() if self.batch_runner is not None else 0
        return len(self.server_state.tasks), lines


def _exit_if_alive_after(seconds: float) -> None:
    def exit_now():
        logger.error("Shutdown: still running %.0f s after the signal (a stuck engine step or "
                     "thread); exiting now", seconds)
        os._exit(1)

    timer = threading.Timer(seconds, exit_now)
    timer.daemon = True  # never what keeps the process alive
    timer.start()
