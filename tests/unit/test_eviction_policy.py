"""The default eviction policy, SLRU: nodes never hit go before hit ones (LRU within each), and exactly the pages
asked for go, the last victim split so that its head stays cached. Each test fails under plain LRU."""
from __future__ import annotations

import pytest

from decode_worker.core.policies import EvictionPolicy
from tests.cache_invariants import check_invariants
from tests.unit.test_hicache import PROMPT, assert_quiescent, make_cache, node_of, run

OTHER = (90, 91, 92, 93)  # 2 pages, unrelated to PROMPT (5 pages)


@pytest.fixture(name="hc")
def cache_factory():
    """``make_cache`` with the default policy; every cache made is closed, its copies let through first."""
    made = []

    def factory(**kw):
        made.append(make_cache(**kw))
        return made[-1]

    yield factory
    for cache, *_ in made:
        cache.engine and cache.engine.gate.set()
        cache.close()


def test_slru_is_the_default(hc):
    cache, _, _ = hc()
    assert cache.eviction == EvictionPolicy.SLRU


def test_never_hit_node_goes_before_a_hit_one_even_if_more_recent(hc):
    cache, dev, _ = hc(device_pages=20, host_pages=None)
    run(cache, dev, PROMPT)
    run(cache, dev, PROMPT)  # a hit: PROMPT is in the protected segment
    run(cache, dev, OTHER)  # more recent, never hit
    assert cache.evict_device(2) == 2
    assert cache.match(PROMPT).device_hit_tokens == len(PROMPT) and cache.match(OTHER).hit_tokens == 0
    assert_quiescent(cache)


def test_lru_within_the_never_hit_segment(hc):
    cache, dev, _ = hc(device_pages=20, host_pages=None)
    run(cache, dev, OTHER)
    run(cache, dev, PROMPT)
    assert cache.evict_device(2) == 2
    assert cache.match(OTHER).hit_tokens == 0 and cache.match(PROMPT).device_hit_tokens == len(PROMPT)


def test_evicts_exactly_the_pages_needed_from_the_tail(hc):
    cache, dev, _ = hc(device_pages=20, host_pages=None)
    run(cache, dev, PROMPT)  # one 5-page leaf
    assert cache.evict_device(2) == 2
    assert cache.match(PROMPT).device_hit_tokens == 6 and cache.device_alloc.num_used == 3
    assert_quiescent(cache)


def test_host_eviction_is_page_precise_too(hc):
    cache, dev, _ = hc(device_pages=20)
    run(cache, dev, PROMPT)
    cache.drain()
    cache.evict_device(100)  # host-only now
    assert cache.evict_host(2) == 2
    assert cache.match(PROMPT).host_hit_tokens == 6 and cache.host_alloc.num_used == 3
    assert_quiescent(cache)


def test_split_victim_keeps_its_hit_prefix(hc):
    cache, dev, _ = hc(device_pages=20, host_pages=None)
    run(cache, dev, PROMPT)
    run(cache, dev, PROMPT)
    hits, seen = node_of(cache, PROMPT).hit_count, node_of(cache, PROMPT).last_access
    assert cache.evict_device(2) == 2
    head = node_of(cache, PROMPT[:6])
    assert (head.hit_count, head.last_access) == (hits, seen) and hits > 0
    run(cache, dev, OTHER)  # never hit: it goes before the hit head
    assert cache.evict_device(2) == 2
    assert cache.match(PROMPT).device_hit_tokens == 6 and cache.match(OTHER).hit_tokens == 0
    assert_quiescent(cache)


def test_write_back_demotes_only_the_split_tail_while_copying(hc):
    cache, dev, _ = hc(write_policy="write_back")
    run(cache, dev, PROMPT)
    cache.engine.gate.clear()
    assert cache.evict_device(2) == 2
    tail = node_of(cache, PROMPT)
    assert tail.saving is not None and tail.on_host and not tail.on_device and cache.tree.num_pages(tail) == 2
    assert node_of(cache, PROMPT[:6]).on_device
    check_invariants(cache, request_pages=0)
    cache.engine.gate.set()
    cache.drain()
    m = cache.match(PROMPT)
    assert (m.device_hit_tokens, m.host_hit_tokens) == (6, 4)
    assert_quiescent(cache)


def test_split_while_another_node_s_backup_is_in_flight(hc):
    cache, dev, _ = hc(device_pages=20)
    run(cache, dev, PROMPT)
    cache.drain()
    cache.engine.gate.clear()
    run(cache, dev, OTHER)  # its write_through backup is in flight and locks it
    assert cache.evict_device(1) == 1  # PROMPT is the only unlocked leaf: its last page goes
    assert cache.match(PROMPT).device_hit_tokens == 8 and node_of(cache, OTHER).saving is not None
    check_invariants(cache, request_pages=0)
    cache.engine.gate.set()
    cache.drain()
    assert cache.match(OTHER).device_hit_tokens == 4 and cache.match(PROMPT).host_hit_tokens == 2
    assert_quiescent(cache)
