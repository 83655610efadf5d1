"""The L1 and L2 allocators and the pages between owners (drains, lent L2 pages); never a node."""
from __future__ import annotations

import numpy as np

from decode_worker.cache.pool import OutOfPages, PageAllocator, PageIds
from decode_worker.cache.stats import TierPages


class Allocation:
    """Both tiers' allocators and the pages in transit."""

    def __init__(self, device_pages: int, host_pages: int | None):
        self.device = PageAllocator(device_pages, reserved=1)  # page 0: scratch (padding writes go there)
        self.host = PageAllocator(host_pages) if host_pages is not None else None
        self.draining = 0  # L1 pages copies in flight free when done
        self.host_out = 0  # L2 pages lent by ``lend_host``, not yet attached to the tree or returned

    # -- L1 ---------------------------------------------------------------------------------------------------------

    def device_short(self, n: int) -> int:
        """Pages to evict before taking ``n`` (drains count as free)."""
        return n - self.device.num_free - self.draining

    def take_device(self, n: int, locked: int) -> np.ndarray:
        """``n`` L1 pages, or OutOfPages saying where they are."""
        if self.device.num_free < n:
            raise OutOfPages(f"need {n} L1 pages: {self.device.num_free} free, {self.draining} still being backed "
                             f"up to L2, {locked} locked")
        return self.device.alloc(n)

    def drain_later(self, pages: np.ndarray) -> None:
        """``pages`` are freed when a copy lands (``drained``)."""
        self.draining += len(pages)

    def drained(self, pages: np.ndarray) -> None:
        self.device.free(pages)
        self.draining -= len(pages)

    # -- L2 ---------------------------------------------------------------------------------------------------------

    def host_short(self, n: int) -> int:
        return n - self.host.num_free

    def take_host(self, n: int) -> np.ndarray | None:
        return self.host.alloc(n) if self.host.num_free >= n else None

    def lend_host(self, pages: np.ndarray) -> None:
        """``pages`` go to a prefetch, in neither the tree nor the free stack."""
        self.host_out += len(pages)

    def return_host(self, pages: PageIds) -> None:
        self.host.free(pages)
        self.host_out -= len(pages)

    def attach_host(self, n: int) -> None:
        self.host_out -= n

    # -- what the cache reports -------------------------------------------------------------------------------------

    def device_pages(self, in_tree: int, locked: int) -> TierPages:
        dev = self.device
        return TierPages(total=dev.total, free=dev.num_free, used=dev.num_used - in_tree,
                         evictable=in_tree - locked, locked=locked)

    def host_pages(self, locked: int, evictable: int) -> TierPages | None:
        """None without L2."""
        h = self.host
        if h is None:
            return None
        return TierPages(total=h.total, free=h.num_free, used=h.num_used - locked - evictable,
                         evictable=evictable, locked=locked)
