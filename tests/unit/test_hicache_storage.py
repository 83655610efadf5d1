"""The hierarchical cache with an L3 tier: restart round trip, host-only insertion of arrived pages, hit_twice."""
from __future__ import annotations

import asyncio

from decode_worker.cache.hicache import HierarchicalCache
from decode_worker.cache.pool import KVPool
from decode_worker.cache.storage import FileStore, StorageTier
from tests.cache_invariants import check_invariants
from tests.unit.test_hicache import LAYOUT, PS, GatedEngine, assert_kv, page_value, start, write_kv

PROMPT = tuple(range(10))


def make(tmp_path, policy="all", write_policy="write_through", device_pages=9, host_pages=24):
    dev, host = KVPool(LAYOUT, device_pages), KVPool(LAYOUT, host_pages)
    tier = StorageTier(FileStore(tmp_path, 1 << 30), LAYOUT)
    cache = HierarchicalCache(dev, host, engine=GatedEngine(dev, host), storage=tier, storage_backup_policy=policy,
                              write_policy=write_policy)
    return cache, dev, host, tier


async def prefetch_into(cache, tokens):
    m = cache.match(tokens)
    keys = cache.storage_keys(m)
    found = await cache.storage.exists(keys)
    pages = cache.alloc_host(found)
    check_invariants(cache, prefetch_pages=found)
    arrived = await cache.storage.prefetch(keys[:found], cache.host_pool, pages, None)
    span = cache.insert_host(tokens, pages[:arrived], m.hit_tokens // PS)
    cache.free_host(pages[arrived:])
    check_invariants(cache, prefetch_pages=0)
    return m, span


def test_backup_to_l3_then_fresh_cache_restores(tmp_path):
    async def go():
        cache, dev, host, tier = make(tmp_path)
        h = start(cache, PROMPT)
        await h.wait()
        pages = h.take_pages()
        write_kv(dev, PROMPT, pages)
        cache.insert(PROMPT, pages)
        cache.free_device(pages[5:])
        cache.release(h)
        cache.drain()
        await tier.flush()
        assert tier.backed_up_pages == 5
        check_invariants(cache, request_pages=0, prefetch_pages=0)
        # fresh cache on the same folder
        cache2, dev2, host2, tier2 = make(tmp_path)
        q = PROMPT + (99, 98, 97)
        m, span = await prefetch_into(cache2, q)
        assert m.hit_tokens == 0 and span == range(0, 5)
        m = cache2.match(q)
        assert m.host_hit_tokens == 10
        h = cache2.load_back_and_lock(m, extra_pages=2)
        await h.wait()
        assert_kv(dev2, PROMPT, h.device_indices)
        cache2.release(h)
        cache2.drain()
        check_invariants(cache2, request_pages=0, prefetch_pages=0)
        # partial L1 hit then L3 for the rest: evict the tail only
        for c in (cache, cache2):
            c.close()
        await tier.close(); await tier2.close()
    asyncio.run(go())


def test_insert_host_dups_gaps_and_split(tmp_path):
    async def go():
        cache, dev, host, tier = make(tmp_path)
        # cache has PROMPT[:6] on L1 (3 pages)
        h = start(cache, PROMPT[:6]); await h.wait(); p = h.take_pages(); write_kv(dev, PROMPT[:6], p)
        cache.insert(PROMPT[:6], p); cache.release(h); cache.drain()
        # pages 2..4 arrive (from_page 2): page 2 dup, 3..4 new
        pages = cache.alloc_host(3)
        for j, pg in zip(range(2, 5), pages.tolist()):
            host.buffer[pg] = page_value(PROMPT[: (j + 1) * PS])
        span = cache.insert_host(PROMPT, pages, 2)
        assert span == range(3, 5)
        check_invariants(cache, request_pages=0, prefetch_pages=0)
        m = cache.match(PROMPT)
        assert (m.device_hit_tokens, m.host_hit_tokens) == (6, 4)
        # a gap: pages from page 6 of a longer prompt whose page 5 is not cached -> all freed
        longer = PROMPT + tuple(range(10, 20))
        pages = cache.alloc_host(2)
        assert cache.insert_host(longer, pages, 6) == range(0)
        check_invariants(cache, request_pages=0, prefetch_pages=0)
        # split: a prompt diverging inside node [3,5): pages 0..3 shared, page 4 different
        other = PROMPT[:8] + (77, 78)
        pages = cache.alloc_host(1)
        host.buffer[pages[0]] = page_value(other)
        assert cache.insert_host(other, pages, 4) == range(4, 5)
        check_invariants(cache, request_pages=0, prefetch_pages=0)
        m = cache.match(other)
        assert m.hit_tokens == 10
        h = cache.load_back_and_lock(m); await h.wait(); assert_kv(dev, other, h.device_indices); cache.release(h)
        cache.drain(); check_invariants(cache, request_pages=0, prefetch_pages=0)
        # everything already present: all freed
        pages = cache.alloc_host(2)
        assert cache.insert_host(PROMPT, pages, 0) == range(0)
        check_invariants(cache, request_pages=0, prefetch_pages=0)
        cache.close(); await tier.close()
    asyncio.run(go())


def test_hit_twice_policy(tmp_path):
    async def go():
        cache, dev, host, tier = make(tmp_path, policy="hit_twice")
        h = start(cache, PROMPT); await h.wait(); p = h.take_pages(); write_kv(dev, PROMPT, p)
        cache.insert(PROMPT, p); cache.free_device(p[5:]); cache.release(h); cache.drain()
        await tier.flush(); assert tier.backed_up_pages == 0
        for i in range(2):
            h = start(cache, PROMPT + (i,)); await h.wait(); cache.release(h); cache.drain()
            await tier.flush()
            assert tier.backed_up_pages == (0 if i == 0 else 5), i
        check_invariants(cache, request_pages=0, prefetch_pages=0)
        cache.close(); await tier.close()
    asyncio.run(go())
