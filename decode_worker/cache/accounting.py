"""The cache's figures, read from its parts without changing them."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from decode_worker.cache.allocation import Allocation
from decode_worker.cache.copies import CopiesInFlight
from decode_worker.cache.node import TreeNode
from decode_worker.cache.radix_tree import RadixTree
from decode_worker.cache.stats import CacheCounters, CacheStats
from decode_worker.cache.storage.tier import StorageTier


class CacheAccounting:
    """Sums over the tree, allocators and copies; holds the token counters."""

    def __init__(self, tree: RadixTree, pages: Allocation, copies: CopiesInFlight,
                 storage: StorageTier | None = None):
        self.tree = tree
        self.pages = pages
        self.copies = copies
        self.storage = storage
        self.counters = CacheCounters()

    def available_device_pages(self) -> int:
        """L1 pages an allocation could get now or by evicting (admission's budget)."""
        tree = self.tree
        return self.pages.device.num_free + self.pages.draining + tree.device_pages - tree.locked_device_pages

    def pages_soon_free(self) -> int:
        """L1 pages copies in flight will free or make evictable: what a request short of pages waits for."""
        pinned = self.copies.backup_pins()
        return self.pages.draining + sum(
            self.tree.num_pages(n) for n, locks in pinned.items() if n.on_device and n.lock_ref == locks
        )

    def host_evictable_pages(self, demoting: Iterable[TreeNode] = ()) -> int:
        """L2 pages an eviction can free now, ``demoting`` victims and the host-only nodes above
        them left out."""
        pages = self.tree.host_only_pages
        seen: set[TreeNode] = set()
        for node in demoting:
            while (node.parent is not None and node not in seen and node.on_host and not node.on_device
                   and node.lock_ref == 0):
                seen.add(node)
                pages -= self.tree.num_pages(node)
                node = node.parent
        return pages

    def stats(self) -> CacheStats:
        tree = self.tree
        return CacheStats(
            device=self.pages.device_pages(tree.device_pages, tree.locked_device_pages),
            tokens=dataclasses.replace(self.counters),
            host=self.pages.host_pages(tree.locked_host_pages, tree.host_only_pages),
            storage=self.storage.stats() if self.storage is not None else None,
        )
