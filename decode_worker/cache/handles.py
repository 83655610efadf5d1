"""What a caller of the cache holds: a ``MatchResult`` (read-only), a ``LoadHandle`` (a locked prefix and its
pages) and the ``LoadBackError`` its ``wait`` raises. The cache's own bookkeeping lives in the other modules.

Page ids are int64 numpy arrays here as everywhere in the cache (``pool.page_ids`` says why)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from decode_worker.cache.radix_tree import Key, TreeNode

if TYPE_CHECKING:
    from decode_worker.cache.hicache import HierarchicalCache
    from decode_worker.cache.tiers import PendingCopy

NO_PAGES = np.empty(0, dtype=np.int64)


def cat_pages(parts: list[np.ndarray]) -> np.ndarray:
    """Page arrays end to end (no copy for one part; an empty array for none)."""
    return parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else NO_PAGES


class LoadBackError(RuntimeError):
    """An L2->L1 copy this request depends on failed or was cancelled; its prefix is not usable."""


@dataclass
class MatchResult:
    """Read-only prefix match: what is on L1, what can be restored from L2, and where the match stopped."""

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


@dataclass(eq=False)
class LoadHandle:
    """A locked prefix, its pending load-back and the request's delta pages."""

    cache: HierarchicalCache
    node: TreeNode  # deepest locked node (the root when nothing matched)
    device_indices: np.ndarray  # L1 pages of the whole prefix; valid once wait() returns
    delta_pages: np.ndarray  # pages allocated for the rest of the request, owned by the handle
    device_hit_tokens: int
    restored_tokens: int
    waits: list[PendingCopy]
    released: bool = False

    @property
    def prefix_tokens(self) -> int:
        return len(self.device_indices) * self.cache.page_size

    def ready(self) -> bool:
        self.cache.poll()
        return all(op.ok is not None for op in self.waits)

    async def wait(self) -> None:
        """Until every copy the prefix depends on has finished; raises LoadBackError if one failed."""
        if self.waits:
            done, _ = await asyncio.wait([asyncio.wrap_future(op.future) for op in self.waits])
            for f in done:
                if not f.cancelled():
                    f.exception()  # retrieved so asyncio does not log it; reported below as LoadBackError
            self.cache.poll()  # copies finish in order, so everything up to ours is done
        if not all(op.ok for op in self.waits):
            raise LoadBackError(f"load-back of a {self.prefix_tokens}-token prefix failed")

    def take_pages(self) -> np.ndarray:
        """Prefix pages followed by the delta pages; the delta pages now belong to the caller (for insert)."""
        prefix, delta = self.device_indices, self.delta_pages
        pages = np.concatenate((prefix, delta)) if len(prefix) else delta  # a miss: the delta is all the caller's
        self.delta_pages = NO_PAGES
        return pages
