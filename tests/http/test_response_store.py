"""ResponseStore's background responses with stand-in calls (no model), so the moments a cancel
or a failure lands are exact: every background response ends with a final record."""
import asyncio
import types

from xlaserve.http.batches.storage import Storage
from xlaserve.http.responses.store import ResponseStore


class FakeCall:
    """What the store uses of a ResponseCall; `generate` is the chat response's coroutine."""

    def __init__(self, generate):
        self.id = f"resp_{id(self)}"
        self.req = types.SimpleNamespace(store=True)
        self.input = []
        self.aborted = False
        self.started = False
        group = types.SimpleNamespace(abort=self._abort)

        async def response():
            self.started = True
            return await generate()

        self.chat = types.SimpleNamespace(response=response,
                                          generation=types.SimpleNamespace(group=group))

    def _abort(self):
        self.aborted = True

    def object(self, status, error=None):
        return {"id": self.id, "object": "response", "status": status, "background": True,
                "error": error, "output": []}

    def finished(self, chat_body):
        return {**self.object("completed"), "output": [chat_body]}


def run(tmp_path, scenario):
    async def main():
        store = ResponseStore(Storage(str(tmp_path)))
        return await scenario(store), store
    return asyncio.run(main())


async def forever():
    await asyncio.Event().wait()


def test_a_response_cancelled_before_its_task_ran_is_cancelled_without_generating(tmp_path):
    async def scenario(store):
        call = FakeCall(forever)
        await store.start_background(call)
        cancelled = await store.cancel(call.id)  # the task has not taken a step yet
        return call, cancelled

    (call, cancelled), store = run(tmp_path, scenario)
    assert cancelled["status"] == "cancelled" and call.aborted and not call.started
    assert store.storage.response(call.id)["status"] == "cancelled" and not store._running


def test_a_cancel_the_generation_swallows_still_ends_cancelled(tmp_path):
    """The generation returns instead of raising (as asyncio.wait_for did on Python 3.11)."""
    async def swallows():
        try:
            await forever()
        except asyncio.CancelledError:
            return {"text": "half"}

    async def scenario(store):
        call = FakeCall(swallows)
        await store.start_background(call)
        await asyncio.sleep(0.01)
        return await store.cancel(call.id)

    cancelled, store = run(tmp_path, scenario)
    assert cancelled["status"] == "cancelled" and cancelled["output"] == []


def test_a_generation_that_raises_unexpectedly_ends_failed_not_in_progress(tmp_path):
    async def breaks():
        raise TypeError("a bug")

    async def scenario(store):
        call = FakeCall(breaks)
        await store.start_background(call)
        while store._running:
            await asyncio.sleep(0.01)
        return store.storage.response(call.id)

    record, store = run(tmp_path, scenario)
    assert record["status"] == "failed" and record["error"]["code"] == "server_error"


def test_a_cancel_after_the_generation_finished_leaves_the_finished_record(tmp_path):
    """A cancel that lands while the completed record is being saved does not undo it."""
    async def quick():
        return {"text": "done"}

    async def scenario(store):
        saving, release = asyncio.Event(), asyncio.Event()
        save = store.save

        async def slow_save(call, response):
            if response["status"] != "in_progress":
                saving.set()
                await release.wait()
            await save(call, response)

        store.save = slow_save
        call = FakeCall(quick)
        await store.start_background(call)
        await saving.wait()
        cancel = asyncio.ensure_future(store.cancel(call.id))
        await asyncio.sleep(0.01)
        release.set()
        return await cancel

    answer, store = run(tmp_path, scenario)
    assert answer["status"] == "completed" and answer["output"] == [{"text": "done"}]


def test_stopping_the_server_fails_the_running_ones(tmp_path):
    async def scenario(store):
        call = FakeCall(forever)
        await store.start_background(call)
        await asyncio.sleep(0.01)
        await store.stop()
        return store.storage.response(call.id)

    record, _ = run(tmp_path, scenario)
    assert record["status"] == "failed" and "stopped" in record["error"]["message"]
