"""The KV pages' free list (`PageAllocator`): page ids 1..num_pages-1 of the device pool (page 0,
`NULL_PAGE`, is never handed out: padding rows of page tables point at it, so a padded slot can
never alias a live request's data), and the host tier's pages the same way (host_tier.py)."""
from __future__ import annotations


NULL_PAGE = 0


class OutOfPagesError(RuntimeError):
    pass


class PageAllocator:
    """A free list of page ids 1..num_pages-1 (page 0 is the null page)."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError("the KV cache needs at least 2 pages (one is the null page)")
        self.num_pages = num_pages
        # Popped from the end: low ids first, which keeps a lightly used pool compact.
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))
        self._in_use: set[int] = set()

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._in_use)

    def usage(self) -> float:
        return self.num_used / self.capacity

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        self._in_use.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for page in pages:
            if page not in self._in_use:
                raise ValueError(f"page {page} is not allocated (double free?)")
            self._in_use.remove(page)
            self._free.append(page)


def pages_for_tokens(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)
