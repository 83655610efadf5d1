"""The cache's figures on their own, over a bare radix tree, the allocators and the copies in flight (no cache):
what an admission may count on, what copies in flight give back, what L2 could evict, and the snapshot."""
from __future__ import annotations

from concurrent.futures import Future

import numpy as np

from decode_worker.cache.accounting import CacheAccounting
from decode_worker.cache.allocation import Allocation
from decode_worker.cache.copies import CopiesInFlight, PendingCopy
from decode_worker.cache.node import token_key
from decode_worker.cache.radix_tree import RadixTree

PAGE = 2


def parts(device_pages: int = 9, host_pages: int | None = 8) -> tuple[CacheAccounting, RadixTree, Allocation]:
    tree, pages = RadixTree(PAGE), Allocation(device_pages, host_pages)
    return CacheAccounting(tree, pages, CopiesInFlight()), tree, pages


def test_available_pages_count_free_draining_and_unlocked_tree_pages_not_locked_ones():
    acc, tree, pages = parts()
    a = tree.add_child(tree.root, token_key(range(4)), pages.take_device(2, locked=0))
    b = tree.add_child(tree.root, token_key(range(10, 16)), pages.take_device(3, locked=0))
    drain = pages.take_device(1, locked=0)
    pages.drain_later(drain)
    assert acc.available_device_pages() == 2 + 1 + 5  # free (page 0 is scratch), draining, the tree's pages
    tree.lock(b)
    assert acc.available_device_pages() == 2 + 1 + 2
    tree.unlock(b)
    tree.lock(a)
    assert acc.available_device_pages() == 2 + 1 + 3


def test_pages_soon_free_counts_nodes_only_a_backup_pins_and_drains():
    acc, tree, pages = parts()
    a = tree.add_child(tree.root, token_key(range(4)), pages.take_device(2, locked=0))
    b = tree.add_child(tree.root, token_key(range(10, 16)), pages.take_device(3, locked=0))
    for node in (a, b):
        tree.lock(node)
        acc.copies.add(PendingCopy("backup", nodes=[node], locked=[node]), Future())
    assert acc.pages_soon_free() == 5
    tree.lock(b)  # a request holds b as well: its pages stay when the backup lands
    assert acc.pages_soon_free() == 2
    pages.drain_later(np.array([7]))
    assert acc.pages_soon_free() == 3


def test_host_evictable_pages_leave_out_demoting_victims_and_the_host_only_nodes_above_them():
    acc, tree, pages = parts()
    top = tree.add_host_child(tree.root, token_key(range(4)), pages.host.alloc(2))
    mid = tree.add_host_child(top, token_key(range(4, 8)), pages.host.alloc(2))
    other = tree.add_host_child(tree.root, token_key(range(20, 22)), pages.host.alloc(1))
    assert acc.host_evictable_pages() == 5
    victim = tree.add_host_child(mid, token_key(range(8, 10)), pages.host.alloc(1))
    assert acc.host_evictable_pages([victim]) == 1  # only ``other``: victim, mid and top are spoken for
    assert other.on_host and acc.host_evictable_pages([victim, victim]) == 1
    tree.lock(mid)  # a lock pins mid and top: they leave the count, and the walk up stops at mid
    assert tree.host_only_pages == 2 and acc.host_evictable_pages([victim]) == 1


def test_stats_snapshot_copies_the_counters_and_sums_each_tier_to_its_total():
    acc, tree, pages = parts()
    tree.add_child(tree.root, token_key(range(4)), pages.take_device(2, locked=0))
    acc.counters.cached_device += 4
    snap = acc.stats()
    acc.counters.cached_device += 4
    assert snap.tokens.cached_device == 4 and snap.storage is None
    for tier in snap.tiers().values():
        assert tier.free + tier.used + tier.evictable + tier.locked == tier.total
    assert snap.device.evictable == 2 and snap.host.free == 8
