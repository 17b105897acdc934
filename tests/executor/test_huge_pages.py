"""Huge-page advice for the weights: whole 2 MiB pages inside each buffer, data untouched."""
import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.runtime.host import huge_pages
from xlaserve.runtime.host.huge_pages import HUGE_PAGE, advise_huge_pages, aligned_inside


def test_only_whole_huge_pages_inside_the_buffer_are_advised():
    assert aligned_inside(HUGE_PAGE, 3 * HUGE_PAGE) == (HUGE_PAGE, 4 * HUGE_PAGE)
    assert aligned_inside(HUGE_PAGE + 8, 3 * HUGE_PAGE) == (2 * HUGE_PAGE, 4 * HUGE_PAGE)
    assert aligned_inside(HUGE_PAGE + 8, HUGE_PAGE) == (2 * HUGE_PAGE, 2 * HUGE_PAGE)  # none


def test_advice_leaves_the_weights_unchanged_and_skips_what_it_cannot_advise():
    if not huge_pages._thp_allowed():
        pytest.skip("transparent huge pages are off on this machine")
    values = np.random.default_rng(0).standard_normal(3 * HUGE_PAGE // 4).astype(np.float32)
    big, small = jnp.asarray(values), jnp.ones(1024)
    start, end = aligned_inside(big.unsafe_buffer_pointer(), big.nbytes)
    assert end - start >= HUGE_PAGE
    assert advise_huge_pages([big, small, values]) == end - start  # not the small or host one
    np.testing.assert_array_equal(np.asarray(big), values)
    np.testing.assert_array_equal(np.asarray(big * 2), values * 2)


def test_nothing_is_advised_where_huge_pages_are_off(monkeypatch):
    monkeypatch.setattr(huge_pages, "_thp_allowed", lambda: False)
    assert advise_huge_pages([jnp.ones(3 * HUGE_PAGE // 4)]) == 0
