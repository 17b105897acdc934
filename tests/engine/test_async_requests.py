"""AsyncRequestGroup: the event loop's side of the engine's chunks, with a stand-in core (no
model) so the interleavings are exact."""
import asyncio

import pytest

from xlaserve.runtime.engine import async_requests
from xlaserve.runtime.engine.async_requests import AsyncRequestGroup, EngineDeadError
from xlaserve.runtime.engine.messages import Finish, OutputDelta


class FakeCore:
    def __init__(self):
        self.emits, self.aborted, self.alive = {}, [], True

    def submit(self, prompt_ids, params, emit, **options):
        rid = f"r{len(self.emits)}"
        self.emits[rid] = emit
        return rid

    def abort(self, rid, message=None):
        self.aborted.append(rid)

    def is_alive(self):
        return self.alive

    def stopped_reason(self):
        return "the engine loop stopped: test"


def chunk(text: str, finished: bool = False) -> OutputDelta:
    finish = Finish("r", "stop", None, 1, 1, 0) if finished else None
    return OutputDelta(text=text, token_id=1, finished=finished, finish=finish)


async def read_all(group: AsyncRequestGroup) -> list:
    return [(index, c.text) async for index, c in group.outputs()]


def test_chunks_of_several_requests_come_out_tagged_until_each_has_finished():
    async def main():
        core = FakeCore()
        group = AsyncRequestGroup(core)
        group.submit(0, [1], None)
        group.submit(1, [1], None)
        reader = asyncio.ensure_future(read_all(group))
        await asyncio.sleep(0)
        core.emits["r0"](chunk("a"))
        core.emits["r1"](chunk("b", finished=True))
        core.emits["r0"](chunk("c", finished=True))
        return await reader

    assert asyncio.run(main()) == [(0, "a"), (1, "b"), (0, "c")]


def test_a_reader_cancelled_as_a_chunk_arrives_is_cancelled_not_handed_the_chunk():
    """asyncio.wait_for on Python 3.11 returned the chunk here and the cancelled reader ran on
    with aborted, unfinished requests: a cancelled background response stayed in_progress."""
    async def main():
        core = FakeCore()
        group = AsyncRequestGroup(core)
        group.submit(0, [1], None)
        reader = asyncio.ensure_future(read_all(group))
        await asyncio.sleep(0.01)  # waiting on the queue
        group._queue.put_nowait((0, chunk("a")))  # the chunk and the cancel in one loop turn
        reader.cancel()
        group.abort()
        with pytest.raises(asyncio.CancelledError):
            await reader
        return core

    assert asyncio.run(main()).aborted == ["r0"]


def test_a_reader_waiting_on_a_dead_engine_gets_its_reason(monkeypatch):
    monkeypatch.setattr(async_requests, "LIVENESS_POLL_S", 0.01)

    async def main():
        core = FakeCore()
        group = AsyncRequestGroup(core)
        group.submit(0, [1], None)
        core.emits["r0"](chunk("a"))
        reader = asyncio.ensure_future(read_all(group))
        await asyncio.sleep(0.05)  # a few liveness polls with nothing new: still waiting
        assert not reader.done()
        core.alive = False
        with pytest.raises(EngineDeadError, match="test"):
            await reader

    asyncio.run(main())
