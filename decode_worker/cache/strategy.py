"""The write policy and eviction order as strategies; ``LeafHeap`` keeps evictable leaves in order."""
from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from itertools import count

from decode_worker.cache.node import SELECTIVE_HITS, TreeNode
from decode_worker.core.policies import EvictionPolicy, WritePolicy

RankKey = Callable[[TreeNode], tuple]
COMPACT_SLACK = 64  # stale heap entries tolerated beyond twice the members before the heap is rebuilt


@dataclass(frozen=True)
class WriteStrategy:
    """When to start an L1 -> L2 copy (never without L2)."""

    policy: WritePolicy
    has_host: bool

    def on_insert(self, forced: bool = False) -> bool:
        """Under write_through, or when ``forced``."""
        return self.has_host and (forced or self.policy == WritePolicy.WRITE_THROUGH)

    def on_hit(self, hit_count: int) -> bool:
        """Under write_through_selective, from the second hit."""
        return self.has_host and self.policy == WritePolicy.WRITE_THROUGH_SELECTIVE and hit_count >= SELECTIVE_HITS

    @property
    def demotes(self) -> bool:
        """Under write_back, an L1-only victim goes to L2."""
        return self.has_host and self.policy == WritePolicy.WRITE_BACK


def _slru(node: TreeNode) -> tuple:
    return node.hit_count > 0, node.last_access


def _lfu(node: TreeNode) -> tuple:
    return node.hit_count, node.last_access


def _lru(node: TreeNode) -> tuple:
    return (node.last_access,)


@dataclass(frozen=True)
class EvictionOrder:
    """``rank``: least worth keeping first; only grows with use. ``partial``: a victim gives up only the
    pages still needed."""

    policy: EvictionPolicy
    rank: RankKey
    partial: bool

    def pages_to_give(self, node_pages: int, need: int) -> int:
        return min(node_pages, need) if self.partial else node_pages


def eviction_order(policy: EvictionPolicy) -> EvictionOrder:
    """SLRU (partial), LRU or LFU (docs/architecture.md)."""
    if policy == EvictionPolicy.SLRU:
        return EvictionOrder(policy, _slru, partial=True)
    if policy == EvictionPolicy.LFU:
        return EvictionOrder(policy, _lfu, partial=False)
    return EvictionOrder(EvictionPolicy.LRU, _lru, partial=False)


class LeafHeap:
    """The nodes a tier may give up now, in a lazy min-heap by ``rank``."""

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
        """Take out the first member by ``rank``, or None."""
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
