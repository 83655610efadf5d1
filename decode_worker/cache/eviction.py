"""Eviction for ``HierarchicalCache``: the policy's ordering key (SLRU, LRU or LFU), the eviction batches
(``evict_device``, ``evict_host``), removing nodes (``_drop``) and counting evictable pages. Which nodes each tier
may give up is kept up to date by the tree (``RadixTree.device_leaves``, ``host_leaves``): a batch pops victims
from them, never walks the tree.

A mixin for the reason given in ``tiers.py``: the state lives once, on the cache. Besides the attributes below,
it calls ``_alloc_host`` (tiers) to demote a write_back victim to L2, and ``_split`` (tiers) to cut a victim.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from decode_worker.cache.copy_engine import CopyEngine
from decode_worker.cache.evictable import RankKey
from decode_worker.cache.handles import cat_pages
from decode_worker.cache.pool import PageAllocator
from decode_worker.cache.radix_tree import RadixTree, TreeNode
from decode_worker.cache.stats import CacheCounters
from decode_worker.cache.tiers import PendingCopy
from decode_worker.core.policies import EvictionPolicy, WritePolicy


def rank_key(policy: EvictionPolicy) -> RankKey:
    """The policy's ordering key, least worth keeping first. SLRU: never-hit nodes first (a request's own suffix,
    rarely reused), then hit ones (shared prefixes), least recently used first within each; LRU: least recently
    used; LFU: least hit, then least recent. Each key only grows as a node is used (``LeafHeap`` relies on it)."""
    if policy == EvictionPolicy.SLRU:
        return lambda n: (n.hit_count > 0, n.last_access)
    if policy == EvictionPolicy.LFU:
        return lambda n: (n.hit_count, n.last_access)
    return lambda n: (n.last_access,)


class EvictionMixin:
    """Victim selection and eviction in both tiers (state: see ``tiers.py``)."""

    tree: RadixTree
    page_size: int
    write_policy: WritePolicy
    eviction: EvictionPolicy
    device_alloc: PageAllocator
    host_alloc: PageAllocator | None
    engine: CopyEngine | None
    counters: CacheCounters
    _pending: deque[PendingCopy]
    _draining: int
    _demoting: PendingCopy | None  # the write_back victims of the eviction batch under way, not yet locked

    # -- victims ----------------------------------------------------------------------------------------------------

    def _trim(self, node: TreeNode, need: int) -> TreeNode:
        """The part of victim ``node`` to give up for ``need`` more pages. Under SLRU only its last ``need`` pages
        (split off; the head stays cached with its hit count), so a shared prefix is never evicted whole for a
        few pages; LRU and LFU give up whole leaves."""
        k = self.tree.num_pages(node)
        if self.eviction == EvictionPolicy.SLRU and need < k:
            self._split(node, k - need)  # ``node`` keeps the tail and the children
        return node

    def _host_evictable_pages(self) -> int:
        """L2 pages ``evict_host`` can free now: unlocked host-only nodes with no node being written in their
        subtree (evicting a node's children first makes it a leaf). The tree counts the unlocked host-only pages
        as they change (``host_only_pages``). A node being written is locked, and so are its ancestors, except
        within a write_back eviction batch: its victims are marked ``saving`` (``_demoting``) before their
        demotion locks them, so they and the unlocked host-only nodes above them are taken out here, walking up
        from the victims only (the nodes above are on L1 or locked, or were demoted in the same batch)."""
        pages = self.tree.host_only_pages
        if self._demoting is not None:
            seen: set[TreeNode] = set()
            for node in self._demoting.nodes:
                while (node.parent is not None and node not in seen and node.on_host and not node.on_device
                       and node.lock_ref == 0):
                    seen.add(node)
                    pages -= self.tree.num_pages(node)
                    node = node.parent
        return pages

    # -- eviction batches -------------------------------------------------------------------------------------------

    def evict_device(self, n_pages: int) -> int:
        """Free at least ``n_pages`` L1 pages (exactly, under SLRU) from unlocked leaves in one batch; returns
        pages released.

        A backed-up leaf is demoted to host-only; under write_back a leaf is backed up now (its L1 pages are
        freed when that copy finishes); any other leaf leaves the tree with its host-only subtree.
        """
        tree = self.tree
        write_back = self.write_policy == WritePolicy.WRITE_BACK and self.host_alloc is not None
        demote = PendingCopy("backup", nodes=[], locked=[]) if write_back else None
        cut_tails = self.eviction == EvictionPolicy.SLRU and not write_back  # a tail would leave the tree
        old_pages, freed, released = [], [], 0
        self._demoting = demote
        try:
            while released < n_pages and (node := tree.device_leaves.pop()) is not None:
                need, k = n_pages - released, tree.num_pages(node)
                if cut_tails and need < k and (tail := tree.cut_device_tail(node, k - need)) is not None:
                    freed.append(tail)  # the usual SLRU victim: a leaf only on L1 that keeps its head
                    self.counters.evicted_device += need * self.page_size
                    released += need
                    continue
                node = self._trim(node, need)
                k = tree.num_pages(node)
                if node.on_host:
                    freed.append(tree.clear_device(node))
                elif write_back and (host := self._alloc_host(k)) is not None:
                    old_pages.append(tree.clear_device(node))
                    tree.set_host(node, host)
                    node.saving = demote  # keeps evict_host off it until the copy is queued and locks it
                    tree.refresh(node)
                    demote.nodes.append(node)
                else:
                    self._drop(node, freed)
                self.counters.evicted_device += k * self.page_size
                released += k
        finally:
            self._demoting = None
            self.device_alloc.free(cat_pages(freed))  # one batch: the allocator's checks run once
        if old_pages:
            self._start_demotion(demote, old_pages)
        return released

    def _start_demotion(self, op: PendingCopy, old_pages: list[np.ndarray]) -> None:
        """Copy write_back victims to L2; their old L1 pages are freed when the copy is done.

        A victim whose parent was dropped later in the same batch left the tree with it: it is not copied.
        """
        live = [(n, p) for n, p in zip(op.nodes, old_pages) if n.parent is not None]
        op.drain = cat_pages(old_pages)
        if not live:
            self.device_alloc.free(op.drain)
            return
        op.nodes = [n for n, _ in live]
        op.locked = list(op.nodes)
        for node in op.nodes:
            self.tree.lock(node)
        self._draining += len(op.drain)
        op.future = self.engine.backup(cat_pages([p for _, p in live]), cat_pages([n.host_indices for n in op.nodes]))
        self._pending.append(op)

    def evict_host(self, n_pages: int) -> int:
        """Free at least ``n_pages`` L2 pages (exactly, under SLRU) from unlocked host-only leaves; returns pages
        freed."""
        freed = 0
        while freed < n_pages and (node := self.tree.host_leaves.pop()) is not None:
            node = self._trim(node, n_pages - freed)
            freed += self.tree.num_pages(node)
            self._drop(node)
        return freed

    # -- removing nodes ---------------------------------------------------------------------------------------------

    def _drop(self, node: TreeNode, device_pages: list[np.ndarray] | None = None) -> None:
        """Remove an unlocked node and its subtree from the tree, freeing their pages in both tiers (the L1 ones
        into ``device_pages`` instead, for the caller to free in one batch)."""
        for n in self.tree.subtree(node) if node.children else (node,):
            if n.on_device:
                pages = self.tree.clear_device(n)
                if device_pages is None:
                    self.device_alloc.free(pages)
                else:
                    device_pages.append(pages)
            if n.on_host:
                self.host_alloc.free(self.tree.clear_host(n))
                self.counters.evicted_host += n.num_tokens
        self.tree.remove(node)

    def _prune_gap_above(self, node: TreeNode) -> None:
        """Drop the highest unlocked node in neither tier on the path to ``node`` (left by a failed backup)."""
        gap = None
        while node is not self.tree.root and node.parent is not None:
            if node.device_indices is None and node.host_indices is None and node.lock_ref == 0:
                gap = node
            node = node.parent
        if gap is not None:
            self._drop(gap)
