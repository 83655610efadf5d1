"""The hierarchical radix KV cache: the one class that decides what each node holds."""
from __future__ import annotations

import asyncio
from collections.abc import Iterable
from concurrent.futures import wait as wait_futures

import numpy as np

from decode_worker.cache.accounting import CacheAccounting
from decode_worker.cache.allocation import Allocation
from decode_worker.cache.copies import CopiesInFlight, PendingCopy
from decode_worker.cache.copy_engine import CopyEngine, PageCopier
from decode_worker.cache.handles import FlushOutcome, LoadBackError, LoadHandle, MatchResult, match_prefix
from decode_worker.cache.node import Key, Tokens, TreeNode, token_key
from decode_worker.cache.pool import NO_PAGES, KVPool, PageIds, cat_pages, page_ids
from decode_worker.cache.radix_tree import RadixTree
from decode_worker.cache.stats import CacheStats
from decode_worker.cache.storage.link import StorageLink
from decode_worker.cache.storage.tier import StorageTier
from decode_worker.cache.strategy import WriteStrategy, eviction_order
from decode_worker.cache.tier_moves import TierMoves
from decode_worker.core.policies import EvictionPolicy, StorageBackup, WritePolicy, parse_policy

__all__ = ["FlushOutcome", "HierarchicalCache", "LoadBackError", "LoadHandle", "MatchResult"]


class HierarchicalCache:
    """Match, insert, lock, evict and move tiers over the parts it composes. Event loop only."""

    def __init__(
        self,
        device_pool: KVPool,
        host_pool: KVPool | None = None,
        *,
        write_policy: str = WritePolicy.WRITE_THROUGH,
        eviction: str = EvictionPolicy.SLRU,
        hash_seed: str | None = None,
        engine: PageCopier | None = None,
        storage: StorageTier | None = None,
        storage_backup_policy: str = StorageBackup.ALL,
    ):
        self.write_policy = parse_policy(WritePolicy, write_policy, "write policy")
        self.writes = WriteStrategy(self.write_policy, has_host=host_pool is not None)
        self.order = eviction_order(parse_policy(EvictionPolicy, eviction, "eviction policy"))
        backup_policy = parse_policy(StorageBackup, storage_backup_policy, "storage backup policy")
        if storage is not None and host_pool is None:
            raise ValueError("L3 storage moves pages through L2: it needs a host pool")
        self.page_size = device_pool.page_size
        seed = device_pool.layout.fingerprint() if hash_seed is None else hash_seed
        self.tree = RadixTree(self.page_size, seed, rank=self.order.rank)
        self.pages = Allocation(device_pool.num_pages, host_pool.num_pages if host_pool is not None else None)
        self.device_alloc, self.host_alloc = self.pages.device, self.pages.host
        self.eviction, self.storage = self.order.policy, storage
        self.host_pool = host_pool
        self.l3 = StorageLink(storage, host_pool, backup_policy) if storage is not None else None
        if host_pool is not None and engine is None:
            engine = CopyEngine(device_pool.buffer, host_pool.buffer)
        self.engine = engine
        self.copies = CopiesInFlight()
        self.figures = CacheAccounting(self.tree, self.pages, self.copies, storage)
        self.counters = self.figures.counters
        self.moves = TierMoves(self.tree, self.pages, self.copies, engine, self.counters)
        self._demoting: PendingCopy | None = None  # write_back victims of the eviction batch under way

    # -- matching and locking -------------------------------------------------------------------------------------

    def match(self, tokens: Tokens) -> MatchResult:
        """Longest cached prefix, L1 then L2, to the first gap. Read-only."""
        return match_prefix(self.tree, token_key(tokens))

    def load_back_and_lock(self, match: MatchResult, extra_pages: int = 0) -> LoadHandle:
        """Lock the path, take L1 pages for the restore plus ``extra_pages``, start the load-back (OutOfPages
        takes nothing). A stale match is redone."""
        self.poll()
        if match.version != self.tree.version:
            stale, match = match, self.match(match.key)
            extra_pages += (stale.hit_tokens - match.hit_tokens) // self.page_size  # the same pages in all
        path = list(match.path)
        if path and match.tail_pages < self.tree.num_pages(path[-1]):
            path[-1] = self._split(path[-1], match.tail_pages)
        last = path[-1] if path else self.tree.root
        restore = [n for n in path if n.device_indices is None]
        n_restore = sum(self.tree.num_pages(n) for n in restore)
        self.tree.lock(last)
        pages = None
        try:
            pages = self._alloc_device(n_restore + extra_pages)
            if restore:
                self.moves.load(restore, pages[:n_restore])
        except BaseException:
            if pages is not None:
                self.device_alloc.free(pages)
            self.tree.unlock(last)
            raise
        waits = list({n.loading: None for n in path if n.loading is not None}) if self.copies else []
        self.tree.touch(last, hit=bool(path))
        self.counters.cached_device += match.device_hit_tokens
        self.counters.cached_host += n_restore * self.page_size
        self._backup(n for n in path if self.writes.on_hit(n.hit_count))
        if self.l3 is not None:  # under hit_twice: nodes on L2 hit for the 2nd time go to L3
            self._store(n for n in path if n.on_host and n.saving is None and self.l3.on_hit(n.hit_count))
        # the path is locked: its L1 pages are still the match's, then the restored ones
        prefix = cat_pages([match.device_indices, pages[:n_restore]]) if restore else match.device_indices
        return self._handle(last, prefix, pages[n_restore:], match.device_hit_tokens, n_restore * self.page_size,
                            waits)

    def _handle(self, node: TreeNode, prefix: np.ndarray, delta: np.ndarray, device_hit: int, restored: int,
                waits: list[PendingCopy]) -> LoadHandle:
        return LoadHandle(node, prefix, delta, device_hit, restored, waits, self.page_size, settle=self.poll)

    def release(self, handle: LoadHandle) -> None:
        """Unlock the prefix; free the pages the handle still owns."""
        if handle.released:
            raise RuntimeError("LoadHandle released twice")
        handle.released = True
        self.device_alloc.free(handle.delta_pages)
        handle.delta_pages = NO_PAGES
        self.tree.unlock(handle.node)
        self.moves.prune_gap_above(handle.node)
        self.poll()

    # -- insertion --------------------------------------------------------------------------------------------------

    def insert(self, tokens: Tokens, device_pages: PageIds, *, backup: bool = False) -> int:
        """The tree takes the full pages' ``device_pages`` (duplicates freed); returns tokens already on L1.
        ``backup``: to L2 regardless of policy."""
        key, device_pages = token_key(tokens), page_ids(device_pages)
        n = len(key) // self.tree.page_bytes
        if len(device_pages) < n:
            raise ValueError(f"{n} full pages of tokens, got {len(device_pages)} pages")
        _, pos, cached, _ = self._graft(key, device_pages, n, backup=backup, exact=False)
        if pos < n:
            self.device_alloc.free(device_pages[pos:n])
        return cached * self.page_size

    def cache_in_flight(self, handle: LoadHandle, tokens: Tokens, pages: PageIds) -> tuple[LoadHandle, np.ndarray]:
        """``insert`` for a running request; returns its new handle (the old one is spent) and pages."""
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
        new = self._handle(node, tree_pages, NO_PAGES, handle.device_hit_tokens, handle.restored_tokens, [])
        return new, np.concatenate((tree_pages, pages[pos:]))

    def _graft(
        self, key: Key, pages: np.ndarray, n: int, *, backup: bool, exact: bool
    ) -> tuple[TreeNode, int, int, list[np.ndarray]]:
        """Graft ``pages[:n]`` along ``key`` up to a load-back in flight (``exact``: split at its end); returns
        (deepest node, pages grafted, pages already on L1, the tree's pages if ``exact``)."""
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
                node = tree.add_child(node, key[pos * tree.page_bytes : n * tree.page_bytes], pages[pos:n])
                tree_pages.append(node.device_indices)
                kept.append(node)
                pos = n
        if dup:
            self.device_alloc.free(cat_pages(dup))
        tree.touch(node)
        if self.writes.on_insert(forced=backup):
            self._backup(kept)
        return node, pos, cached, tree_pages

    # -- L1 and L2 pages --------------------------------------------------------------------------------------------

    def alloc_device(self, n: int) -> np.ndarray:
        """``n`` L1 pages, evicting if needed; OutOfPages takes nothing."""
        self.poll()  # finished copies unlock nodes and return drained pages
        return self._alloc_device(n)

    def _alloc_device(self, n: int) -> np.ndarray:
        short = self.pages.device_short(n)
        if short > 0:
            self.evict_device(short)
        return self.pages.take_device(n, locked=self.tree.locked_device_pages)

    def free_device(self, pages: PageIds) -> None:
        """Return request-owned L1 pages never inserted."""
        self.device_alloc.free(pages)

    def available_device_pages(self) -> int:
        return self.figures.available_device_pages()

    def pages_soon_free(self) -> int:
        return self.figures.pages_soon_free()

    def _alloc_host(self, n: int) -> np.ndarray | None:
        """``n`` L2 pages, evicting only if that makes room; else None."""
        if self.host_alloc is None:
            return None
        short = self.pages.host_short(n)
        if short > 0:
            if short > self._host_evictable_pages():
                return None  # evicting could not make room: keep L2 as it is
            self.evict_host(short)
        return self.pages.take_host(n)

    # -- L3 ---------------------------------------------------------------------------------------------------------

    def storage_keys(self, match: MatchResult) -> list[str]:
        """L3 keys of the whole pages past the match's hit."""
        last = match.path[-1] if match.path else None
        return self.tree.hashes_past(match.key, last, match.tail_pages, match.hit_tokens // self.page_size)

    def alloc_host(self, n: int) -> np.ndarray | None:
        """``n`` L2 pages lent to a prefetch until ``insert_host`` or ``free_host``, or None."""
        pages = self._alloc_host(n)
        if pages is not None:
            self.pages.lend_host(pages)
        return pages

    def free_host(self, pages: PageIds) -> None:
        self.pages.return_host(pages)

    def insert_host(self, tokens: Tokens, host_pages: PageIds, from_page: int) -> range:
        """Hang prefetched pages ``from_page, ...`` of ``tokens`` as a host-only node, freeing those cached
        by now; returns the page indices it holds."""
        key, host_pages = token_key(tokens), page_ids(host_pages)
        tree, pb = self.tree, self.tree.page_bytes
        end = from_page + len(host_pages)
        if end * pb > len(key):
            raise ValueError(f"pages up to {end} of a {len(key) // pb}-page key")
        parent, have, cut = tree.attach_point(key[: end * pb])
        start = max(have, from_page)
        if have < from_page or start >= end:
            self.free_host(host_pages)
            return range(0)
        self.free_host(host_pages[: start - from_page])
        if cut is not None:
            parent = self._split(*cut)
        tree.add_host_child(parent, key[start * pb : end * pb], host_pages[start - from_page :])
        self.pages.attach_host(end - start)
        return range(start, end)

    def _store(self, nodes: Iterable[TreeNode]) -> None:
        nodes = list(nodes)
        keys = [k for n in nodes for k in self.tree.page_hashes(n)]
        self.l3.store(keys, cat_pages([n.host_indices for n in nodes]))

    # -- copies -----------------------------------------------------------------------------------------------------

    def _backup(self, nodes: Iterable[TreeNode]) -> None:
        """One L1 -> L2 copy of the L1-only nodes, if L2 has room."""
        nodes = [n for n in nodes if n.on_device and not n.on_host and n.saving is None]
        if nodes and (host := self._alloc_host(sum(self.tree.num_pages(n) for n in nodes))) is not None:
            self.moves.backup(nodes, host)

    def _split(self, node: TreeNode, pages: int) -> TreeNode:
        """Split ``node``; its copies write the head too."""
        head = self.tree.split(node, pages)
        self.copies.follow_split(node, head)
        return head

    def poll(self) -> int:
        """Apply finished copies, each after its dependencies; returns how many."""
        done = 0
        for op in self.copies.finished():
            ok = not op.failed()
            if ok and op.kind == "backup" and self.l3 is not None:  # on to L3, as the storage backup policy says
                self._store(n for n in op.nodes if self.l3.after_backup(n.hit_count))
            self.moves.settle(op, ok)
            done += 1
        return done

    @property
    def busy(self) -> bool:
        return bool(self.copies)

    def drain(self) -> None:
        """Apply every copy, blocking: never on the loop."""
        while self.copies:
            wait_futures(self.copies.futures())
            self.poll()

    def close(self) -> None:
        self.drain()
        if self.engine is not None:
            self.engine.close()

    # -- eviction ---------------------------------------------------------------------------------------------------

    def evict_device(self, n_pages: int) -> int:
        """Release at least ``n_pages`` L1 pages (exactly under SLRU) in one batch; returns how many."""
        tree = self.tree
        write_back = self.writes.demotes
        demote = PendingCopy("backup", nodes=[], locked=[]) if write_back else None
        cut_tails = self.order.partial and not write_back  # a tail would leave the tree
        old_pages, freed, released = [], [], 0
        self._demoting = demote
        try:
            while released < n_pages and (node := tree.device_leaves.pop()) is not None:
                need, k = n_pages - released, tree.num_pages(node)
                if cut_tails and need < k and (tail := tree.cut_device_tail(node, k - need)) is not None:
                    freed.append(tail)  # the usual SLRU victim: a leaf only on L1 that keeps its head
                    self.counters.evicted_device += need * self.page_size
                    released += need
                    continue
                node = self._trim(node, need)
                k = tree.num_pages(node)
                if node.on_host:
                    freed.append(tree.clear_device(node))
                elif write_back and (host := self._alloc_host(k)) is not None:
                    old_pages.append(tree.clear_device(node))
                    tree.set_host(node, host)
                    node.saving = demote  # keeps evict_host off it until the copy is queued and locks it
                    tree.refresh(node)
                    demote.nodes.append(node)
                else:
                    self.moves.drop(node, freed)
                self.counters.evicted_device += k * self.page_size
                released += k
        finally:
            self._demoting = None
            self.device_alloc.free(cat_pages(freed))  # one batch: the allocator's checks run once
        if old_pages:
            self.moves.demote(demote, old_pages)
        return released

    def evict_host(self, n_pages: int) -> int:
        """Free at least ``n_pages`` L2 pages (exactly under SLRU)."""
        freed = 0
        while freed < n_pages and (node := self.tree.host_leaves.pop()) is not None:
            node = self._trim(node, n_pages - freed)
            freed += self.tree.num_pages(node)
            self.moves.drop(node)
        return freed

    def _trim(self, node: TreeNode, need: int) -> TreeNode:
        """The part of victim ``node`` given up for ``need`` pages."""
        k = self.tree.num_pages(node)
        give = self.order.pages_to_give(k, need)
        if give < k:
            self._split(node, k - give)
        return node

    def _host_evictable_pages(self) -> int:
        return self.figures.host_evictable_pages(self._demoting.nodes if self._demoting is not None else ())

    # -- flushing and figures ---------------------------------------------------------------------------------------

    def flush(self) -> int:
        """Drop every unlocked node; returns the tokens dropped."""
        self.poll()
        tops = self.tree.unlocked_tops()
        dropped = sum(m.num_tokens for n in tops for m in self.tree.subtree(n))
        for node in tops:
            self.moves.drop(node)
        if self.tree.events is not None and not self.tree.root.children:  # nothing was locked: every tier is empty
            self.tree.events.cleared()
        return dropped

    async def flush_settled(self, timeout_s: float) -> FlushOutcome:
        """``flush`` once the copies in flight land, or after ``timeout_s``."""
        waited_for = len(self.copies)
        if self.copies:
            await asyncio.wait([asyncio.wrap_future(f) for f in self.copies.futures()], timeout=timeout_s)
        dropped = self.flush()
        kept = sum(n.num_tokens for n in self.tree.nodes())
        return FlushOutcome(dropped, kept, waited_for, len(self.copies))

    def stats(self) -> CacheStats:
        return self.figures.stats()
