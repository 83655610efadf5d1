"""The glue between ``HierarchicalCache`` and its L3 ``StorageTier``: the L3 keys a prefetch could add
(``storage_keys``), L2 pages for a prefetch and attaching what arrived as host-only nodes (``alloc_host``,
``free_host``, ``insert_host``), and queueing L2 -> L3 backups under the storage backup policy (``_store``).

A mixin for the reason given in ``tiers.py``: the state lives once, on the cache. Besides the attributes below,
it calls ``_alloc_host`` and ``_split`` (tiers).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from decode_worker.cache.handles import MatchResult, cat_pages
from decode_worker.cache.pool import KVPool, PageAllocator, PageIds, page_ids
from decode_worker.cache.radix_tree import RadixTree, Tokens, TreeNode, chain_hashes, token_key
from decode_worker.cache.tiers import SELECTIVE_HITS
from decode_worker.core.policies import StorageBackup

if TYPE_CHECKING:
    from decode_worker.cache.storage.tier import StorageTier


class StorageMixin:
    """L3 prefetch into L2 and L2 -> L3 backups (state: see ``tiers.py``)."""

    tree: RadixTree
    page_size: int
    host_pool: KVPool | None
    host_alloc: PageAllocator | None
    storage: StorageTier | None
    storage_backup_policy: StorageBackup
    _host_out: int  # L2 pages handed out by alloc_host, not yet attached or freed

    # -- prefetch ---------------------------------------------------------------------------------------------------

    def storage_keys(self, match: MatchResult) -> list[str]:
        """L3 keys of the whole pages of ``match.key`` past its L1 + L2 hit (what a prefetch could add)."""
        ps, pb = self.page_size, self.tree.page_bytes
        hit = match.hit_tokens // ps
        if hit * pb + pb > len(match.key):
            return []
        prev = self.tree.root_hash
        if match.path:
            prev = bytes.fromhex(self.tree.page_hashes(match.path[-1])[match.tail_pages - 1])
        return [h.hex() for h in chain_hashes(match.key[hit * pb :], ps, prev)]

    def alloc_host(self, n: int) -> torch.Tensor | None:
        """``n`` L2 pages for a prefetch, evicting host-only leaves if needed; None when L2 cannot make room.

        The caller owns them until it passes them to ``insert_host`` or ``free_host``. A torch tensor: the L3
        tier is an edge of the cache (``pool.page_ids``).
        """
        pages = self._alloc_host(n)
        if pages is None:
            return None
        self._host_out += n
        return torch.from_numpy(pages)

    def free_host(self, pages: PageIds) -> None:
        """Return L2 pages from ``alloc_host`` that hold nothing worth keeping."""
        self.host_alloc.free(pages)
        self._host_out -= len(pages)

    def insert_host(self, tokens: Tokens, host_pages: PageIds, from_page: int) -> range:
        """Attach L2 pages holding pages ``from_page, from_page + 1, ...`` of ``tokens`` as a host-only node.

        The tree may have changed since the prefetch began, so this matches again: pages the tree now holds are
        freed as duplicates, and if the pages before ``from_page`` are no longer cached (evicted meanwhile), or a
        node in neither tier blocks the spot, nothing connects and every page is freed. Returns the page indices
        of ``tokens`` the new node holds (empty when none).
        """
        key, host_pages = token_key(tokens), page_ids(host_pages)
        tree, pb = self.tree, self.tree.page_bytes
        end = from_page + len(host_pages)
        if end * pb > len(key):
            raise ValueError(f"pages up to {end} of a {len(key) // pb}-page key")
        path, tail = tree.match(key[: end * pb])
        parent, have, cut = tree.root, 0, None
        for i, node in enumerate(path):
            if not (node.on_device or node.on_host):  # it holds the slot where our pages would go
                have = -1
                break
            k = tail if i == len(path) - 1 else tree.num_pages(node)
            if k < tree.num_pages(node):
                cut = (node, k)
            parent, have = node, have + k
        start = max(have, from_page)
        if have < from_page or start >= end:
            self.free_host(host_pages)
            return range(0)
        self.free_host(host_pages[: start - from_page])
        if cut is not None:
            parent = self._split(*cut)
        tree.clock += 1
        node = TreeNode(key=key[start * pb : end * pb], parent=parent, last_access=tree.clock)
        parent.children[node.key[:pb]] = node
        tree.set_host(node, host_pages[start - from_page :])
        self._host_out -= end - start
        return range(start, end)

    # -- backups ----------------------------------------------------------------------------------------------------

    def _store_backed_up(self, nodes: list[TreeNode]) -> None:
        """After an L1 -> L2 copy: back its nodes up to L3 too (all of them, or under hit_twice those hit twice)."""
        if self.storage is not None:
            hits = 0 if self.storage_backup_policy == StorageBackup.ALL else SELECTIVE_HITS
            self._store(n for n in nodes if n.hit_count >= hits)

    def _store_on_hit(self, path: list[TreeNode]) -> None:
        """After a hit under hit_twice: back up to L3 the nodes on L2 that were just hit for the second time."""
        if self.storage is not None and self.storage_backup_policy == StorageBackup.HIT_TWICE:
            self._store(n for n in path if n.hit_count == SELECTIVE_HITS and n.on_host and n.saving is None)

    def _store(self, nodes: Iterable[TreeNode]) -> None:
        """Queue one L2 -> L3 backup of the nodes' pages (the tier copies them out of L2 before returning)."""
        nodes = list(nodes)
        if nodes:
            keys = [k for n in nodes for k in self.tree.page_hashes(n)]
            self.storage.backup(keys, self.host_pool, torch.from_numpy(cat_pages([n.host_indices for n in nodes])))
