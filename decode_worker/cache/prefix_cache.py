"""The scheduler's view of the cache, and ``NoPrefixReuse`` for a worker without reuse."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, TypeGuard

import numpy as np

from decode_worker.cache.handles import LoadHandle, MatchResult
from decode_worker.cache.hicache import HierarchicalCache
from decode_worker.cache.node import Tokens, token_key
from decode_worker.cache.pool import KVPool, PageAllocator, PageIds, page_ids
from decode_worker.core.sequence import TOKEN_BYTES

if TYPE_CHECKING:
    from decode_worker.cache.storage.tier import StorageTier


class PrefixCache(Protocol):
    """The scheduler's view of the cache."""

    @property
    def storage(self) -> StorageTier | None: ...

    @property
    def device_alloc(self) -> PageAllocator: ...

    @property
    def busy(self) -> bool: ...

    def match(self, tokens: Tokens) -> MatchResult: ...

    def load_back_and_lock(self, match: MatchResult, extra_pages: int = 0) -> LoadHandle: ...

    def cache_in_flight(self, handle: LoadHandle, tokens: Tokens, pages: PageIds) -> tuple[LoadHandle, np.ndarray]: ...

    def insert(self, tokens: Tokens, device_pages: PageIds, *, backup: bool = False) -> int: ...

    def release(self, handle: LoadHandle) -> None: ...

    def alloc_device(self, n: int) -> np.ndarray: ...

    def free_device(self, pages: PageIds) -> None: ...

    def available_device_pages(self) -> int: ...

    def pages_soon_free(self) -> int: ...

    def poll(self) -> int: ...


class PrefetchCache(PrefixCache, Protocol):
    """What the L3 lookahead uses besides."""

    @property
    def storage(self) -> StorageTier: ...

    @property
    def host_pool(self) -> KVPool | None: ...

    def storage_keys(self, match: MatchResult) -> list[str]: ...

    def alloc_host(self, n: int) -> np.ndarray | None: ...

    def free_host(self, pages: PageIds) -> None: ...

    def insert_host(self, tokens: Tokens, host_pages: PageIds, from_page: int) -> range: ...


def has_storage(cache: PrefixCache) -> TypeGuard[PrefetchCache]:
    
    return cache.storage is not None


class NoPrefixReuse:
    """Matches nothing and frees what it would insert; the rest goes to the wrapped cache."""

    storage = None  # L3 storage needs the radix cache (the flags say so)

    def __init__(self, cache: HierarchicalCache):
        self.cache = cache

    @property
    def device_alloc(self) -> PageAllocator:
        return self.cache.device_alloc

    @property
    def busy(self) -> bool:
        return self.cache.busy

    def match(self, tokens: Tokens) -> MatchResult:
        return self.cache.match([])

    def load_back_and_lock(self, match: MatchResult, extra_pages: int = 0) -> LoadHandle:
        return self.cache.load_back_and_lock(match, extra_pages)

    def cache_in_flight(self, handle: LoadHandle, tokens: Tokens, pages: PageIds) -> tuple[LoadHandle, np.ndarray]:
        return handle, page_ids(pages)  # nothing is shared: the request keeps its pages

    def insert(self, tokens: Tokens, device_pages: PageIds, *, backup: bool = False) -> int:
        """Free the pages ``HierarchicalCache.insert`` would take."""
        full = len(token_key(tokens)) // TOKEN_BYTES // self.cache.page_size
        self.cache.free_device(device_pages[:full])
        return 0

    def release(self, handle: LoadHandle) -> None:
        self.cache.release(handle)

    def alloc_device(self, n: int) -> np.ndarray:
        return self.cache.alloc_device(n)

    def free_device(self, pages: PageIds) -> None:
        self.cache.free_device(pages)

    def available_device_pages(self) -> int:
        return self.cache.available_device_pages()

    def pages_soon_free(self) -> int:
        return self.cache.pages_soon_free()

    def poll(self) -> int:
        return self.cache.poll()
