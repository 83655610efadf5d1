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
"""
from __future__ import annotations

import asyncio
import heapq
from collections import deque
from concurrent.futures import Future, wait as wait_futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

import torch

from decode_worker.cache.copy_engine import CopyEngine
from decode_worker.cache.pool import KVPool, OutOfPages, PageAllocator
from decode_worker.cache.radix_tree import Key, RadixTree, Tokens, TreeNode, chain_hashes, token_key

if TYPE_CHECKING:
    from decode_worker.cache.storage.tier import StorageTier

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
EVICTION_POLICIES = ("lru", "lfu")
STORAGE_BACKUP_POLICIES = ("all", "hit_twice")  # which L2 pages are also backed up to L3
SELECTIVE_HITS = 2  # write_through_selective backs a node up on its second hit; so does hit_twice to L3

_NO_PAGES = torch.empty(0, dtype=torch.int64)


class LoadBackError(RuntimeError):
    """An L2->L1 copy this request depends on failed or was cancelled; its prefix is not usable."""


@dataclass(eq=False)
class PendingCopy:
    """A copy on the engine plus what the cache must do when it finishes."""

    kind: str  # "load" (L2->L1) or "backup" (L1->L2)
    nodes: list[TreeNode]  # nodes whose data it writes, in path order; kept current across splits
    locked: list[TreeNode]  # nodes it holds a lock on
    deps: list[PendingCopy] = field(default_factory=list)  # earlier copies it fails with (reads or loads below)
    drain: torch.Tensor = _NO_PAGES  # L1 pages to free once done (write_back eviction, a load undone early)
    future: Future | None = None
    ok: bool | None = None  # set when finished


@dataclass
class MatchResult:
    """Read-only prefix match: what is on L1, what can be restored from L2, and where the match stopped."""

    key: Key  # token_key of the query
    path: list[TreeNode]  # matched nodes; the last one may match only its first ``tail_pages`` pages
    tail_pages: int
    device_hit_tokens: int
    host_hit_tokens: int
    device_indices: torch.Tensor  # L1 pages of the device hit
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
    device_indices: torch.Tensor  # L1 pages of the whole prefix; valid once wait() returns
    delta_pages: torch.Tensor  # pages allocated for the rest of the request, owned by the handle
    device_hit_tokens: int
    restored_tokens: int
    waits: list[PendingCopy]
    released: bool = False

    @property
    def prefix_tokens(self) -> int:
        return self.device_indices.numel() * self.cache.page_size

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

    def take_pages(self) -> torch.Tensor:
        """Prefix pages followed by the delta pages; the delta pages now belong to the caller (for insert)."""
        pages = torch.cat([self.device_indices, self.delta_pages])
        self.delta_pages = _NO_PAGES
        return pages


@dataclass
class CacheCounters:
    """Monotonic token counters per tier, exported by the metrics module."""

    cached_device: int = 0  # prompt tokens served from L1
    cached_host: int = 0  # prompt tokens restored from L2
    evicted_device: int = 0
    evicted_host: int = 0
    backed_up: int = 0  # L1 -> L2
    loaded_back: int = 0  # L2 -> L1


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts) if parts else _NO_PAGES


class HierarchicalCache:
    """Radix tree + L1/L2 allocators + copy engine + write policy. Called from the event loop only."""

    def __init__(
        self,
        device_pool: KVPool,
        host_pool: KVPool | None = None,
        *,
        write_policy: str = "write_through",
        eviction: str = "lru",
        hash_seed: str | None = None,
        engine: CopyEngine | None = None,
        storage: StorageTier | None = None,
        storage_backup_policy: str = "all",
    ):
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write policy {write_policy!r} not in {WRITE_POLICIES}")
        if eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction policy {eviction!r} not in {EVICTION_POLICIES}")
        if storage_backup_policy not in STORAGE_BACKUP_POLICIES:
            raise ValueError(f"storage backup policy {storage_backup_policy!r} not in {STORAGE_BACKUP_POLICIES}")
        if storage is not None and host_pool is None:
            raise ValueError("L3 storage moves pages through L2: it needs a host pool")
        self.page_size = device_pool.page_size
        self.write_policy = write_policy
        self.lfu = eviction == "lfu"
        self.tree = RadixTree(self.page_size, device_pool.layout.fingerprint() if hash_seed is None else hash_seed)
        self.device_alloc = PageAllocator(device_pool.num_pages, reserved=1)  # page 0: scratch
        self.host_pool = host_pool
        self.host_alloc = PageAllocator(host_pool.num_pages) if host_pool is not None else None
        self.storage = storage
        self.storage_backup_policy = storage_backup_policy
        self._host_out = 0  # L2 pages handed out by alloc_host, not yet attached or freed
        if host_pool is not None and engine is None:
            engine = CopyEngine(device_pool.buffer, host_pool.buffer)
        self.engine = engine
        self.counters = CacheCounters()
        self._pending: deque[PendingCopy] = deque()
        self._draining = 0  # L1 pages that pending copies free when done

    # -- matching ---------------------------------------------------------------------------------------------

    def match(self, tokens: Tokens) -> MatchResult:
        """Longest cached prefix over L1 then L2, stopping at the first gap. Changes nothing."""
        key = token_key(tokens)
        path, tail = self.tree.match(key)
        ps = self.page_size
        dev_parts, restore = [], []
        device_pages, host_pages = 0, 0
        for i, node in enumerate(path):
            pages = tail if i == len(path) - 1 else self.tree.num_pages(node)
            if node.on_device and not restore:
                full = pages == self.tree.num_pages(node)
                dev_parts.append(node.device_indices if full else node.device_indices[:pages])
                device_pages += pages
            elif node.on_host and not node.on_device:
                restore.append(node)
                host_pages += pages
            else:  # a gap (a node losing its last tier while locked)
                path, tail = path[:i], (self.tree.num_pages(path[i - 1]) if i else 0)
                break
        return MatchResult(
            key=key,
            path=path,
            tail_pages=tail,
            device_hit_tokens=device_pages * ps,
            host_hit_tokens=host_pages * ps,
            device_indices=_cat(dev_parts),
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
        restore = [n for n in path if not n.on_device]
        n_restore = sum(self.tree.num_pages(n) for n in restore)
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
        waits = list({n.loading: None for n in path if n.loading is not None})
        self.tree.touch(last, hit=bool(path))
        self.counters.cached_device += match.device_hit_tokens
        self.counters.cached_host += n_restore * self.page_size
        if self.write_policy == "write_through_selective":
            self._backup(n for n in path if n.hit_count >= SELECTIVE_HITS)
        if self.storage is not None and self.storage_backup_policy == "hit_twice":  # on L2, hit for the 2nd time
            self._store(n for n in path if n.hit_count == SELECTIVE_HITS and n.on_host and n.saving is None)
        return LoadHandle(
            cache=self,
            node=last,
            device_indices=_cat([n.device_indices for n in path]),
            delta_pages=pages[n_restore:],
            device_hit_tokens=match.device_hit_tokens,
            restored_tokens=n_restore * self.page_size,
            waits=waits,
        )

    def _start_load(self, nodes: list[TreeNode], device_pages: torch.Tensor) -> None:
        """Submit the L2->L1 copy of ``nodes`` into ``device_pages``; the nodes change only once it is queued.

        It fails with the copies it reads from (backups still writing its L2 pages) and with earlier loads of
        its ancestors, whose failure takes its nodes off L1 (``_undo_loads_below``).
        """
        deps = {n.saving: None for n in nodes if n.saving is not None}
        node = nodes[0].parent
        while node is not self.tree.root:
            if node.loading is not None:
                deps[node.loading] = None
            node = node.parent
        op = PendingCopy("load", nodes=list(nodes), locked=[nodes[-1]], deps=list(deps))
        op.future = self.engine.load(_cat([n.host_indices for n in nodes]), device_pages)
        offset = 0
        for node in nodes:
            n = self.tree.num_pages(node)
            self.tree.set_device(node, device_pages[offset : offset + n])
            node.loading = op
            offset += n
        self.tree.lock(nodes[-1])
        self._pending.append(op)

    def release(self, handle: LoadHandle) -> None:
        """Unlock the handle's prefix and free the pages it still owns (success, failure and abort alike)."""
        if handle.released:
            raise RuntimeError("LoadHandle released twice")
        handle.released = True
        self.device_alloc.free(handle.delta_pages)
        handle.delta_pages = _NO_PAGES
        self.tree.unlock(handle.node)
        self._prune_gap_above(handle.node)
        self.poll()

    # -- insertion ----------------------------------------------------------------------------------------------

    def insert(self, tokens: Tokens, device_pages: torch.Tensor, *, backup: bool = False) -> int:
        """Cache the full pages of ``tokens``; returns how many tokens were already cached on L1.

        The tree takes ``device_pages[:full pages]``: pages for the new part are kept, pages that duplicate
        cached data are freed, and an evicted (host-only) node on the path is revived with the given pages,
        keeping its host copy. Pages past the last full page stay with the caller. ``backup`` backs the path up
        to L2 now whatever the policy (a retracted request). The pages past a node whose load-back is still in
        flight are freed, not grafted below it.
        """
        key = token_key(tokens)
        n = len(key) // self.tree.page_bytes
        if device_pages.numel() < n:
            raise ValueError(f"{n} full pages of tokens, got {device_pages.numel()} pages")
        key = key[: n * self.tree.page_bytes]
        _, pos, cached, _ = self._graft(key, device_pages[:n], backup=backup, exact=False)
        self.device_alloc.free(device_pages[pos:n])
        return cached * self.page_size

    def cache_in_flight(
        self, handle: LoadHandle, tokens: Tokens, pages: torch.Tensor
    ) -> tuple[LoadHandle, torch.Tensor]:
        """Share a running request's computed full pages through the tree, so concurrent requests hit them now.

        ``tokens``: the tokens whose KV is computed (their full pages count); ``pages``: the request's pages, the
        handle's prefix first (after ``take_pages``). Like ``insert``, except that the pages past a node whose
        load-back is in flight stay with the request, and the lock moves to the new deepest node. Returns the new
        handle (the old one is spent) and the request's new page list: tree pages for the cached prefix (the
        tree's copy replaces a duplicate, which is freed; same tokens, same KV), then the rest of ``pages``.
        """
        if handle.released or handle.delta_pages.numel():
            raise ValueError("cache_in_flight needs a live handle whose delta pages were taken")
        key = token_key(tokens)
        n, old = len(key) // self.tree.page_bytes, handle.device_indices.numel()
        if pages.numel() < n:
            raise ValueError(f"{n} full pages of tokens, got {pages.numel()} pages")
        if n <= old:
            return handle, pages
        node, pos, _, tree_pages = self._graft(key[: n * self.tree.page_bytes], pages[:n], backup=False, exact=True)
        if pos <= old:  # a load-back in flight right past the prefix: nothing changed
            return handle, pages
        self.tree.lock(node)  # a descendant of handle.node: the prefix stays locked throughout
        self.tree.unlock(handle.node)
        handle.released = True
        new = LoadHandle(self, node, tree_pages, _NO_PAGES, handle.device_hit_tokens, handle.restored_tokens, [])
        return new, torch.cat([tree_pages, pages[pos:]])

    def _graft(
        self, key: Key, pages: torch.Tensor, *, backup: bool, exact: bool
    ) -> tuple[TreeNode, int, int, torch.Tensor]:
        """Put ``pages`` (one per whole page of ``key``) into the tree along ``key``, stopping at a node whose L1
        data is still arriving. Pages duplicating L1 data are freed; ``exact`` splits a node that ``key`` ends
        inside, so that the returned node ends where the grafted part does.

        Returns the deepest node reached, the number of pages grafted, how many of them were already on L1, and
        the tree's L1 pages for them.
        """
        n = pages.numel()
        path, tail = self.tree.match(key)
        node, pos, cached, dup, kept, tree_pages = self.tree.root, 0, 0, [], [], []
        for i, child in enumerate(path):
            if child.loading is not None:
                break  # its L1 data is still arriving: nothing is grafted below it
            k = tail if i == len(path) - 1 else self.tree.num_pages(child)
            if k < self.tree.num_pages(child) and (exact or pos + k < n or not child.on_device):
                child = self._split(child, k)
            mine = pages[pos : pos + k]
            if child.on_device:
                dup.append(mine[mine != child.device_indices[:k]])
                cached += k
            else:
                self.tree.set_device(child, mine)
            tree_pages.append(child.device_indices[:k])
            kept.append(child)
            node, pos = child, pos + k
        else:
            if pos < n:
                node = self.tree.add_child(node, key[pos * self.tree.page_bytes :], pages[pos:])
                tree_pages.append(pages[pos:])
                kept.append(node)
                pos = n
        self.device_alloc.free(_cat(dup))
        self.tree.touch(node)
        if backup or self.write_policy == "write_through":
            self._backup(kept)
        return node, pos, cached, _cat(tree_pages)

    # -- L3 storage ---------------------------------------------------------------------------------------------------

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

        The caller owns them until it passes them to ``insert_host`` or ``free_host``.
        """
        pages = self._alloc_host(n)
        if pages is not None:
            self._host_out += n
        return pages

    def free_host(self, pages: torch.Tensor) -> None:
        """Return L2 pages from ``alloc_host`` that hold nothing worth keeping."""
        self.host_alloc.free(pages)
        self._host_out -= pages.numel()

    def insert_host(self, tokens: Tokens, host_pages: torch.Tensor, from_page: int) -> range:
        """Attach L2 pages holding pages ``from_page, from_page + 1, ...`` of ``tokens`` as a host-only node.

        The tree may have changed since the prefetch began, so this matches again: pages the tree now holds are
        freed as duplicates, and if the pages before ``from_page`` are no longer cached (evicted meanwhile), or a
        node in neither tier blocks the spot, nothing connects and every page is freed. Returns the page indices
        of ``tokens`` the new node holds (empty when none).
        """
        key = token_key(tokens)
        tree, pb = self.tree, self.tree.page_bytes
        end = from_page + host_pages.numel()
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

    def _store(self, nodes: Iterable[TreeNode]) -> None:
        """Queue one L2 -> L3 backup of the nodes' pages (the tier copies them out of L2 before returning)."""
        nodes = list(nodes)
        if nodes:
            keys = [k for n in nodes for k in self.tree.page_hashes(n)]
            self.storage.backup(keys, self.host_pool, _cat([n.host_indices for n in nodes]))

    # -- pages and eviction ---------------------------------------------------------------------------------------

    def alloc_device(self, n: int) -> torch.Tensor:
        """``n`` L1 pages, evicting unlocked leaves in one batch if needed; raises OutOfPages taking nothing."""
        self.poll()  # finished copies unlock nodes and return drained pages
        return self._alloc_device(n)

    def _alloc_device(self, n: int) -> torch.Tensor:
        short = n - self.device_alloc.num_free - self._draining
        if short > 0:
            self.evict_device(short)
        if self.device_alloc.num_free < n:
            raise OutOfPages(
                f"need {n} L1 pages: {self.device_alloc.num_free} free, {self._draining} still being backed up "
                f"to L2, {self.tree.locked_device_pages} locked"
            )
        return self.device_alloc.alloc(n)

    def free_device(self, pages: torch.Tensor) -> None:
        """Return request-owned L1 pages that were never inserted (e.g. a partial last page)."""
        self.device_alloc.free(pages)

    def available_device_pages(self) -> int:
        """Pages an allocation could get now or after evicting: the budget check before admitting a request."""
        return self.device_alloc.num_free + self._draining + self.tree.device_pages - self.tree.locked_device_pages

    def evict_device(self, n_pages: int) -> int:
        """Free at least ``n_pages`` L1 pages from unlocked leaves in one batch; returns pages released.

        A backed-up leaf is demoted to host-only; under write_back a leaf is backed up now (its L1 pages are
        freed when that copy finishes); any other leaf leaves the tree with its host-only subtree.
        """
        tree = self.tree
        heap = [self._entry(n) for n in tree.nodes() if self._device_evictable(n)]
        heapq.heapify(heap)
        demote = PendingCopy("backup", nodes=[], locked=[])
        old_pages, released = [], 0
        while released < n_pages and heap:
            node = heapq.heappop(heap)[-1]
            parent, k = node.parent, self.tree.num_pages(node)
            if node.on_host:
                self.device_alloc.free(tree.clear_device(node))
            elif self.write_policy == "write_back" and (host := self._alloc_host(k)) is not None:
                old_pages.append(tree.clear_device(node))
                tree.set_host(node, host)
                node.saving = demote  # keeps evict_host off it until the copy is queued and locks it
                demote.nodes.append(node)
            else:
                self._drop(node)
            self.counters.evicted_device += k * self.page_size
            released += k
            if parent is not tree.root and self._device_evictable(parent):
                heapq.heappush(heap, self._entry(parent))
        if old_pages:
            self._start_demotion(demote, old_pages)
        return released

    def _start_demotion(self, op: PendingCopy, old_pages: list[torch.Tensor]) -> None:
        """Copy write_back victims to L2; their old L1 pages are freed when the copy is done.

        A victim whose parent was dropped later in the same batch left the tree with it: it is not copied.
        """
        live = [(n, p) for n, p in zip(op.nodes, old_pages) if n.parent is not None]
        op.drain = _cat(old_pages)
        if not live:
            self.device_alloc.free(op.drain)
            return
        op.nodes = [n for n, _ in live]
        op.locked = list(op.nodes)
        for node in op.nodes:
            self.tree.lock(node)
        self._draining += op.drain.numel()
        op.future = self.engine.backup(_cat([p for _, p in live]), _cat([n.host_indices for n in op.nodes]))
        self._pending.append(op)

    def evict_host(self, n_pages: int) -> int:
        """Free at least ``n_pages`` L2 pages from unlocked host-only leaves; returns pages freed."""
        tree = self.tree
        heap = [self._entry(n) for n in tree.nodes() if self._host_evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < n_pages and heap:
            node = heapq.heappop(heap)[-1]
            parent = node.parent
            freed += self.tree.num_pages(node)
            self._drop(node)
            if parent is not tree.root and self._host_evictable(parent):
                heapq.heappush(heap, self._entry(parent))
        return freed

    def flush(self) -> int:
        """Drop every unlocked node from both tiers (POST /flush_cache); returns the tokens dropped."""
        self.poll()
        root = self.tree.root
        tops = [n for n in self.tree.nodes() if n.lock_ref == 0 and (n.parent is root or n.parent.lock_ref > 0)]
        dropped = sum(m.num_tokens for n in tops for m in self.tree.subtree(n))
        for node in tops:
            self._drop(node)
        return dropped

    def _entry(self, node: TreeNode) -> tuple:
        prio = (node.hit_count, node.last_access) if self.lfu else (node.last_access,)
        return (*prio, id(node), node)

    def _device_evictable(self, node: TreeNode) -> bool:
        return node.on_device and node.lock_ref == 0 and not any(c.on_device for c in node.children.values())

    def _host_evictable(self, node: TreeNode) -> bool:
        return node.on_host and not node.on_device and node.lock_ref == 0 and not node.children and node.saving is None

    def _drop(self, node: TreeNode) -> None:
        """Remove an unlocked node and its subtree from the tree, freeing their pages in both tiers."""
        for n in self.tree.subtree(node):
            if n.on_device:
                self.device_alloc.free(self.tree.clear_device(n))
            if n.on_host:
                self.host_alloc.free(self.tree.clear_host(n))
                self.counters.evicted_host += n.num_tokens
        self.tree.remove(node)

    def _prune_gap_above(self, node: TreeNode) -> None:
        """Drop the highest unlocked node in neither tier on the path to ``node`` (left by a failed backup)."""
        gap = None
        while node is not self.tree.root and node.parent is not None:
            if not node.on_device and not node.on_host and node.lock_ref == 0:
                gap = node
            node = node.parent
        if gap is not None:
            self._drop(gap)

    # -- backups ----------------------------------------------------------------------------------------------------

    def _alloc_host(self, n: int) -> torch.Tensor | None:
        """``n`` L2 pages, evicting host-only leaves if needed; None when L2 cannot make room. Never raises: a
        write_back eviction batch calls it between marking victims and queueing their demotion."""
        if self.host_alloc is None:
            return None
        short = n - self.host_alloc.num_free
        if short > 0:
            if short > self._host_evictable_pages():
                return None  # evicting could not make room: keep L2 as it is
            self.evict_host(short)
        return self.host_alloc.alloc(n) if self.host_alloc.num_free >= n else None

    def _host_evictable_pages(self) -> int:
        """L2 pages ``evict_host`` can free now: unlocked host-only nodes with no node being written in their
        subtree (a write_back victim is marked ``saving`` before its demotion locks it, within one batch)."""
        blocked: set[TreeNode] = set()  # being written, or above a node that is
        for node in self.tree.nodes():
            up = node if node.saving is not None else self.tree.root
            while up is not self.tree.root and up not in blocked:
                blocked.add(up)
                up = up.parent
        return sum(self.tree.num_pages(n) for n in self.tree.nodes()
                   if n.on_host and not n.on_device and n.lock_ref == 0 and n not in blocked)

    def _backup(self, nodes: Iterable[TreeNode]) -> None:
        """Start one L1->L2 copy for the given nodes that are only on L1 (skipped if L2 has no room)."""
        nodes = [n for n in nodes if n.on_device and not n.on_host and n.saving is None]
        if not nodes or self.host_alloc is None:
            return
        host = self._alloc_host(sum(self.tree.num_pages(n) for n in nodes))
        if host is None:
            return
        op = PendingCopy("backup", nodes=nodes, locked=list(nodes))
        offset = 0
        for node in nodes:
            k = self.tree.num_pages(node)
            self.tree.set_host(node, host[offset : offset + k])
            offset += k
            node.saving = op
            self.tree.lock(node)
        op.future = self.engine.backup(_cat([n.device_indices for n in nodes]), host)
        self._pending.append(op)

    # -- completions ------------------------------------------------------------------------------------------------

    def poll(self) -> int:
        """Apply finished copies, in submission order; returns how many. Cheap: the scheduler calls it each step."""
        done = 0
        while self._pending and self._pending[0].future.done():
            self._finish(self._pending.popleft())
            done += 1
        return done

    @property
    def draining_pages(self) -> int:
        """L1 pages that copies free once they land (write_back demotions, undone loads): allocatable soon."""
        return self._draining

    def pages_soon_free(self) -> int:
        """L1 pages that copies in flight will make allocatable (drains) or evictable (nodes that only a
        backup's lock pins, e.g. a retracted request's). A request short of pages waits for these rather than
        taking someone else's."""
        pinned: dict[TreeNode, int] = {}
        for op in self._pending:
            if op.kind == "backup":
                for node in op.locked:
                    while node is not self.tree.root:
                        pinned[node] = pinned.get(node, 0) + 1
                        node = node.parent
        return self._draining + sum(
            self.tree.num_pages(n) for n, locks in pinned.items() if n.on_device and n.lock_ref == locks
        )

    @property
    def busy(self) -> bool:
        """Copies are in flight: their locks and pages are released only by a later ``poll``."""
        return bool(self._pending)

    def drain(self) -> None:
        """Block until every pending copy is finished and applied (tests, benchmarks, shutdown; not the loop)."""
        while self._pending:
            wait_futures([op.future for op in self._pending])
            self.poll()

    def close(self) -> None:
        self.drain()
        if self.engine is not None:
            self.engine.close()

    def _finish(self, op: PendingCopy) -> None:
        """A failed or cancelled copy leaves no trace: restored L1 copies and new L2 copies are dropped, and so
        are the L1 copies that later loads restore below a failed load."""
        future, tree = op.future, self.tree
        ok = not (future.cancelled() or future.exception() is not None or any(d.ok is False for d in op.deps))
        for node in op.nodes:
            if op.kind == "load":
                node.loading = None
                if ok:
                    self.counters.loaded_back += node.num_tokens
                else:
                    self.device_alloc.free(tree.clear_device(node))
            else:
                node.saving = None
                if ok:
                    self.counters.backed_up += node.num_tokens
                else:
                    self.host_alloc.free(tree.clear_host(node))
        if op.kind == "load" and not ok and op.nodes:
            self._undo_loads_below(op.nodes[0])
        if op.kind == "backup" and ok and self.storage is not None:
            hits = 0 if self.storage_backup_policy == "all" else SELECTIVE_HITS
            self._store(n for n in op.nodes if n.hit_count >= hits)
        if op.drain.numel():
            self.device_alloc.free(op.drain)
            self._draining -= op.drain.numel()
        op.ok = ok
        for node in op.locked:
            tree.unlock(node)
        if not ok:  # a node may have lost its last tier; every node of the op is on a path to a locked one
            for node in op.locked:
                if node.parent is not None:
                    self._prune_gap_above(node)

    def _undo_loads_below(self, node: TreeNode) -> None:
        """Take off L1 what later loads restore below ``node``, whose load failed: a node on L1 has its parent
        there. Those loads fail too (they depend on this one); as their copies may be running, their pages are
        freed when each is done."""
        for n in self.tree.subtree(node):
            op = n.loading
            if op is not None:
                op.nodes.remove(n)
                n.loading = None
                op.drain = torch.cat([op.drain, self.tree.clear_device(n)])
                self._draining += self.tree.num_pages(n)

    def _split(self, node: TreeNode, pages: int) -> TreeNode:
        head = self.tree.split(node, pages)
        for op in (node.loading, node.saving):
            if op is not None:
                op.nodes.insert(op.nodes.index(node), head)
        return head

    # -- observability -------------------------------------------------------------------------------------------------

    def stats(self) -> dict:
        """Pages per tier and state (free + used + evictable + locked = total) and token counters per tier.

        ``used``: allocated but not evictable now (L1: request pages and pages copies free once done; L2: host
        copies of nodes still on L1). ``evictable``: unlocked tree pages the tier could free (L2: host-only ones).
        """
        tree, dev = self.tree, self.device_alloc
        locked = tree.locked_device_pages
        out: dict = {
            "device": {
                "total": dev.total,
                "free": dev.num_free,
                "used": dev.num_used - tree.device_pages,
                "evictable": tree.device_pages - locked,
                "locked": locked,
            }
        }
        if self.host_alloc is not None:
            h_locked = h_evictable = 0
            for node in tree.nodes():
                if node.on_host:
                    k = self.tree.num_pages(node)
                    if node.lock_ref:
                        h_locked += k
                    elif not node.on_device:
                        h_evictable += k
            host = self.host_alloc
            out["host"] = {
                "total": host.total,
                "free": host.num_free,
                "used": host.num_used - h_locked - h_evictable,  # includes pages receiving an L3 prefetch
                "evictable": h_evictable,
                "locked": h_locked,
            }
        if self.storage is not None:
            out["storage"] = self.storage.stats()
        c = self.counters
        out["tokens"] = {
            "cached": {"device": c.cached_device, "host": c.cached_host},
            "evicted": {"device": c.evicted_device, "host": c.evicted_host},
            "backed_up": {"host": c.backed_up},
            "loaded_back": c.loaded_back,
        }
        return out

    def check_invariants(self, request_pages: int | None = None, prefetch_pages: int | None = None) -> None:
        """Assert tree shape, tiers and page accounting; ``request_pages`` are L1 pages held outside the tree,
        ``prefetch_pages`` L2 pages held outside it (taken with ``alloc_host``, not yet attached or freed)."""
        tree, root = self.tree, self.tree.root
        dev, host, locked_dev = [], [], 0
        pending = set(self._pending)
        for node in tree.nodes():
            parent, k = node.parent, self.tree.num_pages(node)
            assert node.key and len(node.key) % tree.page_bytes == 0, f"{node} is not page aligned"
            assert parent.children.get(node.key[: tree.page_bytes]) is node, f"{node} is not its parent's child"
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()) >= 0, f"lock refs of {node}"
            if node.on_device:
                assert node.device_indices.numel() == k, f"{node} has {node.device_indices.numel()} L1 pages"
                assert parent is root or parent.on_device, f"{node} is on L1 below a parent that is not"
                dev.append(node.device_indices)
                locked_dev += k if node.lock_ref else 0
            if node.on_host:
                assert node.host_indices.numel() == k, f"{node} has {node.host_indices.numel()} L2 pages"
                host.append(node.host_indices)
            # A gap is locked; below it may hang anything not on L1 (one request's path whose demotion failed is
            # a chain of gaps): match stops at it, and the last unlock drops it with its subtree.
            assert node.on_device or node.on_host or node.lock_ref > 0, f"{node} is in neither tier"
            assert all(op is None or op in pending for op in (node.loading, node.saving)), f"{node} stale copy"
        dev_pages = _cat(dev)
        assert dev_pages.unique().numel() == dev_pages.numel(), "an L1 page is held by two nodes"
        assert not bool((dev_pages < self.device_alloc.reserved).any()), "a reserved L1 page is in the tree"
        assert tree.device_pages == dev_pages.numel() and tree.locked_device_pages == locked_dev, "L1 counters"
        assert self._draining == sum(op.drain.numel() for op in self._pending), "draining pages"
        held = tree.device_pages + self._draining
        used = self.device_alloc.num_used
        assert used >= held, f"L1: {used} pages allocated but the tree holds {held}"
        if request_pages is not None:
            assert used == held + request_pages, f"L1: {used} allocated != {held} in tree + {request_pages} requests"
        host_pages = _cat(host)
        assert host_pages.unique().numel() == host_pages.numel(), "an L2 page is held by two nodes"
        host_used = 0 if self.host_alloc is None else self.host_alloc.num_used
        held = host_pages.numel() + self._host_out
        assert host_used == held, f"L2: {host_used} allocated != {host_pages.numel()} in tree + {self._host_out} out"
        if prefetch_pages is not None:
            assert self._host_out == prefetch_pages, f"L2: {self._host_out} pages out != {prefetch_pages} prefetching"
