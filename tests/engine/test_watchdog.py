"""--watchdog-timeout (SGLang's flag): an engine loop stuck in one step for longer than the
timeout turns the engine unhealthy with the reason, and a waiting request fails instead of
hanging; an idle engine, or one whose steps are quick, stays healthy."""
import threading
import time

import pytest

from tests.engine.test_engine import GREEDY, PROMPTS, SMALL
from tests.tiny_models import make_tiny_checkpoint
from xlaserve.offline import Engine
from xlaserve.runtime.engine.async_requests import EngineDeadError


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("llama"))
    make_tiny_checkpoint(directory, "llama")
    return directory


@pytest.mark.timeout(120)
def test_an_idle_engine_and_quick_steps_stay_within_the_timeout(checkpoint):
    with Engine(checkpoint, max_total_tokens=512, watchdog_timeout=1, **SMALL) as engine:
        time.sleep(2.5)  # idle: the loop still beats every 0.5 s
        outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert all(len(o["output_ids"]) == GREEDY["max_new_tokens"] for o in outputs)
        assert engine.core.failure is None and engine.core.is_alive()


@pytest.mark.timeout(120)
def test_a_step_stuck_past_the_timeout_fails_the_waiting_request_with_the_reason(checkpoint):
    with Engine(checkpoint, max_total_tokens=512, watchdog_timeout=1, **SMALL) as engine:
        runner = engine.core.runner
        real_run, release = runner.run, threading.Event()

        def stuck_run(*args, **kwargs):  # a device (or a peer) that stops answering
            release.wait(30)
            return real_run(*args, **kwargs)

        runner.run = stuck_run
        started = time.monotonic()
        try:
            with pytest.raises(EngineDeadError, match=r"stuck in one step .*--watchdog-timeout 1\)"):
                engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
            assert time.monotonic() - started < 10
            assert not engine.core.is_alive() and "--watchdog-timeout 1" in engine.core.failure
            with pytest.raises(RuntimeError, match="stuck in one step"):  # no new work either
                engine.generate(input_ids=PROMPTS[1], sampling_params=GREEDY)
        finally:
            release.set()
