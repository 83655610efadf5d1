"""Test helpers that look inside the cache: its invariants, pages being drained, and keys back to tokens.

They read the cache's private state on purpose; the product has no use for them.
"""
from __future__ import annotations

import numpy as np

from decode_worker.cache.hicache import HierarchicalCache
from decode_worker.cache.node import Key, TreeNode
from decode_worker.cache.pool import FREE, PageAllocator, cat_pages
from decode_worker.cache.radix_tree import RadixTree


def key_tokens(key: Key) -> tuple[int, ...]:
    """Token ids back from a key."""
    return tuple(np.frombuffer(key, dtype="<i4").tolist())


def prefix_key(tree: RadixTree, node: TreeNode) -> Key:
    """Key from the root down to the end of ``node``."""
    parts = []
    while node is not tree.root:
        parts.append(node.key)
        node = node.parent
    return b"".join(reversed(parts))


def draining_pages(cache: HierarchicalCache) -> int:
    """L1 pages that copies free once they land (write_back demotions, undone loads): allocatable soon."""
    return cache.pages.draining


def check_invariants(cache: HierarchicalCache, request_pages: int | None = None,
                     prefetch_pages: int | None = None) -> None:
    """Assert tree shape, tiers and page accounting; ``request_pages`` are L1 pages held outside the tree,
    ``prefetch_pages`` L2 pages held outside it (taken with ``alloc_host``, not yet attached or freed)."""
    tree, root = cache.tree, cache.tree.root
    dev, host, locked_dev = [], [], 0
    pending = set(cache.copies.queue)
    for node in tree.nodes():
        parent, k = node.parent, cache.tree.num_pages(node)
        assert node.key and len(node.key) % tree.page_bytes == 0, f"{node} is not page aligned"
        assert parent.children.get(node.key[: tree.page_bytes]) is node, f"{node} is not its parent's child"
        assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()) >= 0, f"lock refs of {node}"
        for pages in (node.device_indices, node.host_indices):
            assert pages is None or (type(pages) is np.ndarray and pages.dtype == np.int64), f"{node}: {pages!r}"
        if node.on_device:
            assert len(node.device_indices) == k, f"{node} has {len(node.device_indices)} L1 pages"
            assert parent is root or parent.on_device, f"{node} is on L1 below a parent that is not"
            dev.append(node.device_indices)
            locked_dev += k if node.lock_ref else 0
        if node.on_host:
            assert len(node.host_indices) == k, f"{node} has {len(node.host_indices)} L2 pages"
            host.append(node.host_indices)
        # A gap is locked; below it may hang anything not on L1 (one request's path whose demotion failed is
        # a chain of gaps): match stops at it, and the last unlock drops it with its subtree.
        assert node.on_device or node.on_host or node.lock_ref > 0, f"{node} is in neither tier"
        assert all(op is None or op in pending for op in (node.loading, node.saving)), f"{node} stale copy"
    dev_pages = cat_pages(dev)
    assert len(np.unique(dev_pages)) == len(dev_pages), "an L1 page is held by two nodes"
    assert not bool((dev_pages < cache.device_alloc.reserved).any()), "a reserved L1 page is in the tree"
    assert tree.device_pages == len(dev_pages) and tree.locked_device_pages == locked_dev, "L1 counters"
    assert cache.pages.draining == sum(len(op.drain) for op in cache.copies.queue), "draining pages"
    held = tree.device_pages + cache.pages.draining
    used = cache.device_alloc.num_used
    assert used >= held, f"L1: {used} pages allocated but the tree holds {held}"
    if request_pages is not None:
        assert used == held + request_pages, f"L1: {used} allocated != {held} in tree + {request_pages} requests"
    host_pages = cat_pages(host)
    assert len(np.unique(host_pages)) == len(host_pages), "an L2 page is held by two nodes"
    host_used = 0 if cache.host_alloc is None else cache.host_alloc.num_used
    held = len(host_pages) + cache.pages.host_out
    assert host_used == held, f"L2: {host_used} allocated != {len(host_pages)} in tree + {cache.pages.host_out} out"
    if prefetch_pages is not None:
        assert cache.pages.host_out == prefetch_pages, f"L2: {cache.pages.host_out} pages out != {prefetch_pages} prefetching"
    check_evictable_leaves(tree)
    check_host_counts(cache)
    for alloc in (cache.device_alloc, cache.host_alloc):
        if alloc is not None:
            check_allocator(alloc)


def check_evictable_leaves(tree: RadixTree) -> None:
    """Each tier's evictable leaves, kept up to date as the tree changes, are exactly what a walk finds, and each
    is queued in its heap under a key no greater than its current one (keys only grow)."""
    nodes = list(tree.nodes())
    for tier, leaves, evictable in (("L1", tree.device_leaves, tree.device_evictable),
                                    ("L2", tree.host_leaves, tree.host_evictable)):
        want = {n for n in nodes if evictable(n)}
        stale, missing = leaves.members - want, want - leaves.members
        assert not stale and not missing, f"{tier} evictable leaves: stale {stale}, missing {missing}"
        queued: dict[TreeNode, tuple] = {}
        for key, _, node in leaves._heap:
            if node in leaves.members:
                queued[node] = min(key, queued.get(node, key))
        assert queued.keys() == leaves.members, f"{tier}: evictable leaves without a heap entry"
        assert all(key <= leaves.rank(n) for n, key in queued.items()), f"{tier}: a heap key above the node's"


def host_evictable_pages_by_walk(cache: HierarchicalCache) -> int:
    """What ``_host_evictable_pages`` must return, by a walk of every node: unlocked host-only nodes with no node
    being written (``saving``) in their subtree."""
    tree = cache.tree
    blocked: set[TreeNode] = set()  # being written, or above a node that is
    for node in tree.nodes():
        up = node if node.saving is not None else tree.root
        while up is not tree.root and up not in blocked:
            blocked.add(up)
            up = up.parent
    return sum(tree.num_pages(n) for n in tree.nodes()
               if n.on_host and not n.on_device and n.lock_ref == 0 and n not in blocked)


def check_host_counts(cache: HierarchicalCache) -> None:
    """The L2 page counts the tree keeps as it changes (``stats``, the L2 eviction pre-check) match a walk."""
    tree = cache.tree
    locked = host_only = 0
    for node in tree.nodes():
        if node.on_host:
            if node.lock_ref:
                locked += tree.num_pages(node)
            elif not node.on_device:
                host_only += tree.num_pages(node)
    assert (tree.locked_host_pages, tree.host_only_pages) == (locked, host_only), (
        f"L2 counters (locked, host-only) {(tree.locked_host_pages, tree.host_only_pages)} != {(locked, host_only)}")
    fast, walk = cache._host_evictable_pages(), host_evictable_pages_by_walk(cache)
    assert fast == walk, f"L2 evictable pages {fast} != {walk} by a walk"


def check_allocator(alloc: PageAllocator) -> None:
    """The free stack holds each free page once, and exactly the pages whose state is free."""
    free = np.sort(alloc._stack[: alloc._top])
    assert not (free[1:] == free[:-1]).any(), "a page is on the free stack twice"
    assert np.array_equal(free, np.flatnonzero(alloc._state == FREE)), "free stack != free states"
    assert not (free < alloc.reserved).any(), "a reserved page is on the free stack"
