"""The evictable leaves of one tier, kept up to date as the tree changes, so that an eviction batch costs time in
proportion to what it evicts rather than a walk of every node.

The tree adds a node, or discards it from ``members`` (its heap entry goes stale and ``pop`` skips it), whenever
something its evictability depends on changes (its tiers, its lock, its children, a copy writing it); ``pop``
hands out the member the eviction policy ranks first. The ranking key may grow while a node waits (``touch``
moves its last access and hit count forward, never back), so a heap entry is checked against the node's current
key when it reaches the top and pushed back if it has grown: no update is needed on the hot ``touch`` path, and
what is popped is always the true minimum.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable
from itertools import count
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from decode_worker.cache.radix_tree import TreeNode

RankKey = Callable[["TreeNode"], tuple]
COMPACT_SLACK = 64  # stale heap entries tolerated beyond twice the members before the heap is rebuilt


class LeafHeap:
    """The members (nodes the tier may give up now) and a lazy min-heap over them by the policy's key."""

    def __init__(self, rank: RankKey):
        self.rank = rank
        self.members: set[TreeNode] = set()
        self._heap: list[tuple[tuple, int, TreeNode]] = []  # (key when pushed, push order, node); may be stale
        self._order = count()

    def __len__(self) -> int:
        return len(self.members)

    def add(self, node: TreeNode) -> None:
        if node not in self.members:
            self.members.add(node)
            heapq.heappush(self._heap, (self.rank(node), next(self._order), node))
            if len(self._heap) > 2 * len(self.members) + COMPACT_SLACK:
                self._compact()

    def pop(self) -> TreeNode | None:
        """Take out and return the first member by the policy (None when there is none)."""
        heap = self._heap
        while heap:
            key, _, node = heap[0]
            if node not in self.members:
                heapq.heappop(heap)
                continue
            now = self.rank(node)
            if now != key:  # touched since it was pushed: its key only grew
                heapq.heapreplace(heap, (now, next(self._order), node))
                continue
            heapq.heappop(heap)
            self.members.discard(node)
            return node
        return None

    def _compact(self) -> None:
        self._heap = [(self.rank(n), next(self._order), n) for n in self.members]
        heapq.heapify(self._heap)
