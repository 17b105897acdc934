"""The device page table by slot (runtime/executor/page_table.py): the host's record, the writes a step
carries, the overflow program, and a step staged but never run."""
import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.runtime.executor.page_table import (PageTableRows, PageWrites, apply_writes, empty_writes,
                                         gather_rows)
from xlaserve.runtime.scheduler.page_allocator import NULL_PAGE


def _applied(table: np.ndarray, positions, pages) -> np.ndarray:
    writes = empty_writes(max(len(positions), 1) + 3, table.size)
    writes.positions[:len(positions)] = positions
    writes.pages[:len(pages)] = pages
    return np.asarray(apply_writes(jnp.asarray(table), PageWrites(*map(jnp.asarray, (
        writes.positions, writes.pages)))))


def test_random_steps_of_growth_swaps_and_reused_slots_write_exactly_the_rows_lists():
    rng = np.random.default_rng(0)
    rows = PageTableRows(num_slots=6, width=12)
    device = np.full((6, 12), NULL_PAGE, np.int32)
    lists: dict[int, list[int]] = {}
    for _ in range(300):
        step = rng.choice(np.arange(1, 6), size=rng.integers(1, 6), replace=False)
        page_ids = []
        for slot in step.tolist():
            pages = list(lists.get(slot, []))
            kind = rng.integers(5)
            if kind == 0:  # a new request in the slot
                pages = rng.integers(1, 99, rng.integers(0, 13)).tolist()
            elif kind == 1 and len(pages) < 12:  # a new page
                pages.append(int(rng.integers(1, 99)))
            elif kind == 2 and pages:  # a page swapped for a cached one
                pages[int(rng.integers(len(pages)))] = int(rng.integers(1, 99))
            elif kind == 3:  # unchanged, the same list object (a decode continuation's)
                pages = lists.get(slot, [])
            lists[slot] = pages
            page_ids.append(pages)
        positions, values, updates = rows.writes(step, page_ids)
        assert len(set(positions)) == len(positions)
        device = _applied(device, positions, values)
        rows.commit(updates)
        for slot, pages in lists.items():
            np.testing.assert_array_equal(device[slot, :len(pages)], pages)
            assert (device[slot, len(pages):] == NULL_PAGE).all()
        assert (device[0] == NULL_PAGE).all()
        np.testing.assert_array_equal(rows.table(), device)


def test_a_decode_step_writes_only_the_new_pages():
    rows = PageTableRows(num_slots=4, width=8)
    a, b = [3, 4], [5]
    rows.commit(rows.writes([1, 2], [a, b])[2])
    positions, pages, _ = rows.writes([1, 2], [a, b + [9]])  # b got a page; a is the same list
    assert (positions, pages) == ([2 * 8 + 1], [9])
    positions, pages, _ = rows.writes([2], [[7]])  # a shorter list: the rest back to NULL
    assert (positions, pages) == ([16], [7])


def test_the_null_slot_a_repeated_slot_and_a_list_over_the_width_are_refused():
    rows = PageTableRows(num_slots=4, width=2)
    with pytest.raises(ValueError, match="the null slot"):
        rows.writes([0], [[1]])
    with pytest.raises(ValueError, match="one twice"):
        rows.writes([1, 1], [[1], [2]])
    with pytest.raises(ValueError, match="the page table.s 2"):
        rows.writes([1], [[1, 2, 3]])


def test_rows_are_gathered_by_slot_cut_or_padded_to_the_bucket_width():
    table = jnp.arange(12, dtype=jnp.int32).reshape(3, 4)
    np.testing.assert_array_equal(gather_rows(table, jnp.array([2, 0]), 2), [[8, 9], [0, 1]])
    np.testing.assert_array_equal(gather_rows(table, jnp.array([1]), 6),
                                  [[4, 5, 6, 7, NULL_PAGE, NULL_PAGE]])
