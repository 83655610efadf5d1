"""HierarchicalCache paths that mutation testing (`make mutation`) showed no test could tell apart from a broken
version: copies over several nodes, page counts per state, budgets at their edges, chains evicted node by node."""
from __future__ import annotations

import asyncio
from dataclasses import asdict

import numpy as np

from decode_worker.cache.hicache import HierarchicalCache
from decode_worker.cache.pool import KVPool
from tests.cache_invariants import check_invariants, draining_pages, host_evictable_pages_by_walk
from tests.unit.test_hicache import (
    LAYOUT, PROMPT, PS, assert_kv, assert_quiescent, finish, hc, node_of, only_on_host, run, start,  # noqa: F401
)

A, B, C = PROMPT[:4], PROMPT[:8], PROMPT  # one path in three nodes: 2 + 2 + 1 pages


def three_nodes(cache, dev) -> None:
    for tokens in (A, B, C):
        run(cache, dev, tokens)
    assert [n.num_tokens for n in cache.tree.nodes()] == [4, 4, 2]


def test_load_back_of_three_nodes_puts_each_in_its_own_pages(hc):
    cache, dev, host = hc(device_pages=20)
    three_nodes(cache, dev)
    cache.drain()
    cache.evict_device(100)
    h = start(cache, C)
    assert h.restored_tokens == 10
    finish(cache, dev, C, h)  # checks the KV of every restored page
    assert_quiescent(cache)


def test_backup_of_three_nodes_puts_each_in_its_own_pages(hc):
    cache, dev, host = hc(device_pages=20, write_policy="write_back")
    three_nodes(cache, dev)  # write_back: none of them is on L2 yet
    run(cache, dev, C, backup=True)  # a retraction's insert: one backup copy of the whole path
    cache.drain()
    path = cache.tree.match(cache.match(C).key)[0]
    assert len(path) == 3 and all(n.on_host for n in path)
    assert_kv(host, C, np.concatenate([n.host_indices for n in path]))
    assert_quiescent(cache)


def test_stats_count_each_page_once_in_its_state(hc):
    cache, dev, host = hc(device_pages=20)
    three_nodes(cache, dev)
    cache.drain()
    cache.evict_device(3)  # C (1 page) and B (2) become host-only; A stays on both tiers
    h = start(cache, A + (9, 9))  # locks A and holds a 1-page delta
    s = cache.stats()
    assert asdict(s.device) == {"total": 19, "free": 16, "used": 1, "evictable": 0, "locked": 2}
    assert asdict(s.host) == {"total": 24, "free": 19, "used": 0, "evictable": 3, "locked": 2}
    assert cache.available_device_pages() == 16
    cache.release(h)
    assert cache.available_device_pages() == 19
    assert_quiescent(cache)


def test_stats_to_dict_is_the_server_info_cache_object(hc):
    """``/server_info``'s ``cache`` object: the same keys, nesting and values as the typed stats."""
    cache, dev, host = hc(device_pages=20)
    three_nodes(cache, dev)
    cache.drain()
    cache.evict_device(3)
    h = start(cache, A + (9, 9))
    assert cache.stats().to_dict() == {
        "device": {"total": 19, "free": 16, "used": 1, "evictable": 0, "locked": 2},
        "host": {"total": 24, "free": 19, "used": 0, "evictable": 3, "locked": 2},
        "tokens": {"cached": {"device": 16, "host": 0}, "evicted": {"device": 6, "host": 0},
                   "backed_up": {"host": 10}, "loaded_back": 0},
    }
    cache.release(h)
    l1_only, _, _ = hc(host_pages=None)
    assert list(l1_only.stats().to_dict()) == ["device", "tokens"]


def test_two_write_back_batches_in_flight_drain_both(hc):
    cache, dev, host = hc(device_pages=20, write_policy="write_back", eviction="lru")  # whole leaves
    run(cache, dev, A)
    run(cache, dev, (7, 7, 7, 7))
    cache.engine.gate.clear()
    cache.evict_device(1)
    cache.evict_device(1)  # a second demotion while the first is in flight
    assert draining_pages(cache) == 4
    check_invariants(cache, request_pages=0)
    cache.engine.gate.set()
    cache.drain()
    assert draining_pages(cache) == 0
    assert_quiescent(cache)


def test_host_eviction_walks_up_a_chain(hc):
    cache, dev, host = hc(device_pages=20)
    three_nodes(cache, dev)
    cache.drain()
    cache.evict_device(100)
    assert cache.evict_host(5) == 5 and not list(cache.tree.nodes())
    assert_quiescent(cache)


def test_one_page_short_evicts_one_leaf(hc):
    cache, dev, _ = hc(device_pages=6, host_pages=None)  # 5 usable pages
    run(cache, dev, PROMPT[:8])  # 4 of them in the tree
    cache.free_device(cache.alloc_device(2))  # 1 free, 1 short: eviction must make up that one page
    assert cache.match(PROMPT[:8]).device_hit_tokens < 8
    assert_quiescent(cache)


def test_host_allocation_with_exactly_enough_evictable_pages_succeeds(hc):
    cache, dev, host = hc(device_pages=20, host_pages=8)
    run(cache, dev, PROMPT)
    cache.drain()
    cache.evict_device(100)  # 5 host-only pages, 3 free
    pages = cache.alloc_host(8)
    assert pages is not None and len(pages) == 8
    cache.free_host(pages)
    assert_quiescent(cache)


def test_flush_counts_an_unlocked_chain_once(hc):
    cache, dev, _ = hc()
    three_nodes(cache, dev)
    cache.drain()  # the write-through backups no longer pin the path
    assert cache.flush() == 10 and not list(cache.tree.nodes())
    assert_quiescent(cache)


def test_storage_keys_cover_a_single_page_past_the_hit(hc):
    cache, dev, _ = hc()
    run(cache, dev, A)
    assert len(cache.storage_keys(cache.match(A + (1, 1)))) == 1
    assert cache.storage_keys(cache.match(A + (1,))) == []


def test_hash_seed_separates_page_keys():
    dev = KVPool(LAYOUT, 4)
    keys = []
    for seed in ("model-a", "model-b"):
        cache = HierarchicalCache(dev, hash_seed=seed)
        keys.append(cache.storage_keys(cache.match(A)))
    assert keys[0] and keys[0] != keys[1]


def test_default_copy_engine_moves_pages_both_ways():
    dev, host = KVPool(LAYOUT, 9), KVPool(LAYOUT, 24)
    cache = HierarchicalCache(dev, host)
    try:
        run(cache, dev, PROMPT)
        cache.drain()
        cache.evict_device(100)
        h = start(cache, PROMPT)
        assert h.restored_tokens == 10
        asyncio.run(h.wait())
        assert_kv(dev, PROMPT, h.device_indices)
        cache.release(h)
    finally:
        cache.close()


def test_host_evictable_count_leaves_out_what_a_write_back_batch_is_demoting(hc):
    """Within one write_back batch, a demoted victim (not yet locked) and the host-only parent it blocks are
    counted by the tree as unlocked host-only, but ``evict_host`` cannot reach them: the L2 pre-check leaves them
    out, as a walk of every node does."""
    cache, dev, host = hc(device_pages=9, host_pages=4, write_policy="write_back", eviction="lru")
    run(cache, dev, A, backup=True)  # A on both tiers: 2 of the 4 L2 pages
    cache.drain()
    run(cache, dev, A + (50, 51))  # a 1-page child of A, only on L1
    run(cache, dev, (7,) * 6)  # a 3-page leaf, only on L1, used last
    seen = []
    alloc_host = cache._alloc_host

    def checked(n):
        seen.append((cache._host_evictable_pages(), host_evictable_pages_by_walk(cache), cache.tree.host_only_pages))
        return alloc_host(n)

    cache._alloc_host = checked
    # the child is demoted (1 L2 page), A leaves L1 (host-only now, above the child being written), then the
    # 3-page leaf finds L2 2 pages short with nothing evict_host could free: it leaves the tree
    assert cache.evict_device(6) == 6
    assert seen == [(0, 0, 0), (0, 0, 3)]
    assert cache.host_alloc.num_free == 1 and cache.match((7,) * 6).device_hit_tokens == 0
    assert_quiescent(cache)
