"""LoRA adapters by name while serving (issue 53): loads and unloads, the name a request asks
for, and the adapters' host copies. Which slot each adapter holds and when it moves into one:
adapter_slots.py (issue 73: more adapters loaded than slots); the device slots,
runtime/executor/lora_slots.py; reading an adapter's files, weights/lora_adapter.py.

Threads. Names are resolved in the submitting thread (`EngineCore.submit`) and loads read their
files there too; the slot writes and the end of an unload run on the engine loop, between steps
(a load's and an unload's as inbox messages; an adapter moved into a slot, before the step that
needs it: `before_stage`). One lock orders a request's resolve and its put in the inbox with an
unload's mark: a request that resolved an adapter is in the inbox ahead of the unload, so the
loop sees it among the adapter's requests; one submitted after the mark is refused.

Unloading waits: the adapter is marked (new requests naming it are refused at once), and the loop
frees its slot (zeroed) or host copy and drops its prefix-cache tree once no waiting or running
request uses it (`between_steps`, every loop turn). A load is written into an empty slot
(--max-loras-per-batch of them), else kept in host memory until a request needs it; it is
refused once --max-loaded-loras adapters are loaded.
"""
from __future__ import annotations

import itertools
import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass

from xlaserve.server_args import lora_paths_of
from xlaserve.model.lora import LoraSpec, check_model
from xlaserve.runtime.engine.adapter_slots import AdapterSlots
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
    logger.info("LoRA: %d slots of rank %d on %s; %d adapters at start, %d at most "
                "(--max-loaded-loras)", spec.max_loras, spec.max_rank,
                ", ".join(spec.target_modules), len(adapters), args.max_loaded_loras)
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
    key: int  # what requests carry: its identity and prefix-cache namespace, unique per load
    weights: LoraAdapter  # its host copy, written into a slot when a request needs it
    unloading: bool = False


@dataclass
class LoadLora:
    """Inbox: serve `adapter` under `name` (written into an empty slot, if one is)."""

    name: str
    adapter: LoraAdapter
    done: Future


@dataclass
class UnloadLora:
    """Inbox: free `name`'s slot once no request uses it."""

    name: str
    done: Future


class LoraAdapters:
    def __init__(self, runner, scheduler, slots: AdapterSlots, max_loaded: int, model_config,
                 wait):
        """`slots`: the scheduler's admission gate too (`Scheduler.admission`). `max_loaded`:
        --max-loaded-loras. `wait(message)`: puts an inbox message and returns its `done`
        future's result (EngineCore._wait): a load's slot write and an unload run on the loop
        (`take`)."""
        self.runner = runner
        self.scheduler = scheduler
        self.slots = slots
        self.max_loaded = max_loaded
        self.model_config = model_config
        self._wait = wait
        self.lock = threading.Lock()
        self.loaded: dict[str, LoadedAdapter] = {}
        self._by_key: dict[int, LoadedAdapter] = {}  # the loop's
        self._loading: set[str] = set()
        self._keys = itertools.count(1)
        self._unloads: list[UnloadLora] = []  # waiting for their requests (loop thread)

    def install(self, adapter: LoraAdapter) -> LoadedAdapter:
        """An adapter read at start-up, written into an empty slot (if one is) before the loop
        runs."""
        adapter = self._claim(adapter.name, lambda: adapter)
        done: Future = Future()
        self.take(LoadLora(adapter.name, adapter, done))
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
            request.adapter = AdapterRef(adapter.key)
            put()

    def load(self, name: str, path: str) -> LoadedAdapter:
        """Reads a PEFT adapter and serves it as `name` once the loop has taken it between two
        steps (written into an empty slot, or kept in host memory); LoraAdapterError naming what
        cannot load."""
        adapter = self._claim(name, lambda: load_adapter(name, path, self.model_config))
        return self._on_loop(LoadLora(name, adapter, Future()))

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

    def _claim(self, name: str, make) -> LoraAdapter:
        """Reserves `name` and makes its adapter (`make()`: read from its files, or given).
        Raises LoraAdapterError for a name in use, --max-loaded-loras adapters loaded already or
        an adapter the slots cannot hold."""
        with self.lock:
            if name in self.loaded or name in self._loading:
                raise LoraAdapterError(f"a LoRA adapter named {name!r} is already loaded")
            if len(self.loaded) + len(self._loading) >= self.max_loaded:
                raise LoraAdapterError(
                    f"{self.max_loaded} LoRA adapters are loaded, --max-loaded-loras "
                    f"{self.max_loaded}: unload one first (or start with a larger "
                    "--max-loaded-loras)")
            self._loading.add(name)
        try:
            adapter = make()
            self.runner.lora.check(adapter)
            adapter = self.runner.lora.host_copy(adapter)
        except BaseException:
            with self.lock:
                self._loading.discard(name)
            raise
        return adapter

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
        """The step hook (steps.py): the adapters moved into slots for the requests admitted
        since the last step (adapter_slots.py), then the adapters of the requests this one
        admits."""
        for slot, key in self.slots.take_writes():
            adapter = self._by_key[key]
            try:
                self.runner.lora.write(slot, adapter.weights)
            except BaseException:
                self.slots.release(key)  # not in the slot: its requests wait for another write
                raise
            logger.debug("LoRA adapter %s written into slot %d", adapter.name, slot)
        if batch.admitted:
            self.runner.lora.assign([r.slot for r in batch.admitted], self.slots.device_ids(
                [r.adapter.key for r in batch.admitted]))

    def take(self, message: "LoadLora | UnloadLora") -> None:
        """A LoadLora or UnloadLora, on the loop."""
        if isinstance(message, LoadLora):
            adapter, key = message.adapter, next(self._keys)
            slot = self.slots.place(key)
            try:
                if slot is not None:
                    self.runner.lora.write(slot, adapter)
            except Exception as error:
                self.slots.release(key)
                with self.lock:
                    self._loading.discard(message.name)
                message.done.set_exception(error)
                return
            loaded = LoadedAdapter(message.name, adapter.path, key, adapter)
            self._by_key[key] = loaded
            with self.lock:
                self._loading.discard(message.name)
                self.loaded[message.name] = loaded
            logger.info("LoRA adapter %s loaded: %s, rank %d, %s (%.1f MB)", message.name,
                        "host memory (no slot empty)" if slot is None else f"slot {slot}",
                        adapter.rank, ", ".join(adapter.target_modules), adapter.nbytes / 2**20)
            message.done.set_result(loaded)
        else:
            self._unloads.append(message)
            self.between_steps()

    def between_steps(self) -> None:
        """The hook the loop calls each turn (steps.py): the slots' turn (adapter_slots.py);
        frees the slots and host copies of adapters being unloaded that no request uses any
        more."""
        scheduler = self.scheduler
        self.slots.new_turn(scheduler.waiting)
        if not self._unloads:
            return
        busy = {r.adapter.key for r in (*scheduler.waiting, *scheduler.running)}
        pending = []
        for message in self._unloads:
            adapter = self.loaded[message.name]
            if adapter.key in busy:
                pending.append(message)
                continue
            try:
                slot = self.slots.release(adapter.key)
                if slot is not None:
                    self.runner.lora.write(slot, None)
                freed = scheduler.cache.drop_namespace(adapter.key)
            except Exception as error:
                message.done.set_exception(error)
                continue
            del self._by_key[adapter.key]
            with self.lock:
                del self.loaded[message.name]
            logger.info("LoRA adapter %s unloaded: %s free, %d cached pages freed", message.name,
                        "host memory" if slot is None else f"slot {slot}", freed)
            message.done.set_result(adapter)
        self._unloads = pending
