"""Which LoRA adapter each device slot holds, on the engine loop, and the scheduler's admission
gate of a LoRA server (issue 73): more adapters are loaded (in host memory, --max-loaded-loras)
than there are slots (--max-loras-per-batch), and an adapter is written into a slot when a
request needs it (SGLang's LRU policy). The adapters by name and their host copies are
lora_adapters.py's; the slots on the device, runtime/executor/lora_slots.py.

A request carries its adapter's key from submission (`AdapterRef`); its slot is bound at
admission. `Scheduler.schedule_prefills` asks `admits(request, running)` of each waiting request
it would start, in queue order:
- an adapter in a slot: yes (the slot's last use noted, for the LRU choice);
- one in no slot: a slot whose adapter no running request uses is taken for it, an empty one
  first, else the least recently used: the slot is marked to be written (`take_writes`: the
  LoRA hook writes it before the next step is staged) and the request admitted;
- when every slot's adapter has running requests, the least recently used slot is reserved for
  the waiting adapter (`_wanted`): no new request of the slot's adapter starts, its running ones
  end, and then the waiting adapter takes the slot (or another that empties first). The request
  stays waiting meanwhile, in its place in the queue; requests behind it whose adapters are in
  slots start. So no request waits forever: a reserved slot empties within its requests'
  lengths, and a stream of requests for the adapters in the slots cannot keep it out.

A slot written is never in use: no running request has its adapter. A step dispatched earlier
that still runs reads the slot before the write (the device runs them in order), and its rows
of that adapter are requests that have ended (an abort, a stop string), whose tokens are dropped.

Loop thread only: no lock. Pure bookkeeping (no JAX), like the scheduler that calls it.
"""
from __future__ import annotations

import itertools


class AdapterSlots:
    def __init__(self, num_slots: int):
        self.keys = [0] * num_slots  # each slot's adapter (its key; 0: empty)
        self.slot_of: dict[int, int] = {}  # adapter key -> its slot
        self._used = [0] * num_slots  # each slot's last admission (a tick): the LRU choice
        self._ticks = itertools.count(1)
        self._wanted: dict[int, int] = {}  # slot -> the waiting adapter it is emptied for
        self._writes: dict[int, int] = {}  # slot -> the adapter to write into it before a step
        self._busy: set[int] | None = None  # running requests' adapters this turn (a superset)
        # Adapters refused this turn: refused again at once (a long queue of them costs a set
        # lookup each). A refusal holds for the turn: admissions only make more slots busy.
        self._refused: set[int] = set()
        self.swaps = 0  # adapters written into a slot for a waiting request

    # --- the scheduler's gate ------------------------------------------------------------------

    def admits(self, request, running) -> bool:
        """Whether `request` may start now: its adapter is in a slot, or is given one (module
        docstring). `running`: the scheduler's running requests."""
        key = request.adapter.key
        if not key:  # the base model
            return True
        if key in self._refused:
            return False
        slot = self.slot_of.get(key)
        if slot is not None:
            if slot in self._wanted:  # emptied for a waiting adapter: none of its requests start
                self._refused.add(key)
                return False
            self._used[slot] = next(self._ticks)
            return True
        busy = self._busy_keys(running)
        reserved = next((s for s, k in self._wanted.items() if k == key), None)
        open_slots = [s for s in range(len(self.keys)) if s not in self._wanted or s == reserved]
        if not open_slots:  # every slot is reserved for another waiting adapter
            self._refused.add(key)
            return False
        # Empty first, then free of running requests, then the least recently used.
        slot = min(open_slots, key=lambda s: (self.keys[s] != 0, self.keys[s] in busy,
                                              self._used[s]))
        if self.keys[slot] in busy:  # none is free: the reserved one empties for it
            self._wanted[slot if reserved is None else reserved] = key
            self._refused.add(key)
            return False
        if reserved is not None:  # another slot emptied first
            del self._wanted[reserved]
        self._move(key, slot)
        self.swaps += 1
        busy.add(key)
        self._used[slot] = next(self._ticks)
        return True

    def _busy_keys(self, running) -> set[int]:
        """The running requests' adapters, computed once a loop turn and grown by each
        admission: never less than the adapters running requests use."""
        if self._busy is None:
            self._busy = {r.adapter.key for r in running}
        return self._busy

    def _move(self, key: int, slot: int) -> None:
        """`key` into `slot` (its adapter out of it), written before the next step."""
        self.slot_of.pop(self.keys[slot], None)
        self.keys[slot] = key
        self.slot_of[key] = slot
        self._wanted.pop(slot, None)
        self._writes[slot] = key

    # --- the LoRA hook (lora_adapters.py) ------------------------------------------------------

    def new_turn(self, waiting) -> None:
        """Each loop turn: the running requests' adapters are counted again when needed, refused
        adapters are asked again, and a reservation for an adapter no waiting request uses any
        more (aborted) is dropped."""
        self._busy = None
        self._refused.clear()
        if self._wanted:
            waiting_keys = {r.adapter.key for r in waiting}
            self._wanted = {s: k for s, k in self._wanted.items() if k in waiting_keys}

    def place(self, key: int) -> int | None:
        """An adapter just loaded: the first empty slot that no waiting adapter is promised,
        now (the caller writes it); None where there is none (it waits in host memory)."""
        for slot, held in enumerate(self.keys):
            if not held and slot not in self._wanted:
                self.keys[slot] = key
                self.slot_of[key] = slot
                return slot
        return None

    def release(self, key: int) -> int | None:
        """An adapter unloaded: its slot, now empty (the caller zeroes it), or None."""
        slot = self.slot_of.pop(key, None)
        if slot is not None:
            self.keys[slot] = 0
            self._used[slot] = 0
            self._writes.pop(slot, None)
        return slot

    def take_writes(self) -> list[tuple[int, int]]:
        """(slot, adapter key) of the slots to write before the next step is staged."""
        writes, self._writes = list(self._writes.items()), {}
        return writes

    def device_ids(self, keys: list[int]) -> list[int]:
        """Each admitted request's adapter as the step reads it: its slot + 1 (0: none)."""
        return [self.slot_of[k] + 1 if k else 0 for k in keys]
