"""Regression tests for race and failure windows of the hierarchical cache and its L3 prefetch.

Each test reproduces one defect found by review (issue 11) and failed before its fix.
"""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from decode_worker.cache.hicache import HierarchicalCache, LoadBackError
from decode_worker.cache.pool import KVLayout, KVPool
from decode_worker.cache.storage.base import StoreBackend, encode_record
from decode_worker.cache.storage.tier import StorageTier
from decode_worker.scheduler.lookahead import StorageLookahead
from tests.cache_invariants import check_invariants, draining_pages
from tests.unit.test_hicache import (
    LAYOUT, PROMPT, PS, assert_kv, assert_quiescent, finish, hc, node_of, page_value, run, start,  # noqa: F401
)
from tests.unit.test_hicache_property import ManualEngine


def _finish_copies_unpolled(cache: HierarchicalCache) -> None:
    """Let every queued copy run to completion without the cache seeing it (no poll): the window in which a
    request can act on a match whose tiers a finished copy is about to change."""
    cache.engine.gate.set()
    for op in list(cache.copies.queue):
        op.future.exception(timeout=10)


# -- defect 2: load_back_and_lock must not act on tiers its own allocation changed -----------------------------


def test_lock_after_an_unpolled_failed_demotion_takes_nothing_and_leaks_nothing(hc):
    cache, dev, host = hc(device_pages=20, write_policy="write_back")
    run(cache, dev, PROMPT)
    cache.engine.gate.clear()
    cache.engine.fail_next = 1
    cache.evict_device(100)  # PROMPT is now host-only, its host copy still being written
    match = cache.match(PROMPT)
    assert match.host_hit_tokens == 10
    _finish_copies_unpolled(cache)  # the demotion failed; the match does not know yet
    h = cache.load_back_and_lock(match, extra_pages=5)
    assert h.restored_tokens == 0 and h.prefix_tokens == 0  # nothing left to restore: a plain miss
    finish(cache, dev, PROMPT, h)
    assert cache.match(PROMPT).device_hit_tokens == 10
    assert_quiescent(cache)


def test_lock_after_an_unpolled_failed_load_back_restores_again(hc):
    cache, dev, host = hc(device_pages=20)
    run(cache, dev, PROMPT)
    cache.drain()
    cache.evict_device(100)
    cache.engine.gate.clear()
    cache.engine.fail_next = 1
    first = start(cache, PROMPT)  # a load-back that will fail
    match = cache.match(PROMPT)  # a second request sees PROMPT restoring (on L1, loading)
    _finish_copies_unpolled(cache)
    second = cache.load_back_and_lock(match, extra_pages=0)
    # the failed load dropped the L1 copy: the second request restores from L2 itself
    assert second.restored_tokens == 10
    finish(cache, dev, PROMPT, second)
    with pytest.raises(Exception):
        asyncio.run(first.wait())
    cache.release(first)
    assert_quiescent(cache)


# -- defect 6: a host allocation that cannot succeed evicts nothing ----------------------------------------------


def test_oversized_host_allocation_leaves_l2_alone(hc):
    cache, dev, host = hc(device_pages=20, host_pages=8)
    run(cache, dev, PROMPT)
    cache.drain()
    cache.evict_device(100)  # PROMPT: 5 host-only pages
    assert cache.match(PROMPT).host_hit_tokens == 10
    assert cache.alloc_host(9) is None  # more than L2 holds in all
    assert cache.match(PROMPT).host_hit_tokens == 10, "L2 was emptied for an allocation that failed"
    pages = cache.alloc_host(4)
    assert pages is not None
    cache.free_host(pages)
    assert_quiescent(cache)


def test_oversized_backup_leaves_l2_alone(hc):
    cache, dev, host = hc(device_pages=20, host_pages=6, write_policy="write_through")
    run(cache, dev, PROMPT[:4])
    cache.drain()
    cache.evict_device(100)  # 2 host-only pages
    run(cache, dev, tuple(range(100, 114)))  # write-through of 7 pages: more than L2 holds
    cache.drain()
    assert cache.match(PROMPT[:4]).host_hit_tokens == 4, "L2 was emptied for a backup that was skipped"
    assert_quiescent(cache)


# -- defect 1: a stopped L3 prefetch writes nothing more ---------------------------------------------------------


class GatedStore(StoreBackend):
    """An in-memory store whose ``get`` answers only when the test opens ``gate``."""

    name = "gated"

    def __init__(self, records: dict[str, bytes], gate_exists: bool = False):
        self.records = records
        self.gate = asyncio.Event()
        self.answered = asyncio.Event()
        self.gate_exists = gate_exists

    async def exists(self, keys: list[str]) -> int:
        if self.gate_exists:
            await self.gate.wait()
            self.answered.set()
        n = 0
        while n < len(keys) and keys[n] in self.records:
            n += 1
        return n

    async def get(self, keys: list[str]) -> list[bytes | None]:
        await self.gate.wait()
        self.answered.set()
        return [self.records.get(k) for k in keys]

    async def put(self, keys, records) -> None:
        self.records.update((k, bytes(r)) for k, r in zip(keys, records))

    async def delete(self, keys) -> None:
        for k in keys:
            self.records.pop(k, None)


def test_prefetch_stopped_after_the_store_answered_writes_nothing():
    """A stop that lands after the store answered but before the fetch resumes: Python 3.11's wait_for swallows
    that cancellation, so only an explicit stop flag keeps the fetch from writing into pages already freed."""
    host = KVPool(LAYOUT, 4)
    keys = ["a0" * 32, "b1" * 32]
    records = {k: bytes(encode_record(k, LAYOUT.fingerprint(), bytes([7]) * LAYOUT.page_bytes)) for k in keys}

    async def scenario() -> tuple[int, int]:
        store = GatedStore(records)
        tier = StorageTier(store, LAYOUT, batch_pages=2)
        op = tier.start_prefetch(keys, host, torch.tensor([1, 2]))
        await asyncio.sleep(0)  # the fetch is now waiting in get()
        store.gate.set()
        await store.answered.wait()  # get() returned; the fetch has not resumed yet
        arrived = op.stop()
        for _ in range(20):  # let the fetch run whatever it still runs
            await asyncio.sleep(0)
        await asyncio.sleep(0.05)
        return arrived, op.arrived

    arrived, later = asyncio.run(scenario())
    assert arrived == 0 and later == 0, f"stop() said {arrived}, the fetch went on to {later}"
    assert int(host.buffer.view(torch.uint8).view(4, -1)[1:3].sum()) == 0, \
        "a stopped prefetch wrote into L2 pages it no longer owns"


def test_lookahead_settled_while_the_store_answers_takes_no_l2_pages():
    """The request settles (admitted, aborted) after ``exists`` answered but before its task resumed: the task
    must not go on to take L2 pages that nobody would ever free."""
    dev, host = KVPool(LAYOUT, 9), KVPool(LAYOUT, 8)
    tokens = list(range(10))

    async def scenario() -> int:
        probe = HierarchicalCache(dev, host)
        keys = probe.storage_keys(probe.match(tokens))
        probe.close()
        record = lambda k: bytes(encode_record(k, LAYOUT.fingerprint(), bytes(LAYOUT.page_bytes)))  # noqa: E731
        store = GatedStore({k: record(k) for k in keys}, gate_exists=True)
        cache = HierarchicalCache(dev, host, storage=StorageTier(store, LAYOUT))
        lookahead = StorageLookahead(cache, PS, lambda r: tokens, asyncio.Event())
        req = SimpleNamespace(fetch=None, seq=SimpleNamespace(output_ids=[]), aborted=None, storage_span=range(0))
        lookahead.start([req])
        await asyncio.sleep(0)  # its task now waits in exists()
        store.gate.set()
        await store.answered.wait()
        lookahead.settle(req, insert=False)
        for _ in range(20):
            await asyncio.sleep(0)
        await asyncio.sleep(0.05)
        check_invariants(cache, prefetch_pages=0)
        out = cache.pages.host_out
        cache.close()
        return out

    assert asyncio.run(scenario()) == 0


# -- gaps that mutation testing found (mutmut over radix_tree.py) -------------------------------------------------


def test_a_request_hitting_part_of_a_node_still_loading_waits_for_that_load(hc):
    """Another request matches only the head of a node whose load-back is in flight: the split that gives it its
    own node must keep the head waiting on the load, or it reads L1 pages before their data arrived."""
    cache, dev, host = hc(device_pages=20)
    run(cache, dev, PROMPT)
    cache.drain()
    cache.evict_device(100)
    cache.engine.gate.clear()
    whole = start(cache, PROMPT)  # restores all 5 pages; the copy is held
    head = start(cache, PROMPT[:4] + (9, 9))  # 2 of those pages, then its own
    assert head.prefix_tokens == 4 and head.waits, "the head of a loading node does not wait for its load"
    assert not head.ready()
    cache.engine.gate.set()
    finish(cache, dev, PROMPT[:4] + (9, 9), head)
    finish(cache, dev, PROMPT, whole)
    assert_quiescent(cache)


def test_a_match_older_than_two_tree_changes_is_redone(hc):
    """The tree's version must move on with every change, not just differ from its start value."""
    cache, dev, _ = hc(device_pages=20, host_pages=None)
    run(cache, dev, PROMPT[:4])
    run(cache, dev, (5, 5, 5, 5))
    match = cache.match(PROMPT)
    assert match.device_hit_tokens == 4
    cache.evict_device(100)  # both prompts leave the tree: two changes
    h = cache.load_back_and_lock(match, extra_pages=5)
    assert h.prefix_tokens == 0, "a stale match was used after the tree changed"
    cache.release(h)
    assert_quiescent(cache)


def test_split_refuses_a_cut_at_either_end(hc):
    cache, dev, _ = hc()
    run(cache, dev, PROMPT)
    node = node_of(cache, PROMPT)
    for pages in (0, 5):
        with pytest.raises(AssertionError):
            cache.tree.split(node, pages)


def test_a_redone_match_that_shrank_still_gets_every_page_the_request_needs(hc):
    """Found by the state machine: the caller sizes the delta from its match; when load_back_and_lock redoes a
    stale match and finds less cached, the missing pages must come as delta pages, not go missing."""
    cache, dev, _ = hc(device_pages=20, host_pages=None)
    run(cache, dev, PROMPT)
    match = cache.match(PROMPT)
    cache.flush()
    h = cache.load_back_and_lock(match, extra_pages=0)
    assert h.prefix_tokens == 0 and len(h.delta_pages) == 5
    finish(cache, dev, PROMPT, h)
    assert_quiescent(cache)


# -- found by the state machine (twins 'halves': a split host-only node restored by two load-backs) ---------------


def stepped_cache(**kw) -> tuple[HierarchicalCache, KVPool, ManualEngine]:
    """A cache whose copies run one by one when the test says (``engine.run(n)``), failing where marked."""
    dev, host = KVPool(LAYOUT, 20), KVPool(LAYOUT, 24)
    engine = ManualEngine(dev, host)
    return HierarchicalCache(dev, host, engine=engine, **kw), dev, engine


def restore_in_halves(cache: HierarchicalCache, dev: KVPool, engine: ManualEngine) -> tuple:
    """PROMPT cached, pushed to L2 only (under write_back its demotion still queued), then restored by two
    requests: the first load-back brings pages 0-2, the second, queued after it, pages 3-4."""
    finish(cache, dev, PROMPT, start(cache, PROMPT))
    if cache.write_policy != "write_back":
        engine.run()
        cache.poll()
    cache.evict_device(100)
    head, whole = start(cache, PROMPT[:6]), start(cache, PROMPT)
    assert head.restored_tokens == 6 and whole.restored_tokens == 4
    return head, whole


def end_both(cache: HierarchicalCache, engine: ManualEngine, *handles) -> None:
    engine.run()
    for h in handles:
        with pytest.raises(LoadBackError):
            asyncio.run(h.wait())
        cache.release(h)
    assert_quiescent(cache)


@pytest.mark.parametrize("policy, landing", [("write_through", 1), ("write_back", 2)])
def test_a_failed_load_back_takes_the_load_backs_below_it_off_l1(policy, landing):
    """The first load-back fails (itself, or through the demotion it reads from): the pages the second one
    restores below it leave L1 at once, since a node on L1 needs its parent there. Their copy may be running,
    so the pages are freed only when it is done."""
    cache, dev, engine = stepped_cache(write_policy=policy)
    head, whole = restore_in_halves(cache, dev, engine)
    engine.queue[0].fail = True
    engine.run(landing)
    cache.poll()
    check_invariants(cache, request_pages=0)  # L1 holds just the second load's pages, until its copy is done
    assert cache.match(PROMPT).device_hit_tokens == 0 and draining_pages(cache) == 2
    end_both(cache, engine, whole, head)
    assert cache.match(PROMPT).host_hit_tokens == (10 if policy == "write_through" else 0)  # what L2 still holds


def test_a_failed_demotion_under_two_load_backs_leaves_locked_gaps_until_release():
    """Both halves of a demoted prompt lose their only copy while two requests hold them: each stays in the tree,
    in neither tier, until its last lock goes, the second below the first."""
    cache, dev, engine = stepped_cache(write_policy="write_back")
    head, whole = restore_in_halves(cache, dev, engine)
    engine.queue[0].fail = True
    engine.run(3)
    cache.poll()
    check_invariants(cache, request_pages=0)
    assert cache.match(PROMPT).hit_tokens == 0
    end_both(cache, engine, whole, head)
    assert not cache.tree.root.children, "the gaps outlived their locks"


def test_write_back_eviction_under_a_full_l2_never_counts_a_parent_of_its_own_victim(hc):
    """A write_back victim is marked for L2 before its demotion locks it, so its host-only parent, demoted in the
    same batch, is no host-only leaf that evict_host could free for the next victim: the next victim is
    dropped, and the batch ends with its demotion queued."""
    cache, dev, _ = hc(device_pages=20, host_pages=5, write_policy="write_back")
    run(cache, dev, PROMPT[:4], backup=True)  # A: 2 pages on L1 and L2
    cache.drain()
    run(cache, dev, PROMPT[:8])  # B below A: 2 pages on L1 only
    run(cache, dev, (50, 51, 52, 53))  # C: 2 pages on L1 only, used last
    assert cache.evict_device(100) == 6  # B demoted (L2: 1 page left), A host-only, C has no room: dropped
    cache.drain()
    assert cache.match(PROMPT[:8]).host_hit_tokens == 8 and cache.match((50, 51, 52, 53)).hit_tokens == 0
    assert_quiescent(cache)


def test_a_failed_demotion_under_a_load_back_leaves_a_host_only_child_below_a_locked_gap():
    """The same with one load-back: the restored parent loses both copies while its child, demoted before, is
    host-only. The child hangs below the locked gap, unmatched, and leaves with it on release."""
    cache, dev, engine = stepped_cache(write_policy="write_back")
    finish(cache, dev, PROMPT[:6], start(cache, PROMPT[:6]))
    finish(cache, dev, PROMPT, start(cache, PROMPT))
    assert cache.evict_device(2) == 2  # the child: pages 3-4
    engine.run()
    cache.poll()
    assert cache.evict_device(100) == 3  # the parent: its demotion stays queued
    h = start(cache, PROMPT[:6])
    engine.queue[0].fail = True
    engine.run()
    cache.poll()
    check_invariants(cache, request_pages=0)
    assert cache.match(PROMPT).hit_tokens == 0
    with pytest.raises(LoadBackError):
        asyncio.run(h.wait())
    cache.release(h)
    assert not cache.tree.root.children and cache.host_alloc.num_used == 0
    assert_quiescent(cache)


# -- a load-back overtakes the backups queued before it (issue 27: hier's TTFT tail behind write-throughs) --------


def test_a_load_back_overtakes_queued_write_throughs_and_its_request_settles_before_they_land():
    cache, dev, engine = stepped_cache(write_policy="write_through")
    finish(cache, dev, PROMPT, start(cache, PROMPT))
    engine.run()
    cache.poll()
    cache.evict_device(100)  # PROMPT is on L2 only
    others = [tuple(range(100 * i, 100 * i + 6)) for i in (1, 2)]
    for tokens in others:
        finish(cache, dev, tokens, start(cache, tokens))  # each queues its write-through backup
    h = start(cache, PROMPT)  # the load-back, queued last
    backups = [op for op in cache.copies.queue if op.kind == "backup"]
    assert [cache.copies.queue[-1]] == h.waits and len(backups) == 2
    engine.run(1)  # the copy thread runs the load-back first
    assert h.ready(), "the load-back waits behind backups that touch none of its pages"
    asyncio.run(h.wait())  # settles now: the backups are still queued
    assert all(not op.future.done() for op in backups) and list(cache.copies.queue) == backups
    check_invariants(cache, request_pages=len(h.delta_pages))
    finish(cache, dev, PROMPT, h)
    engine.run()
    assert_quiescent(cache)
    assert all(cache.match(tokens).host_hit_tokens == 0 and cache.match(tokens).device_hit_tokens == 6
               for tokens in others)


def test_a_load_back_of_a_queued_demotion_runs_after_it_and_reads_what_it_wrote():
    """write_back: the L2 pages a load-back reads are still being written by a demotion queued before it, behind
    an unrelated backup. The demotion (and the backup before it: backups keep their order) runs first."""
    cache, dev, engine = stepped_cache(write_policy="write_back")
    finish(cache, dev, PROMPT, start(cache, PROMPT))
    finish(cache, dev, (7, 7, 7, 7), start(cache, (7, 7, 7, 7)), backup=True)  # a backup queued first
    cache.evict_device(5)  # PROMPT demoted: its L2 copy is still queued
    h = start(cache, PROMPT)
    assert h.restored_tokens == 10
    assert [c.future for c in engine.queue] == [op.future for op in cache.copies.queue], "not in submission order"
    engine.run()
    finish(cache, dev, PROMPT, h)  # checks the restored KV
    assert_quiescent(cache)
