"""Hierarchical radix KV cache: one radix tree over an L1 (device) and an optional L2 (host) page pool.

A request uses it in two phases so that the budget is checked before anything moves:

    key = token_key(prompt_ids)                    # once per request (match and insert both take it)
    m = cache.match(key)                           # read-only: L1 hit, L2 hit, nodes to restore
    h = cache.load_back_and_lock(m, extra_pages=n) # one eviction batch, lock, start L2->L1, pages for the delta
    ...receive the delta KV into h.delta_pages...
    await h.wait()                                 # load-back finished; raises LoadBackError if it failed
    h, pages = cache.cache_in_flight(h, computed_ids, pages)  # optional, while running: share computed pages now
    ...decode, taking more pages with cache.alloc_device...
    cache.insert(token_key(all_ids), pages)        # on finish or retraction; pages = h.take_pages() + decode's
    cache.release(h)                               # unlock; frees whatever the handle still owns

``release`` is also the abort path: before ``take_pages`` it frees the delta pages with the lock, so an aborted
request gives back exactly what it took. A load-back it started is not cancelled (another request may already
share the restored nodes): the copy holds its own lock, finishes, and drops that lock at the next ``poll``.

With an L3 ``StorageTier``, a request first looks up what lies past its L1 + L2 hit (``storage_keys``), takes L2
pages for it (``alloc_host``), lets the tier prefetch into them, and hands the pages that arrived to
``insert_host``, which hangs them under the matched path as host-only nodes; the two phases above then restore
them to L1. Pages reach L3 after they reach L2: each successful L1->L2 copy queues an L2->L3 backup of its nodes
(all of them, or under ``hit_twice`` those hit at least twice; a node already on L2 is queued on its second hit).

Tiers per node: device-only, device+host, host-only. Device nodes are closed under ancestors (a parent is on
device when a child is). A node that loses its last tier is removed with its subtree; a locked one (a gap) stays,
unmatched, with whatever hangs below it, until its last unlock drops them. Copies run on the ``CopyEngine`` in
submission order; each pending copy holds a lock on the nodes it reads or writes, so neither tier can free pages
under a running copy.

The work is split by job: ``handles`` (what a caller holds), ``tiers`` (L1/L2 pages and the copies between them),
``eviction`` (victims and eviction batches), ``l3`` (the L3 glue) and ``stats`` (what the cache reports). The
last three are mixins of ``HierarchicalCache``, which keeps all the state (``__init__``) and the request flows.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections import deque
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from decode_worker.cache.copy_engine import CopyEngine
from decode_worker.cache.eviction import EvictionMixin, rank_key
from decode_worker.cache.handles import NO_PAGES, LoadBackError, LoadHandle, MatchResult, cat_pages
from decode_worker.cache.l3 import StorageMixin
from decode_worker.cache.pool import KVPool, PageAllocator, PageIds, page_ids
from decode_worker.cache.radix_tree import Key, RadixTree, Tokens, TreeNode, token_key
from decode_worker.cache.stats import CacheCounters, CacheStats, TierPages
from decode_worker.cache.tiers import SELECTIVE_HITS, PendingCopy, TierMixin
from decode_worker.core.policies import EvictionPolicy, StorageBackup, WritePolicy

if TYPE_CHECKING:
    from decode_worker.cache.storage.tier import StorageTier

__all__ = ["FlushOutcome", "HierarchicalCache", "LoadBackError", "LoadHandle", "MatchResult"]

P = TypeVar("P", bound=StrEnum)


def parse_policy(cls: type[P], value: str, what: str) -> P:
    """``cls(value)``, raising ValueError naming ``what``, the value and the choices."""
    try:
        return cls(value)
    except ValueError:
        raise ValueError(f"{what} {value!r} not in {tuple(m.value for m in cls)}") from None


@dataclass(frozen=True)
class FlushOutcome:
    """What ``flush_settled`` dropped and what stayed cached."""

    dropped_tokens: int
    kept_tokens: int  # on a node still locked: a running request's prefix, or a copy outlasting the wait
    copies_waited_for: int  # copies in flight when the flush was asked
    copies_in_flight: int  # copies still in flight when it ran

    @property
    def complete(self) -> bool:
        return self.kept_tokens == 0


class HierarchicalCache(TierMixin, EvictionMixin, StorageMixin):
    """Radix tree + L1/L2 allocators + copy engine + write policy. Called from the event loop only."""

    def __init__(
        self,
        device_pool: KVPool,
        host_pool: KVPool | None = None,
        *,
        write_policy: str = WritePolicy.WRITE_THROUGH,
        eviction: str = EvictionPolicy.SLRU,
        hash_seed: str | None = None,
        engine: CopyEngine | None = None,
        storage: StorageTier | None = None,
        storage_backup_policy: str = StorageBackup.ALL,
    ):
        self.write_policy = parse_policy(WritePolicy, write_policy, "write policy")
        self.eviction = parse_policy(EvictionPolicy, eviction, "eviction policy")
        self.storage_backup_policy = parse_policy(StorageBackup, storage_backup_policy, "storage backup policy")
        if storage is not None and host_pool is None:
            raise ValueError("L3 storage moves pages through L2: it needs a host pool")
        self.page_size = device_pool.page_size
        seed = device_pool.layout.fingerprint() if hash_seed is None else hash_seed
        self.tree = RadixTree(self.page_size, seed, rank=rank_key(self.eviction))
        self.device_alloc = PageAllocator(device_pool.num_pages, reserved=1)  # page 0: scratch
        self.host_pool = host_pool
        self.host_alloc = PageAllocator(host_pool.num_pages) if host_pool is not None else None
        self.storage = storage
        self._host_out = 0  # L2 pages handed out by alloc_host, not yet attached or freed
        if host_pool is not None and engine is None:
            engine = CopyEngine(device_pool.buffer, host_pool.buffer)
        self.engine = engine
        self.counters = CacheCounters()
        self._pending: deque[PendingCopy] = deque()
        self._draining = 0  # L1 pages that pending copies free when done
        self._demoting: PendingCopy | None = None  # write_back victims of the eviction batch under way

    # -- matching ---------------------------------------------------------------------------------------------

    def match(self, tokens: Tokens) -> MatchResult:
        """Longest cached prefix over L1 then L2, stopping at the first gap. Changes nothing."""
        key = token_key(tokens)
        tree = self.tree
        path, tail = tree.match(key)
        ps, last = self.page_size, len(path) - 1
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
            else:  # a gap (a node losing its last tier while locked)
                path, tail = path[:i], (tree.num_pages(path[i - 1]) if i else 0)
                break
        return MatchResult(
            key=key,
            path=path,
            tail_pages=tail,
            device_hit_tokens=device_pages * ps,
            host_hit_tokens=host_pages * ps,
            device_indices=cat_pages(dev_parts),
            restore_nodes=restore,
            version=self.tree.version,
        )

    def load_back_and_lock(self, match: MatchResult, extra_pages: int = 0) -> LoadHandle:
        """Lock the matched path, allocate L1 pages for the restore plus ``extra_pages`` (evicting in one batch),
        and start the L2->L1 copy. Raises OutOfPages (or anything else) having taken nothing. The handle's prefix
        plus delta pages always come to ``match``'s hit plus ``extra_pages``, even when the match is redone.

        Finished copies are applied first, and the match is redone if the tree changed since it was taken: a
        failed load or demotion applied later, in the middle of this call, would change tiers it already chose.
        """
        self.poll()
        if match.version != self.tree.version:
            stale, match = match, self.match(match.key)
            extra_pages += (stale.hit_tokens - match.hit_tokens) // self.page_size  # the same pages in all
        path = list(match.path)
        if path and match.tail_pages < self.tree.num_pages(path[-1]):
            path[-1] = self._split(path[-1], match.tail_pages)
        last = path[-1] if path else self.tree.root
        restore = [n for n in path if n.device_indices is None]
        n_restore = sum(len(n.key) for n in restore) // self.tree.page_bytes if restore else 0
        self.tree.lock(last)
        pages = None
        try:
            pages = self._alloc_device(n_restore + extra_pages)
            if restore:
                self._start_load(restore, pages[:n_restore])
        except BaseException:
            if pages is not None:
                self.device_alloc.free(pages)
            self.tree.unlock(last)
            raise
        waits = list({n.loading: None for n in path if n.loading is not None}) if self._pending else []
        self.tree.touch(last, hit=bool(path))
        self.counters.cached_device += match.device_hit_tokens
        self.counters.cached_host += n_restore * self.page_size
        if self.write_policy == WritePolicy.WRITE_THROUGH_SELECTIVE:
            self._backup(n for n in path if n.hit_count >= SELECTIVE_HITS)
        self._store_on_hit(path)  # hit_twice: nodes on L2 hit for the 2nd time go to L3
        return LoadHandle(
            cache=self,
            node=last,
            # the path is locked: its L1 pages are still the match's, then the restored ones
            device_indices=cat_pages([match.device_indices, pages[:n_restore]]) if restore else match.device_indices,
            delta_pages=pages[n_restore:] if restore else pages,
            device_hit_tokens=match.device_hit_tokens,
            restored_tokens=n_restore * self.page_size,
            waits=waits,
        )

    def release(self, handle: LoadHandle) -> None:
        """Unlock the handle's prefix and free the pages it still owns (success, failure and abort alike)."""
        if handle.released:
            raise RuntimeError("LoadHandle released twice")
        handle.released = True
        self.device_alloc.free(handle.delta_pages)
        handle.delta_pages = NO_PAGES
        self.tree.unlock(handle.node)
        self._prune_gap_above(handle.node)
        self.poll()

    # -- insertion ----------------------------------------------------------------------------------------------

    def insert(self, tokens: Tokens, device_pages: PageIds, *, backup: bool = False) -> int:
        """Cache the full pages of ``tokens``; returns how many tokens were already cached on L1.

        The tree takes ``device_pages[:full pages]``: pages for the new part are kept, pages that duplicate
        cached data are freed, and an evicted (host-only) node on the path is revived with the given pages,
        keeping its host copy. Pages past the last full page stay with the caller. ``backup`` backs the path up
        to L2 now whatever the policy (a retracted request). The pages past a node whose load-back is still in
        flight are freed, not grafted below it.
        """
        key, device_pages = token_key(tokens), page_ids(device_pages)
        n = len(key) // self.tree.page_bytes
        if len(device_pages) < n:
            raise ValueError(f"{n} full pages of tokens, got {len(device_pages)} pages")
        _, pos, cached, _ = self._graft(key, device_pages, n, backup=backup, exact=False)
        if pos < n:
            self.device_alloc.free(device_pages[pos:n])
        return cached * self.page_size

    def cache_in_flight(self, handle: LoadHandle, tokens: Tokens, pages: PageIds) -> tuple[LoadHandle, np.ndarray]:
        """Share a running request's computed full pages through the tree, so concurrent requests hit them now.

        ``tokens``: the tokens whose KV is computed (their full pages count); ``pages``: the request's pages, the
        handle's prefix first (after ``take_pages``). Like ``insert``, except that the pages past a node whose
        load-back is in flight stay with the request, and the lock moves to the new deepest node. Returns the new
        handle (the old one is spent) and the request's new page list: tree pages for the cached prefix (the
        tree's copy replaces a duplicate, which is freed; same tokens, same KV), then the rest of ``pages``.
        """
        if handle.released or len(handle.delta_pages):
            raise ValueError("cache_in_flight needs a live handle whose delta pages were taken")
        key, pages = token_key(tokens), page_ids(pages)
        n, old = len(key) // self.tree.page_bytes, len(handle.device_indices)
        if len(pages) < n:
            raise ValueError(f"{n} full pages of tokens, got {len(pages)} pages")
        if n <= old:
            return handle, pages
        node, pos, _, parts = self._graft(key, pages, n, backup=False, exact=True)
        if pos <= old:  # a load-back in flight right past the prefix: nothing changed
            return handle, pages
        self.tree.lock(node)  # a descendant of handle.node: the prefix stays locked throughout
        self.tree.unlock(handle.node)
        handle.released = True
        tree_pages = cat_pages(parts)
        new = LoadHandle(self, node, tree_pages, NO_PAGES, handle.device_hit_tokens, handle.restored_tokens, [])
        return new, np.concatenate((tree_pages, pages[pos:]))

    def _graft(
        self, key: Key, pages: np.ndarray, n: int, *, backup: bool, exact: bool
    ) -> tuple[TreeNode, int, int, list[np.ndarray]]:
        """Put ``pages[:n]`` (one per whole page of ``key``, which has ``n``) into the tree along ``key``, stopping
        at a node whose L1 data is still arriving. Pages duplicating L1 data are freed; ``exact`` splits a node
        that ``key`` ends inside, so that the returned node ends where the grafted part does.

        Returns the deepest node reached, the number of pages grafted, how many of them were already on L1, and
        (with ``exact``) the tree's L1 pages for them, in parts end to end.
        """
        tree = self.tree
        path, tail = tree.match(key)
        node, pos, cached, dup, kept, tree_pages = tree.root, 0, 0, [], [], []
        last = len(path) - 1
        for i, child in enumerate(path):
            if child.loading is not None:
                break  # its L1 data is still arriving: nothing is grafted below it
            size = tree.num_pages(child)
            k = tail if i == last else size
            if k < size and (exact or pos + k < n or child.device_indices is None):
                child = self._split(child, k)  # now ``k`` pages long
            held = child.device_indices
            if held is not None:
                held = held if k == len(held) else held[:k]
                mine = pages[pos : pos + k]
                if mine.tobytes() != held.tobytes():  # usually equal: the request got its prefix from this node
                    dup.append(mine[mine != held])
                cached += k
            else:
                tree.set_device(child, pages[pos : pos + k])
            if exact:
                tree_pages.append(child.device_indices)  # exactly ``k`` pages: ``exact`` split it
            kept.append(child)
            node, pos = child, pos + k
        else:
            if pos < n:
                pb = self.tree.page_bytes
                node = self.tree.add_child(node, key[pos * pb : n * pb], pages[pos:n])
                tree_pages.append(node.device_indices)
                kept.append(node)
                pos = n
        if dup:
            self.device_alloc.free(cat_pages(dup))
        self.tree.touch(node)
        if backup or self.write_policy == WritePolicy.WRITE_THROUGH:
            self._backup(kept)
        return node, pos, cached, tree_pages

    # -- flushing -----------------------------------------------------------------------------------------------------

    def flush(self) -> int:
        """Drop every unlocked node from both tiers (POST /flush_cache); returns the tokens dropped."""
        self.poll()
        root = self.tree.root
        tops = [n for n in self.tree.nodes() if n.lock_ref == 0 and (n.parent is root or n.parent.lock_ref > 0)]
        dropped = sum(m.num_tokens for n in tops for m in self.tree.subtree(n))
        for node in tops:
            self._drop(node)
        if self.tree.events is not None and not root.children:  # nothing was locked: every tier is empty
            self.tree.events.cleared()
        return dropped

    async def flush_settled(self, timeout_s: float) -> FlushOutcome:
        """``flush`` once the copies in flight have finished, waiting at most ``timeout_s``: a backup holds a lock
        on the nodes it reads until it is applied, so a flush right after a response would keep the prefix it
        just cached. Says what stayed: prefixes running requests hold, and nodes behind copies still running."""
        waited_for = len(self._pending)
        if self._pending:
            await asyncio.wait([asyncio.wrap_future(op.future) for op in self._pending], timeout=timeout_s)
        dropped = self.flush()
        kept = sum(n.num_tokens for n in self.tree.nodes())
        return FlushOutcome(dropped, kept, waited_for, len(self._pending))

    # -- observability ------------------------------------------------------------------------------------------------

    def stats(self) -> CacheStats:
        """Pages per tier and state (free + used + evictable + locked = total), token counters per tier, and the
        L3 tier's figures; ``CacheStats.to_dict()`` is the ``cache`` object of ``/server_info``."""
        tree, dev = self.tree, self.device_alloc
        locked = tree.locked_device_pages
        device = TierPages(total=dev.total, free=dev.num_free, used=dev.num_used - tree.device_pages,
                           evictable=tree.device_pages - locked, locked=locked)
        host = None
        if self.host_alloc is not None:
            h_locked, h_evictable = tree.locked_host_pages, tree.host_only_pages
            h = self.host_alloc
            host = TierPages(total=h.total, free=h.num_free, used=h.num_used - h_locked - h_evictable,
                             evictable=h_evictable, locked=h_locked)
        storage = self.storage.stats() if self.storage is not None else None
        return CacheStats(device=device, tokens=dataclasses.replace(self.counters), host=host, storage=storage)
