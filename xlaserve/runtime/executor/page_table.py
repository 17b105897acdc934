"""The page table on the device, by slot, written with each step's changes.

Every running request holds a slot (`Request.slot`, 1..max_running_requests; slot 0 is the null
slot of padding rows). Row s of the device table `i32[slots, width]` holds the pages of the
request in slot s, then NULL_PAGE; row 0 is NULL_PAGE throughout and is never written. A step
gathers its sequences' rows by their slots (`gather_rows`), so what crosses from the host each
step is what changed: a few (position, page) writes (`PageWrites`), which ride in the step's int32
vector and are scattered into the table before the gather (`apply_writes`).

The host table this replaces was [padded seqs, pages per seq]: 262 KB a 256-row step at a 4K
context (256 pages of 16), 8 MB at Llama-3.1-8B's 128K (8192 pages), packed and sent every step:
0.72 ms of the engine thread's 1.42 ms a 256-row decode step at 128K
(benchmarks/bench_host_step.py --context-length 131072), and an 8 MB host-to-device copy a step on
a GPU. A decode step writes about one page in page_size rows.

`PageTableRows` is the host's record of what each device row holds, the lists it was written
from. A step's writes are the differences between its rows' page lists and that record
(`writes`); `commit` records them once the step is dispatched (ModelRunner.run), so a step
staged and never run leaves the record as the device is. Page lists are held by reference and
must not be changed after they are given (the scheduler gives each step copies; a decode
continuation shares the lists of rows that did not change, which `writes` skips by identity).
`DevicePageTable` holds the device array, the record and the program that takes writes past a
step's room (ModelRunner.page_table).
"""
from __future__ import annotations

import dataclasses
import itertools
import operator

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.runtime.executor.forward_batch import write_rows
from xlaserve.runtime.scheduler.page_allocator import NULL_PAGE

# Writes one call of the overflow program (`write_program`) takes: a step's writes past its own
# capacity (an admission of long cached prefixes, say) go through it first, in as many calls.
OVERFLOW_WRITES = 8192


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PageWrites:
    """Writes into the flattened table: `pages[i]` at `positions[i]` (slot * width + column).
    Unused entries hold positions past the table (distinct, as the scatter's unique_indices
    promises), which it drops."""

    positions: np.ndarray  # i32[capacity]
    pages: np.ndarray  # i32[capacity]


def write_capacity(tokens: int, seqs: int, page_size: int) -> int:
    """The writes a step of this bucket carries in its own vector: two a row (a decode row's new
    page, and one the prefix cache swapped), twice a prompt chunk's pages, and 16 more; more go
    through the overflow program (an admission from a long cached prefix). Kept small because
    the int vector is: a CPU step's call took 28 us of host time with 1.6 KB of int32 inputs and
    46 us with 2 KB (XLA's CPU client copies a small argument inline, a larger one on a thread),
    and 1024 entries made the 1-row decode step's 8 KB."""
    return 2 * seqs + 2 * -(-tokens // page_size) + 16


def empty_writes(capacity: int, table_size: int) -> PageWrites:
    """`capacity` unused entries for a table of `table_size` entries."""
    return PageWrites(np.arange(table_size, table_size + capacity, dtype=np.int32),
                      np.zeros(capacity, np.int32))


class PageTableRows:
    """What each row of the device page table holds (the engine thread's, in ModelRunner)."""

    def __init__(self, num_slots: int, width: int):
        self.num_slots, self.width = num_slots, width
        self.size = num_slots * width  # a write position past the table: dropped
        self._rows: list[list[int]] = [[] for _ in range(num_slots)]

    def writes(self, slots, page_ids: list[list[int]]) -> tuple[list[int], list[int], list]:
        """(positions, pages, updates) that make rows `slots[i]` hold `page_ids[i]` then
        NULL_PAGE: for each row, the columns from its first difference with the record to the
        end of the longer list. `updates` is what `commit` records."""
        n_rows = len(page_ids)
        if n_rows == 0:
            return [], [], []
        slots = np.asarray(slots)[:n_rows]
        if len(slots) < n_rows:
            raise ValueError(f"{n_rows} sequences with pages but {len(slots)} slots")
        counts = np.bincount(slots, minlength=self.num_slots)  # raises on a negative slot
        if counts[0] or len(counts) > self.num_slots or counts.max() > 1:
            raise ValueError(f"slots {slots.tolist()}: the null slot, one out of range or one "
                             "twice")
        slots = slots.tolist()
        positions: list[int] = []
        pages: list[int] = []
        rows, width = self._rows, self.width
        # Found in C, in two passes: the rows whose list is not the recorded one (a decode
        # continuation shares the lists of rows that got no page with the last step), then of
        # those the ones whose pages differ (a mixed step's chunks hold copies, mostly equal).
        # A loop over the rows cost 13 us a 256-row decode step, this 6.
        olds = operator.itemgetter(*slots)(rows) if n_rows > 1 else (rows[slots[0]],)
        others = list(itertools.compress(range(n_rows), map(operator.is_not, olds, page_ids)))
        updates = [(slots[i], page_ids[i]) for i in others]
        if len(updates) and max(map(len, (new for _, new in updates))) > width:
            raise ValueError(f"a sequence of more pages than the page table's {width}")
        differing = itertools.compress(others, map(operator.ne, map(olds.__getitem__, others),
                                                   map(page_ids.__getitem__, others)))
        for i in differing:
            slot, old, new = slots[i], olds[i], page_ids[i]
            n_old, n = len(old), len(new)
            first = n_old if n >= n_old and new[:n_old] == old else _first_difference(old, new)
            base = slot * width
            positions.extend(range(base + first, base + max(n, n_old)))
            pages.extend(new[first:])
            pages.extend([NULL_PAGE] * (n_old - max(n, first)))
        return positions, pages, updates

    def commit(self, updates) -> None:
        for slot, new in updates:
            self._rows[slot] = new

    def table(self) -> np.ndarray:
        """The whole table as the record says the device holds it (tests)."""
        table = np.full((self.num_slots, self.width), NULL_PAGE, np.int32)
        write_rows(table, self._rows)
        return table


def _first_difference(old: list[int], new: list[int]) -> int:
    n = min(len(old), len(new))
    if n == 0:
        return 0
    differ = np.flatnonzero(np.asarray(old[:n]) != np.asarray(new[:n]))
    return int(differ[0]) if differ.size else n


def apply_writes(table: jax.Array, writes: PageWrites) -> jax.Array:
    """`table` with `writes` scattered in (inside the jitted step, or the overflow program)."""
    flat = table.reshape(-1).at[writes.positions].set(writes.pages, mode="drop",
                                                      unique_indices=True)
    return flat.reshape(table.shape)


def gather_rows(table: jax.Array, slots: jax.Array, pages: int) -> jax.Array:
    """i32[len(slots), pages]: the rows of `slots`, cut or padded (NULL_PAGE) to `pages`."""
    rows = table[slots, :min(pages, table.shape[1])]
    if pages > table.shape[1]:
        rows = jnp.pad(rows, ((0, 0), (0, pages - table.shape[1])), constant_values=NULL_PAGE)
    return rows


class DevicePageTable:
    """The page table on the device (`array`, donated to each step and replaced by its output),
    the host's record of it (`rows`) and the overflow program (`write`): ModelRunner's."""

    def __init__(self, num_slots: int, width: int, page_size: int, put, sharding):
        self.rows = PageTableRows(num_slots, width)
        self.page_size = page_size
        self._put, self._sharding = put, sharding
        self.array = put(np.full((num_slots, width), NULL_PAGE, np.int32), sharding)
        # The overflow program: `apply_writes` with the table donated, its sharding kept.
        self._program = jax.jit(apply_writes, donate_argnums=0, out_shardings=sharding)
        self._compiled = None

    def idle_writes(self, tokens: int, seqs: int) -> PageWrites:
        """An idle step's writes (all unused), for a bucket of `tokens` and `seqs`."""
        return self._filled([], [], write_capacity(tokens, seqs, self.page_size))

    def step_writes(self, slots, page_ids: list[list[int]], tokens: int, seqs: int):
        """(the step's PageWrites, the updates to commit once it runs, the (positions, pages)
        that do not fit its room, or None): `write` sends those before the step."""
        positions, pages, updates = self.rows.writes(slots, page_ids)
        capacity = write_capacity(tokens, seqs, self.page_size)
        if len(positions) > capacity:  # rare: an admission from a long cached prefix
            return (self._filled([], [], capacity), updates,
                    (np.array(positions, np.int32), np.array(pages, np.int32)))
        return self._filled(positions, pages, capacity), updates, None

    def write(self, positions: np.ndarray, pages: np.ndarray) -> None:
        """Writes into the flattened table, `OVERFLOW_WRITES` a call of the overflow program."""
        program = self._compiled or self._program
        for start in range(0, len(positions), OVERFLOW_WRITES):
            part = slice(start, start + OVERFLOW_WRITES)
            writes = self._filled(positions[part], pages[part], OVERFLOW_WRITES)
            self.array = program(self.array, self._put(writes, self._sharding))

    def compile(self) -> None:
        """The overflow program, compiled before serving."""
        self._compiled = self._program.lower(
            self.array, self._put(self._filled([], [], OVERFLOW_WRITES), self._sharding)).compile()

    def _filled(self, positions, pages, capacity: int) -> PageWrites:
        writes = empty_writes(capacity, self.rows.size)
        writes.positions[:len(positions)] = positions
        writes.pages[:len(pages)] = pages
        return writes
