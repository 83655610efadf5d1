"""POST /flush_cache right after a response: the backup of the prefix just cached still holds its lock, so a
plain flush keeps it. ``flush_settled`` waits (bounded) for such copies and says what stayed."""
from __future__ import annotations

import asyncio
import threading

from decode_worker.cache.node import token_key
from tests.unit.test_hicache import hc  # noqa: F401  (fixture)

TOKENS = list(range(8))


def _cache_one_prompt(cache):
    """A request that finished: its pages are in the tree and its write-through backup is in flight."""
    m = cache.match(token_key(TOKENS))
    h = cache.load_back_and_lock(m, extra_pages=len(TOKENS) // 2)
    cache.insert(token_key(TOKENS), h.take_pages())
    cache.release(h)


def test_flush_waits_for_a_backup_in_flight_and_empties_both_tiers(hc):  # noqa: F811
    cache, *_ = hc()
    cache.engine.gate.clear()  # the backup is still copying when the flush comes
    _cache_one_prompt(cache)
    assert cache.busy
    threading.Timer(0.2, cache.engine.gate.set).start()
    out = asyncio.run(cache.flush_settled(timeout_s=5))
    assert out.complete and out.kept_tokens == 0
    assert out.dropped_tokens == len(TOKENS) and out.copies_waited_for == 1 and out.copies_in_flight == 0
    assert cache.match(token_key(TOKENS)).hit_tokens == 0
    assert cache.stats().device.evictable == 0 and cache.stats().host.evictable == 0


def test_flush_past_its_wait_says_what_stayed(hc):  # noqa: F811
    cache, *_ = hc()
    cache.engine.gate.clear()
    _cache_one_prompt(cache)
    out = asyncio.run(cache.flush_settled(timeout_s=0.05))
    assert not out.complete
    assert out.kept_tokens == len(TOKENS) and out.copies_in_flight == 1
    cache.engine.gate.set()
    cache.drain()
    assert asyncio.run(cache.flush_settled(timeout_s=1)).complete
