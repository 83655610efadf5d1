"""What a caller of the cache holds: a ``MatchResult``, a ``LoadHandle`` and ``LoadBackError``."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from decode_worker.cache.copies import PendingCopy
from decode_worker.cache.node import Key, TreeNode
from decode_worker.cache.pool import NO_PAGES, cat_pages
from decode_worker.cache.radix_tree import RadixTree


class LoadBackError(RuntimeError):
    """A load-back the prefix depends on failed: the prefix is unusable."""


@dataclass
class MatchResult:
    """A read-only match: the L1 hit, what L2 can restore, where it stopped."""

    key: Key  # token_key of the query
    path: list[TreeNode]  # matched nodes; the last one may match only its first ``tail_pages`` pages
    tail_pages: int
    device_hit_tokens: int
    host_hit_tokens: int
    device_indices: np.ndarray  # L1 pages of the device hit
    restore_nodes: list[TreeNode]  # host-only nodes after the device hit, in path order
    version: int  # tree version at match time; a stale match is redone by load_back_and_lock

    @property
    def hit_tokens(self) -> int:
        return self.device_hit_tokens + self.host_hit_tokens


def match_prefix(tree: RadixTree, key: Key) -> MatchResult:
    """The longest prefix of ``key`` on L1 then L2, to the first gap."""
    path, tail = tree.match(key)
    last = len(path) - 1
    dev_parts, restore = [], []
    device_pages, host_pages = 0, 0
    for i, node in enumerate(path):
        held = node.device_indices
        pages = tail if i == last else tree.num_pages(node)
        if held is not None and not restore:
            dev_parts.append(held if pages == len(held) else held[:pages])
            device_pages += pages
        elif node.host_indices is not None and held is None:
            restore.append(node)
            host_pages += pages
        else:
            path, tail = path[:i], (tree.num_pages(path[i - 1]) if i else 0)
            break
    return MatchResult(key=key, path=path, tail_pages=tail, device_hit_tokens=device_pages * tree.page_size,
                       host_hit_tokens=host_pages * tree.page_size, device_indices=cat_pages(dev_parts),
                       restore_nodes=restore, version=tree.version)


@dataclass(eq=False)
class LoadHandle:
    """A locked prefix, its load-back and the request's delta pages."""

    node: TreeNode  # deepest locked node (the root when nothing matched)
    device_indices: np.ndarray  # L1 pages of the whole prefix; valid once wait() returns
    delta_pages: np.ndarray  # pages allocated for the rest of the request, owned by the handle
    device_hit_tokens: int
    restored_tokens: int
    waits: list[PendingCopy]
    page_size: int
    settle: Callable[[], object]  # applies finished copies (the cache's ``poll``)
    released: bool = False

    @property
    def prefix_tokens(self) -> int:
        return len(self.device_indices) * self.page_size

    def ready(self) -> bool:
        self.settle()
        return all(op.ok is not None for op in self.waits)

    async def wait(self) -> None:
        """Until the prefix's copies finish; LoadBackError if one failed."""
        if self.waits:
            done, _ = await asyncio.wait([asyncio.wrap_future(op.future) for op in self.waits])
            for f in done:
                if not f.cancelled():
                    f.exception()  # retrieved so asyncio does not log it; reported below as LoadBackError
            self.settle()  # the copies ours depend on ran before them, so ours apply now
        if not all(op.ok for op in self.waits):
            raise LoadBackError(f"load-back of a {self.prefix_tokens}-token prefix failed")

    def take_pages(self) -> np.ndarray:
        """Prefix pages, then the delta pages, which now belong to the caller."""
        prefix, delta = self.device_indices, self.delta_pages
        pages = np.concatenate((prefix, delta)) if len(prefix) else delta  # a miss: the delta is all the caller's
        self.delta_pages = NO_PAGES
        return pages


@dataclass(frozen=True)
class FlushOutcome:
    dropped_tokens: int
    kept_tokens: int  # on a node still locked: a running request's prefix, or a copy outlasting the wait
    copies_waited_for: int  # copies in flight when the flush was asked
    copies_in_flight: int  # copies still in flight when it ran

    @property
    def complete(self) -> bool:
        return self.kept_tokens == 0
