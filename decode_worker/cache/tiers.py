"""The L1 and L2 tiers of ``HierarchicalCache``: page allocation in each, the copies between them on the
``CopyEngine`` (``PendingCopy``) and what the cache does when each one finishes (``poll``, ``_finish``, drains).

This is a mixin, not a component: the tiers, eviction and L3 glue all change the same tree nodes, locks and page
counts in one batch, so the state lives once, on the ``HierarchicalCache`` that sets it up in ``__init__``, and
each mixin only adds the operations of its job. The attributes below are the ones this module uses; the methods
it calls from the other mixins are ``evict_device``, ``evict_host``, ``_host_evictable_pages``,
``_prune_gap_above`` (eviction) and ``_store_backed_up`` (L3 glue).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

import numpy as np

from decode_worker.cache.copy_engine import CopyEngine
from decode_worker.cache.handles import NO_PAGES, cat_pages
from decode_worker.cache.pool import OutOfPages, PageAllocator, PageIds
from decode_worker.cache.radix_tree import RadixTree, TreeNode
from decode_worker.cache.stats import CacheCounters

SELECTIVE_HITS = 2  # write_through_selective backs a node up on its second hit; so does hit_twice to L3


@dataclass(eq=False)
class PendingCopy:
    """A copy on the engine plus what the cache must do when it finishes."""

    kind: str  # "load" (L2->L1) or "backup" (L1->L2)
    nodes: list[TreeNode]  # nodes whose data it writes, in path order; kept current across splits
    locked: list[TreeNode]  # nodes it holds a lock on
    deps: list[PendingCopy] = field(default_factory=list)  # earlier copies it fails with (reads or loads below)
    # L1 pages to free once done (write_back eviction, a load undone early)
    drain: np.ndarray = field(default_factory=NO_PAGES.copy)
    future: Future | None = None
    ok: bool | None = None  # set when finished


class TierMixin:
    """L1/L2 allocation and the copies between the tiers (state: see the module docstring)."""

    tree: RadixTree
    page_size: int
    device_alloc: PageAllocator
    host_alloc: PageAllocator | None
    engine: CopyEngine | None
    counters: CacheCounters
    _pending: deque[PendingCopy]
    _draining: int  # L1 pages that pending copies free when done

    # -- L1 pages ---------------------------------------------------------------------------------------------------

    def alloc_device(self, n: int) -> np.ndarray:
        """``n`` L1 pages, evicting unlocked leaves in one batch if needed; raises OutOfPages taking nothing."""
        self.poll()  # finished copies unlock nodes and return drained pages
        return self._alloc_device(n)

    def _alloc_device(self, n: int) -> np.ndarray:
        short = n - self.device_alloc.num_free - self._draining
        if short > 0:
            self.evict_device(short)
        if self.device_alloc.num_free < n:
            raise OutOfPages(
                f"need {n} L1 pages: {self.device_alloc.num_free} free, {self._draining} still being backed up "
                f"to L2, {self.tree.locked_device_pages} locked"
            )
        return self.device_alloc.alloc(n)

    def free_device(self, pages: PageIds) -> None:
        """Return request-owned L1 pages that were never inserted (e.g. a partial last page)."""
        self.device_alloc.free(pages)

    def available_device_pages(self) -> int:
        """Pages an allocation could get now or after evicting: the budget check before admitting a request."""
        return self.device_alloc.num_free + self._draining + self.tree.device_pages - self.tree.locked_device_pages

    def pages_soon_free(self) -> int:
        """L1 pages that copies in flight will make allocatable (drains) or evictable (nodes that only a
        backup's lock pins, e.g. a retracted request's). A request short of pages waits for these rather than
        taking someone else's."""
        pinned: dict[TreeNode, int] = {}
        for op in self._pending:
            if op.kind == "backup":
                for node in op.locked:
                    while node is not self.tree.root:
                        pinned[node] = pinned.get(node, 0) + 1
                        node = node.parent
        return self._draining + sum(
            self.tree.num_pages(n) for n, locks in pinned.items() if n.on_device and n.lock_ref == locks
        )

    # -- L2 pages and the copies ------------------------------------------------------------------------------------

    def _alloc_host(self, n: int) -> np.ndarray | None:
        """``n`` L2 pages, evicting host-only leaves if needed; None when L2 cannot make room. Never raises: a
        write_back eviction batch calls it between marking victims and queueing their demotion."""
        if self.host_alloc is None:
            return None
        short = n - self.host_alloc.num_free
        if short > 0:
            if short > self._host_evictable_pages():
                return None  # evicting could not make room: keep L2 as it is
            self.evict_host(short)
        return self.host_alloc.alloc(n) if self.host_alloc.num_free >= n else None

    def _backup(self, nodes: Iterable[TreeNode]) -> None:
        """Start one L1->L2 copy for the given nodes that are only on L1 (skipped if L2 has no room)."""
        if self.host_alloc is None:
            return
        nodes = [n for n in nodes if n.on_device and not n.on_host and n.saving is None]
        if not nodes:
            return
        host = self._alloc_host(sum(self.tree.num_pages(n) for n in nodes))
        if host is None:
            return
        op = PendingCopy("backup", nodes=nodes, locked=list(nodes))
        offset = 0
        for node in nodes:
            k = self.tree.num_pages(node)
            self.tree.set_host(node, host[offset : offset + k])
            offset += k
            node.saving = op
            self.tree.lock(node)
        op.future = self.engine.backup(cat_pages([n.device_indices for n in nodes]), host)
        self._pending.append(op)

    def _start_load(self, nodes: list[TreeNode], device_pages: np.ndarray) -> None:
        """Submit the L2->L1 copy of ``nodes`` into ``device_pages``; the nodes change only once it is queued.

        It fails with the copies it reads from (backups still writing its L2 pages) and with earlier loads of
        its ancestors, whose failure takes its nodes off L1 (``_undo_loads_below``).
        """
        deps = {n.saving: None for n in nodes if n.saving is not None}
        node = nodes[0].parent
        while node is not self.tree.root:
            if node.loading is not None:
                deps[node.loading] = None
            node = node.parent
        op = PendingCopy("load", nodes=list(nodes), locked=[nodes[-1]], deps=list(deps))
        op.future = self.engine.load(cat_pages([n.host_indices for n in nodes]), device_pages)
        offset = 0
        for node in nodes:
            n = self.tree.num_pages(node)
            self.tree.set_device(node, device_pages[offset : offset + n])
            node.loading = op
            offset += n
        self.tree.lock(nodes[-1])
        self._pending.append(op)

    def _split(self, node: TreeNode, pages: int) -> TreeNode:
        """Split ``node`` after ``pages`` pages, keeping the copies that write it current."""
        head = self.tree.split(node, pages)
        for op in (node.loading, node.saving):
            if op is not None:
                op.nodes.insert(op.nodes.index(node), head)
        return head

    # -- completions ------------------------------------------------------------------------------------------------

    def poll(self) -> int:
        """Apply finished copies, in submission order; returns how many. Cheap: the scheduler calls it each step."""
        done = 0
        while self._pending and self._pending[0].future.done():
            self._finish(self._pending.popleft())
            done += 1
        return done

    @property
    def busy(self) -> bool:
        """Copies are in flight: their locks and pages are released only by a later ``poll``."""
        return bool(self._pending)

    def drain(self) -> None:
        """Block until every pending copy is finished and applied (tests, benchmarks, shutdown; not the loop)."""
        while self._pending:
            wait_futures([op.future for op in self._pending])
            self.poll()

    def close(self) -> None:
        self.drain()
        if self.engine is not None:
            self.engine.close()

    def _finish(self, op: PendingCopy) -> None:
        """A failed or cancelled copy leaves no trace: restored L1 copies and new L2 copies are dropped, and so
        are the L1 copies that later loads restore below a failed load."""
        future, tree = op.future, self.tree
        ok = not (future.cancelled() or future.exception() is not None or any(d.ok is False for d in op.deps))
        for node in op.nodes:
            if op.kind == "load":
                node.loading = None
                if ok:
                    self.counters.loaded_back += node.num_tokens
                else:
                    self.device_alloc.free(tree.clear_device(node))
            else:
                node.saving = None
                if ok:
                    self.counters.backed_up += node.num_tokens
                else:
                    self.host_alloc.free(tree.clear_host(node))
        if op.kind == "load" and not ok and op.nodes:
            self._undo_loads_below(op.nodes[0])
        if op.kind == "backup" and ok:
            self._store_backed_up(op.nodes)
        if len(op.drain):
            self.device_alloc.free(op.drain)
            self._draining -= len(op.drain)
        op.ok = ok
        for node in op.locked:
            tree.unlock(node)
        if not ok:  # a node may have lost its last tier; every node of the op is on a path to a locked one
            for node in op.locked:
                if node.parent is not None:
                    self._prune_gap_above(node)

    def _undo_loads_below(self, node: TreeNode) -> None:
        """Take off L1 what later loads restore below ``node``, whose load failed: a node on L1 has its parent
        there. Those loads fail too (they depend on this one); as their copies may be running, their pages are
        freed when each is done."""
        for n in self.tree.subtree(node):
            op = n.loading
            if op is not None:
                op.nodes.remove(n)
                n.loading = None
                op.drain = np.concatenate((op.drain, self.tree.clear_device(n)))
                self._draining += self.tree.num_pages(n)
