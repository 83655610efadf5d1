"""Nodes' tier changes, for ``HierarchicalCache`` alone, which chooses the nodes and the pages."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from decode_worker.cache.allocation import Allocation
from decode_worker.cache.copies import CopiesInFlight, PendingCopy
from decode_worker.cache.copy_engine import PageCopier
from decode_worker.cache.node import TreeNode
from decode_worker.cache.pool import cat_pages
from decode_worker.cache.radix_tree import RadixTree
from decode_worker.cache.stats import CacheCounters


@dataclass(eq=False)
class TierMoves:
    """Changes a node's tiers, copy marks and copy locks with its pages' owner."""

    tree: RadixTree
    pages: Allocation
    copies: CopiesInFlight
    engine: PageCopier | None
    counters: CacheCounters

    # -- starting copies --------------------------------------------------------------------------------------------

    def backup(self, nodes: list[TreeNode], host: np.ndarray) -> None:
        """Give L1-only ``nodes`` the L2 pages ``host``, in order, and start their copy."""
        op = PendingCopy("backup", nodes=nodes, locked=list(nodes))
        offset = 0
        for node in nodes:
            k = self.tree.num_pages(node)
            self.tree.set_host(node, host[offset : offset + k])
            offset += k
            node.saving = op
            self.tree.lock(node)
        self.copies.add(op, self.engine.backup(cat_pages([n.device_indices for n in nodes]), host))

    def load(self, nodes: list[TreeNode], device_pages: np.ndarray) -> None:
        """Start the load-back of host-only ``nodes`` (a path) into ``device_pages``."""
        op = PendingCopy("load", nodes=list(nodes), locked=[nodes[-1]], deps=self.copies.load_deps(nodes))
        future = self.engine.load(cat_pages([n.host_indices for n in nodes]), device_pages)
        offset = 0
        for node in nodes:
            n = self.tree.num_pages(node)
            self.tree.set_device(node, device_pages[offset : offset + n])
            node.loading = op
            offset += n
        self.tree.lock(nodes[-1])
        self.copies.add(op, future)

    def demote(self, op: PendingCopy, old_pages: list[np.ndarray]) -> None:
        """Copy write_back victims still in the tree to L2; ``old_pages`` go when it lands."""
        live = [(n, p) for n, p in zip(op.nodes, old_pages) if n.parent is not None]
        op.drain = cat_pages(old_pages)
        if not live:
            self.pages.device.free(op.drain)
            return
        op.nodes = [n for n, _ in live]
        op.locked = list(op.nodes)
        for node in op.nodes:
            self.tree.lock(node)
        self.pages.drain_later(op.drain)
        src, dst = cat_pages([p for _, p in live]), cat_pages([n.host_indices for n in op.nodes])
        self.copies.add(op, self.engine.backup(src, dst))

    # -- finished copies --------------------------------------------------------------------------------------------

    def settle(self, op: PendingCopy, ok: bool) -> None:
        """Apply a finished copy; a failed one, and loads below a failed load, leave no trace."""
        tree = self.tree
        for node in op.nodes:
            if op.kind == "load":
                node.loading = None
                if ok:
                    self.counters.loaded_back += node.num_tokens
                else:
                    self.pages.device.free(tree.clear_device(node))
            else:
                node.saving = None
                if ok:
                    self.counters.backed_up += node.num_tokens
                else:
                    self.pages.host.free(tree.clear_host(node))
        if op.kind == "load" and not ok and op.nodes:
            self._undo_loads_below(op.nodes[0])
        if len(op.drain):
            self.pages.drained(op.drain)
        op.ok = ok
        for node in op.locked:
            tree.unlock(node)
        if not ok:  # a node may have lost its last tier; every node of the op is on a path to a locked one
            for node in op.locked:
                if node.parent is not None:
                    self.prune_gap_above(node)

    def _undo_loads_below(self, node: TreeNode) -> None:
        """Undo the loads below ``node``, whose load failed; pages go as each lands."""
        for n in self.tree.subtree(node):
            op = n.loading
            if op is not None:
                op.nodes.remove(n)
                n.loading = None
                pages = self.tree.clear_device(n)
                op.drain = np.concatenate((op.drain, pages))
                self.pages.drain_later(pages)

    # -- leaving the tree -------------------------------------------------------------------------------------------

    def drop(self, node: TreeNode, device_pages: list[np.ndarray] | None = None) -> None:
        """Remove an unlocked subtree and free its pages (L1 ones into ``device_pages`` if given)."""
        for n in self.tree.subtree(node) if node.children else (node,):
            if n.on_device:
                pages = self.tree.clear_device(n)
                if device_pages is None:
                    self.pages.device.free(pages)
                else:
                    device_pages.append(pages)
            if n.on_host:
                self.pages.host.free(self.tree.clear_host(n))
                self.counters.evicted_host += n.num_tokens
        self.tree.remove(node)

    def prune_gap_above(self, node: TreeNode) -> None:
        if (gap := self.tree.highest_gap(node)) is not None:
            self.drop(gap)
