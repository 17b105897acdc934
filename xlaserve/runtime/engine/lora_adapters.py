"""LoRA adapters by name while serving (issue 53): which device slot each holds, loads and
unloads, and the name a request asks for. The device slots are
runtime/executor/lora_slots.py; reading an adapter's files, weights/lora_adapter.py.

Threads. Names are resolved in the submitting thread (`EngineCore.submit`) and loads read their
files there too; the slot writes and the end of an unload run on the engine loop, between steps,
as inbox messages. One lock orders a request's resolve and its put in the inbox with an
unload's mark: a request that resolved an adapter is in the inbox ahead of the unload, so the
loop sees it among the adapter's requests; one submitted after the mark is refused.

Unloading waits: the adapter is marked (new requests naming it are refused at once), and the loop
frees its slot, zeroes it and drops its prefix-cache tree once no waiting or running request
uses it (`between_steps`, every loop turn). A load takes a free slot (--max-loras-per-batch of
them) and refuses when none is free.
"""
from __future__ import annotations

import itertools
import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass

from xlaserve.server_args import lora_paths_of
from xlaserve.model.lora import LoraSpec, check_model
from xlaserve.runtime.engine.messages import OnLoop
from xlaserve.runtime.executor.lora_slots import slots_for
from xlaserve.runtime.scheduler.request import AdapterRef
from xlaserve.weights.lora_adapter import LoraAdapter, LoraAdapterError, load_adapter

logger = logging.getLogger(__name__)
NO_ADAPTERS = "this server serves no LoRA adapters (start it with --enable-lora)"


def lora_setup(args, config) -> tuple[LoraSpec, list[LoraAdapter]]:
    """The slots' shapes (lora_slots.slots_for) and the adapters of --lora-paths, read."""
    adapters = [load_adapter(name, path, config)
                for name, path in lora_paths_of(args.lora_paths).items()]
    spec = slots_for(args, adapters)
    check_model(config, spec)
    logger.info("LoRA: %d slots of rank %d on %s; %d adapters at start", spec.max_loras,
                spec.max_rank, ", ".join(spec.target_modules), len(adapters))
    return spec, adapters


class UnknownAdapter(ValueError):
    """A request names an adapter that is not loaded (or is being unloaded)."""

    def __init__(self, name: str, why: str):
        super().__init__(why)
        self.name = name


@dataclass
class LoadedAdapter:
    name: str
    path: str
    slot: int  # its device slot; requests carry slot + 1
    key: int  # its prefix-cache namespace, unique per load
    unloading: bool = False


@dataclass
class LoadLora:
    """Inbox: write `adapter` into `slot` and serve it under `name`."""

    name: str
    adapter: LoraAdapter
    slot: int
    done: Future


@dataclass
class UnloadLora:
    """Inbox: free `name`'s slot once no request uses it."""

    name: str
    done: Future


class LoraAdapters:
    def __init__(self, runner, scheduler, max_loras: int, model_config, wait):
        """`wait(message)`: puts an inbox message and returns its `done` future's result
        (EngineCore._wait): a load's slot write and an unload run on the loop (`take`)."""
        self.runner = runner
        self.scheduler = scheduler
        self.model_config = model_config
        self._wait = wait
        self.lock = threading.Lock()
        self.loaded: dict[str, LoadedAdapter] = {}
        self._free_slots = list(range(max_loras - 1, -1, -1))  # popped from the end: 0 first
        self._loading: set[str] = set()
        self._keys = itertools.count(1)
        self._unloads: list[UnloadLora] = []  # waiting for their requests (loop thread)

    def install(self, adapter: LoraAdapter) -> LoadedAdapter:
        """An adapter read at start-up, written into its slot before the loop runs."""
        adapter, slot = self._claim(adapter.name, lambda: adapter)
        done: Future = Future()
        self.take(LoadLora(adapter.name, adapter, slot, done))
        return done.result()

    # --- any thread ------------------------------------------------------------------------

    @staticmethod
    def serving(adapters: "LoraAdapters | None") -> "LoraAdapters":
        """`adapters`, or the refusal of a server without them."""
        if adapters is None:
            raise LoraAdapterError(NO_ADAPTERS)
        return adapters

    @staticmethod
    def submit(adapters: "LoraAdapters | None", name: str, request, put) -> None:
        """Sets `request`'s adapter `name` and `put`s it in the inbox under the lock, ahead of
        any unload of it (module docstring); UnknownAdapter where it is not loaded."""
        if adapters is None:
            raise UnknownAdapter(name, f"lora_path {name!r}: {NO_ADAPTERS}")
        with adapters.lock:
            adapter = adapters.resolve(name)
            request.adapter = AdapterRef(adapter.slot + 1, adapter.key)
            put()

    def load(self, name: str, path: str) -> LoadedAdapter:
        """Reads a PEFT adapter and serves it as `name` once the loop has written its slot
        between two steps; LoraAdapterError naming what cannot load."""
        adapter, slot = self._claim(name, lambda: load_adapter(name, path, self.model_config))
        return self._on_loop(LoadLora(name, adapter, slot, Future()))

    def unload(self, name: str) -> LoadedAdapter:
        """Refuses new requests for `name` at once; returns once its waiting and running
        requests have ended and its slot is free."""
        self.mark_unloading(name)
        return self._on_loop(UnloadLora(name, Future()))

    def _on_loop(self, message: "LoadLora | UnloadLora"):
        """`take`s the message on the engine loop, between steps; returns its result."""
        return self._wait(OnLoop(lambda: self.take(message), message.done))

    def resolve(self, name: str) -> LoadedAdapter:
        """The adapter a request names (call with `lock` held, and put the request in the inbox
        before releasing it)."""
        adapter = self.loaded.get(name)
        if adapter is None:
            raise UnknownAdapter(name, f"LoRA adapter {name!r} is not loaded (loaded: "
                                       f"{', '.join(sorted(self.loaded)) or 'none'})")
        if adapter.unloading:
            raise UnknownAdapter(name, f"LoRA adapter {name!r} is being unloaded")
        return adapter

    def _claim(self, name: str, make) -> tuple[LoraAdapter, int]:
        """Reserves `name`, makes its adapter (`make()`: read from its files, or given) and takes
        it a free slot: (adapter, slot). Raises LoraAdapterError for a name in use, no free slot
        or an adapter the slots cannot hold."""
        with self.lock:
            if name in self.loaded or name in self._loading:
                raise LoraAdapterError(f"a LoRA adapter named {name!r} is already loaded")
            if not self._free_slots:
                raise LoraAdapterError(
                    f"every LoRA slot is taken ({len(self.loaded)} adapters, "
                    f"--max-loras-per-batch): unload one first")
            self._loading.add(name)
        try:
            adapter = make()
            self.runner.lora.check(adapter)
        except BaseException:
            with self.lock:
                self._loading.discard(name)
            raise
        with self.lock:
            return adapter, self._free_slots.pop()

    def mark_unloading(self, name: str) -> None:
        with self.lock:
            adapter = self.loaded.get(name)
            if adapter is None or adapter.unloading:
                raise UnknownAdapter(name, f"LoRA adapter {name!r} is not loaded")
            adapter.unloading = True

    def cards(self) -> list[LoadedAdapter]:
        with self.lock:
            return [a for a in self.loaded.values() if not a.unloading]

    # --- the engine loop -------------------------------------------------------------------

    def before_stage(self, batch) -> None:
        """The step hook (steps.py): the adapters of the requests the step admits."""
        if batch.admitted:
            self.runner.lora.assign([r.slot for r in batch.admitted],
                                    [r.adapter.slot for r in batch.admitted])

    def take(self, message: "LoadLora | UnloadLora") -> None:
        """A LoadLora or UnloadLora, on the loop."""
        if isinstance(message, LoadLora):
            try:
                self.runner.lora.write(message.slot, message.adapter)
            except Exception as error:
                with self.lock:
                    self._loading.discard(message.name)
                    self._free_slots.append(message.slot)
                message.done.set_exception(error)
                return
            adapter = message.adapter
            with self.lock:
                self._loading.discard(message.name)
                self.loaded[message.name] = LoadedAdapter(
                    message.name, adapter.path, message.slot, next(self._keys))
            logger.info("LoRA adapter %s loaded: slot %d, rank %d, %s (%.1f MB)", message.name,
                        message.slot, adapter.rank, ", ".join(adapter.target_modules),
                        adapter.nbytes / 2**20)
            message.done.set_result(self.loaded[message.name])
        else:
            self._unloads.append(message)
            self.between_steps()

    def between_steps(self) -> None:
        """The hook the loop calls each turn (steps.py): frees the slots of adapters being
        unloaded that no request uses any more."""
        if not self._unloads:
            return
        scheduler = self.scheduler
        busy = {r.adapter.key for r in (*scheduler.waiting, *scheduler.running)}
        pending = []
        for message in self._unloads:
            adapter = self.loaded[message.name]
            if adapter.key in busy:
                pending.append(message)
                continue
            try:
                self.runner.lora.write(adapter.slot, None)
                freed = scheduler.cache.drop_namespace(adapter.key)
            except Exception as error:
                message.done.set_exception(error)
                continue
            with self.lock:
                del self.loaded[message.name]
                self._free_slots.append(adapter.slot)
            logger.info("LoRA adapter %s unloaded: slot %d free, %d cached pages freed",
                        message.name, adapter.slot, freed)
            message.done.set_result(adapter)
        self._unloads = pending
