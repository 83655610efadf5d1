"""The page-granular radix tree, with counters that spare budget checks a walk."""
from __future__ import annotations

import hashlib
from typing import Iterator

import numpy as np

from decode_worker.cache.kv_events import MEDIUM_CPU, MEDIUM_GPU, TreeEvents
from decode_worker.cache.node import Key, TreeNode, chain_hashes
from decode_worker.cache.strategy import LeafHeap, RankKey
from decode_worker.core.sequence import TOKEN_BYTES


class RadixTree:
    """Structure, tiers and locks of the cached prefixes."""

    def __init__(self, page_size: int, hash_seed: str = "", rank: RankKey = lambda n: (n.last_access,)):
        self.page_size = page_size
        self.page_bytes = page_size * TOKEN_BYTES
        self.root = TreeNode(key=())
        self.root_hash = hashlib.sha256(hash_seed.encode()).digest()
        self.version = 0  # bumped on every change a MatchResult could depend on
        self.clock = 0
        self.device_pages = 0  # L1 pages held by nodes
        self.locked_device_pages = 0  # ...of which in nodes with lock_ref > 0
        self.locked_host_pages = 0  # L2 pages in nodes with lock_ref > 0
        self.host_only_pages = 0  # L2 pages in unlocked nodes on L2 alone: what L2 could give up (``_count_host``)
        self.device_leaves = LeafHeap(rank)  # nodes L1 may give up now, ranked by the eviction policy (``rank``)
        self.host_leaves = LeafHeap(rank)  # ...and L2
        self.events: TreeEvents | None = None  # KV events for routers (--kv-events-config); None: off

    # -- lookup ---------------------------------------------------------------------------------------------

    def num_pages(self, node: TreeNode) -> int:
        return len(node.key) // self.page_bytes

    def match(self, key: Key) -> tuple[list[TreeNode], int]:
        """Longest path spelling a prefix of ``key``, any tier: ``(path, pages of the last node matched)``."""
        pb = self.page_bytes
        end = len(key) - len(key) % pb
        node, pos, path = self.root, 0, []
        while pos < end:
            child = node.children.get(key[pos : pos + pb])
            if child is None:
                break
            path.append(child)
            klen = len(child.key)
            if pos + klen <= end and key.startswith(child.key, pos):
                node, pos = child, pos + klen
                continue
            return path, self._common_pages(child.key, key, pos, end)
        return path, (self.num_pages(path[-1]) if path else 0)

    def _common_pages(self, node_key: Key, key: Key, pos: int, end: int) -> int:
        pb = self.page_bytes
        hi = min(len(node_key), end - pos) // pb
        if key.startswith(node_key[: hi * pb], pos):
            return hi
        lo = 1  # invariant: lo pages match, hi pages do not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if key.startswith(node_key[: mid * pb], pos):
                lo = mid
            else:
                hi = mid
        return lo

    def nodes(self) -> Iterator[TreeNode]:
        """All but the root, parents first."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def subtree(self, node: TreeNode) -> list[TreeNode]:
        out, stack = [], [node]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def unlocked_tops(self) -> list[TreeNode]:
        return [n for n in self.nodes() if n.lock_ref == 0 and (n.parent is self.root or n.parent.lock_ref > 0)]

    def highest_gap(self, node: TreeNode) -> TreeNode | None:
        """The highest unlocked tierless node above ``node``, if any."""
        gap = None
        while node is not self.root and node.parent is not None:
            if node.device_indices is None and node.host_indices is None and node.lock_ref == 0:
                gap = node
            node = node.parent
        return gap

    def page_hashes(self, node: TreeNode) -> list[str]:
        """Each page's chained hash in hex (L3 keys), computed once."""
        if node.hashes is None:
            parent = node.parent
            prev = self.root_hash if parent is self.root else bytes.fromhex(self.page_hashes(parent)[-1])
            node.hashes = [h.hex() for h in chain_hashes(node.key, self.page_size, prev)]
        return node.hashes

    def hashes_past(self, key: Key, last: TreeNode | None, tail: int, hit: int) -> list[str]:
        """L3 keys of ``key``'s whole pages from page ``hit`` (page ``tail`` of ``last``) on."""
        pb = self.page_bytes
        if hit * pb + pb > len(key):
            return []
        prev = self.root_hash if last is None else bytes.fromhex(self.page_hashes(last)[tail - 1])
        return [h.hex() for h in chain_hashes(key[hit * pb :], self.page_size, prev)]

    def attach_point(self, key: Key) -> tuple[TreeNode, int, tuple[TreeNode, int] | None]:
        """Where pages past ``key``'s cached part hang: parent, pages matched (-1 past a tierless node), split
        to make first."""
        path, tail = self.match(key)
        parent, have, cut = self.root, 0, None
        for i, node in enumerate(path):
            if not (node.on_device or node.on_host):
                return parent, -1, None
            k = tail if i == len(path) - 1 else self.num_pages(node)
            if k < self.num_pages(node):
                cut = (node, k)
            parent, have = node, have + k
        return parent, have, cut

    # -- structure ------------------------------------------------------------------------------------------

    def touch(self, node: TreeNode, hit: bool = False) -> None:
        """Mark the path to ``node`` used now and, on a hit, count it."""
        self.clock += 1
        while node is not self.root:
            node.last_access = self.clock
            node.hit_count += hit
            node = node.parent

    def add_child(self, parent: TreeNode, key: Key, device_indices: np.ndarray) -> TreeNode:
        assert len(key) % self.page_bytes == 0 and len(key) // self.page_bytes == len(device_indices)
        self.clock += 1
        node = TreeNode(key=key, parent=parent, last_access=self.clock)
        parent.children[key[: self.page_bytes]] = node
        self.set_device(node, device_indices)  # re-files the parent too
        return node

    def add_host_child(self, parent: TreeNode, key: Key, host_indices: np.ndarray) -> TreeNode:
        self.clock += 1
        node = TreeNode(key=key, parent=parent, last_access=self.clock)
        parent.children[key[: self.page_bytes]] = node
        self.set_host(node, host_indices)
        return node

    def split(self, node: TreeNode, pages: int) -> TreeNode:
        """Cut ``node`` after ``pages`` pages; returns the head, its new parent."""
        assert 0 < pages < self.num_pages(node)
        pb = self.page_bytes
        cut = pages * pb
        head = TreeNode(
            key=node.key[:cut],
            parent=node.parent,
            children={node.key[cut : cut + pb]: node},
            device_indices=None if node.device_indices is None else node.device_indices[:pages],
            host_indices=None if node.host_indices is None else node.host_indices[:pages],
            lock_ref=node.lock_ref,
            last_access=node.last_access,
            hit_count=node.hit_count,
            loading=node.loading,
            saving=node.saving,
            hashes=None if node.hashes is None else node.hashes[:pages],
        )
        node.parent.children[node.key[:pb]] = head  # the parent's children keep their tiers: no re-filing
        node.key = node.key[cut:]
        node.parent = head
        if node.device_indices is not None:
            node.device_indices = node.device_indices[pages:]
        if node.host_indices is not None:
            node.host_indices = node.host_indices[pages:]
        if node.hashes is not None:
            node.hashes = node.hashes[pages:]
        self.version += 1
        return head

    def cut_device_tail(self, node: TreeNode, keep: int) -> np.ndarray | None:
        """Cut an unlocked L1-only leaf with no copy or listener to ``keep`` pages; the cut pages, else None."""
        assert 0 < keep < self.num_pages(node)
        if (node.children or node.lock_ref or node.host_indices is not None or node.loading is not None
                or node.saving is not None or self.events is not None):
            return None
        pages = node.device_indices
        node.key = node.key[: keep * self.page_bytes]
        node.device_indices = pages[:keep]
        if node.hashes is not None:
            node.hashes = node.hashes[:keep]
        self.device_pages -= len(pages) - keep
        self.version += 1
        if node.parent is not None:  # still an unlocked L1 leaf (checked above), unless detached
            self.device_leaves.add(node)
        return pages[keep:]

    def remove(self, node: TreeNode) -> None:
        """Detach a subtree whose pages are released; detached nodes have no parent."""
        parent = node.parent
        del parent.children[node.key[: self.page_bytes]]
        for n in self.subtree(node) if node.children else (node,):
            assert n.device_indices is None and n.host_indices is None and n.lock_ref == 0, n
            n.parent = None
            self.device_leaves.members.discard(n)
            self.host_leaves.members.discard(n)
        self._file(self.host_leaves, parent, self.host_evictable(parent))  # it may be an L2 leaf now
        self.version += 1

    # -- tiers ------------------------------------------------------------------------------------------------

    def set_device(self, node: TreeNode, pages: np.ndarray) -> None:
        assert node.device_indices is None
        self._count_host(node, -1)
        node.device_indices = pages
        self._count_host(node, +1)
        self.device_pages += len(pages)
        if node.lock_ref:
            self.locked_device_pages += len(pages)
        self.version += 1
        self._file(self.device_leaves, node, self.device_evictable(node))
        self.host_leaves.members.discard(node)
        self.device_leaves.members.discard(node.parent)  # a parent with a child on L1 is no L1 leaf
        if self.events is not None:
            self.events.stored(node, MEDIUM_GPU)

    def clear_device(self, node: TreeNode) -> np.ndarray:
        if self.events is not None:
            self.events.removed(node, MEDIUM_GPU)
        pages = node.device_indices
        self._count_host(node, -1)
        node.device_indices = None
        self._count_host(node, +1)
        self.device_pages -= len(pages)
        if node.lock_ref:
            self.locked_device_pages -= len(pages)
        self.version += 1
        self.device_leaves.members.discard(node)
        self._file(self.host_leaves, node, self.host_evictable(node))
        self._file(self.device_leaves, node.parent, self.device_evictable(node.parent))
        return pages

    def set_host(self, node: TreeNode, pages: np.ndarray) -> None:
        assert node.host_indices is None
        node.host_indices = pages
        self._count_host(node, +1)
        self.version += 1
        self._file(self.host_leaves, node, self.host_evictable(node))
        self.host_leaves.members.discard(node.parent)  # it may have just been hung below it (``insert_host``)
        if self.events is not None:
            self.events.stored(node, MEDIUM_CPU)

    def clear_host(self, node: TreeNode) -> np.ndarray:
        if self.events is not None:
            self.events.removed(node, MEDIUM_CPU)
        self._count_host(node, -1)
        pages = node.host_indices
        node.host_indices = None
        self.version += 1
        self.host_leaves.members.discard(node)
        return pages

    # -- locks ------------------------------------------------------------------------------------------------

    def lock(self, node: TreeNode) -> None:
        """Pin ``node`` and its ancestors."""
        while node is not self.root:
            node.lock_ref += 1
            if node.lock_ref == 1:
                if node.host_indices is not None:
                    self._count_host(node, -1, lock_ref=0)
                    self._count_host(node, +1)
                if node.device_indices is not None:
                    self.locked_device_pages += len(node.device_indices)
                self.device_leaves.members.discard(node)
                self.host_leaves.members.discard(node)
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unbalanced unlock of {node}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                if node.host_indices is not None:
                    self._count_host(node, -1, lock_ref=1)
                    self._count_host(node, +1)
                if node.device_indices is not None:
                    self.locked_device_pages -= len(node.device_indices)
                self.refresh(node)
            node = node.parent

    def _count_host(self, node: TreeNode, sign: int, lock_ref: int | None = None) -> None:
        """Count ``node``'s L2 pages in (``sign`` 1) or out (-1)."""
        if node.host_indices is None:
            return
        k = sign * len(node.host_indices)
        if node.lock_ref if lock_ref is None else lock_ref:
            self.locked_host_pages += k
        elif node.device_indices is None:
            self.host_only_pages += k

    # -- evictable leaves -------------------------------------------------------------------------------------

    def device_evictable(self, node: TreeNode) -> bool:
        """On L1, unlocked, no child on L1."""
        return (node.device_indices is not None and node.lock_ref == 0
                and (not node.children or not any(c.device_indices is not None for c in node.children.values())))

    def host_evictable(self, node: TreeNode) -> bool:
        """Only on L2, unlocked, a leaf, no copy writing it."""
        return (node.host_indices is not None and node.device_indices is None and node.lock_ref == 0
                and not node.children and node.saving is None)

    def refresh(self, node: TreeNode) -> None:
        """Re-file ``node`` in the evictable leaves after its lock or copies changed."""
        self._file(self.device_leaves, node, self.device_evictable(node))
        self._file(self.host_leaves, node, self.host_evictable(node))

    @staticmethod
    def _file(leaves: LeafHeap, node: TreeNode, evictable: bool) -> None:
        if evictable and node.parent is not None:  # never the root, nor a node already detached
            leaves.add(node)
        else:
            leaves.members.discard(node)
