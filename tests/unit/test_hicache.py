"""HierarchicalCache: lock balance of the request flows, tiers and write policies, copies, failures, sizing."""
from __future__ import annotations

import asyncio
import struct
import threading
import zlib

import numpy as np
import pytest
import torch

from decode_worker.cache.copy_engine import CopyEngine
from decode_worker.cache.hicache import HierarchicalCache, LoadBackError
from decode_worker.cache.node import token_key
from decode_worker.cache.pool import KVLayout, KVPool, OutOfPages, PageAllocator
from decode_worker.cache.sizing import InsufficientHostMemory, host_pool_pages, make_host_pool, mem_available_bytes
from tests.cache_invariants import check_allocator, check_invariants

PS = 2
LAYOUT = KVLayout("test", num_layers=2, num_kv_heads=1, head_dim=4, page_size=PS, dtype=torch.float32)
PAGE_SHAPE = (LAYOUT.num_layers, 2, PS, LAYOUT.num_kv_heads, LAYOUT.head_dim)


class GatedEngine(CopyEngine):
    """Copies wait for ``gate`` and the next ``fail_next`` copies raise: lets tests hold or break a copy."""

    def __init__(self, device: KVPool, host: KVPool):
        super().__init__(device.buffer, host.buffer)
        self.gate = threading.Event()
        self.gate.set()
        self.fail_next = 0

    def _copy(self, *args) -> None:
        assert self.gate.wait(10), "gate never opened"
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("injected copy failure")
        super()._copy(*args)


def make_cache(device_pages: int = 9, host_pages: int | None = 24, **kw):
    dev = KVPool(LAYOUT, device_pages)
    host = KVPool(LAYOUT, host_pages) if host_pages else None
    engine = GatedEngine(dev, host) if host else None
    cache = HierarchicalCache(dev, host, engine=engine, **kw)
    return cache, dev, host


@pytest.fixture
def hc():
    made = []

    def factory(*args, **kw):
        made.append(make_cache(*args, **kw))
        return made[-1]

    yield factory
    for cache, *_ in made:
        cache.engine and cache.engine.gate.set()
        cache.close()


def page_value(prefix: tuple[int, ...]) -> torch.Tensor:
    """Recognisable KV for the page ending ``prefix``: a checksum of the prefix plus the element index."""
    pid = zlib.crc32(struct.pack(f"<{len(prefix)}q", *prefix)) % (1 << 17)
    return (pid * 64 + torch.arange(PS * 16, dtype=torch.float32)).view(PAGE_SHAPE)


def write_kv(pool: KVPool, tokens, pages: np.ndarray, first_page: int = 0) -> None:
    """Stand-in for a forward pass: the request writes its KV into its pages."""
    for j in range(first_page, min(len(pages), -(-len(tokens) // PS))):
        if (j + 1) * PS <= len(tokens):
            pool.buffer[pages[j]] = page_value(tuple(tokens[: (j + 1) * PS]))


def assert_kv(pool: KVPool, tokens, pages: np.ndarray) -> None:
    for j, page in enumerate(pages.tolist()):
        assert torch.equal(pool.buffer[page], page_value(tuple(tokens[: (j + 1) * PS]))), f"page {j}"


def start(cache: HierarchicalCache, tokens):
    m = cache.match(tokens)
    total = -(-len(tokens) // PS)
    h = cache.load_back_and_lock(m, extra_pages=total - m.hit_tokens // PS)
    assert h.prefix_tokens == m.hit_tokens and h.prefix_tokens // PS + len(h.delta_pages) == total
    return h


def finish(cache: HierarchicalCache, dev: KVPool, tokens, h, backup: bool = False) -> int:
    asyncio.run(h.wait())
    assert_kv(dev, tokens, h.device_indices)
    pages = h.take_pages()
    write_kv(dev, tokens, pages, first_page=h.prefix_tokens // PS)
    cached = cache.insert(tokens, pages, backup=backup)
    cache.free_device(pages[len(tokens) // PS :])
    cache.release(h)
    return cached


def run(cache, dev, tokens, backup: bool = False) -> int:
    return finish(cache, dev, tokens, start(cache, tokens), backup)


def only_on_host(cache, dev, tokens) -> None:
    """Cache ``tokens``, let the L2 backup land, then evict them from L1: only the host copy remains."""
    run(cache, dev, tokens)
    cache.drain()
    cache.evict_device(100)


def assert_quiescent(cache: HierarchicalCache) -> None:
    cache.drain()
    check_invariants(cache, request_pages=0)
    assert all(n.lock_ref == 0 for n in cache.tree.nodes())
    assert cache.tree.locked_device_pages == 0
    s = cache.stats()
    for tier in ("device", "host") if cache.host_alloc else ("device",):
        t = getattr(s, tier)
        assert t.free + t.used + t.evictable + t.locked == t.total and t.locked == 0


def node_of(cache, tokens):
    return cache.tree.match(token_key(tokens))[0][-1]


PROMPT = tuple(range(10))


# -- lock balance ------------------------------------------------------------------------------------------------


def test_prefix_hit_then_success(hc):
    cache, dev, _ = hc()
    run(cache, dev, PROMPT)
    assert run(cache, dev, PROMPT + (50, 51, 52)) == 10
    assert cache.match(PROMPT + (50, 51, 52)).device_hit_tokens == 12
    assert_quiescent(cache)


def test_no_hit_then_success(hc):
    cache, dev, _ = hc()
    assert run(cache, dev, PROMPT + (1,)) == 0
    assert cache.match(PROMPT + (1,)).hit_tokens == 10
    assert_quiescent(cache)


def test_prefix_hit_then_transfer_failure(hc):
    cache, dev, _ = hc()
    run(cache, dev, PROMPT)
    h = start(cache, PROMPT + (7, 7, 7, 7))
    assert h.prefix_tokens == 10 and len(h.delta_pages) == 2
    asyncio.run(h.wait())
    cache.release(h)  # the delta never arrived: nothing of it is inserted
    assert cache.match(PROMPT + (7, 7, 7, 7)).hit_tokens == 10
    assert_quiescent(cache)


def test_no_hit_then_failure(hc):
    cache, _, _ = hc()
    h = start(cache, PROMPT)
    cache.release(h)
    assert cache.match(PROMPT).hit_tokens == 0 and cache.device_alloc.num_used == 0
    assert_quiescent(cache)


def test_host_hit_aborted_while_loading(hc):
    cache, dev, host = hc()
    only_on_host(cache, dev, PROMPT)
    cache.engine.gate.clear()
    h = start(cache, PROMPT + (3,))
    assert h.restored_tokens == 10 and not h.ready()
    cache.release(h)  # aborted mid-copy: the copy keeps its own lock until it lands
    assert node_of(cache, PROMPT).lock_ref == 1
    cache.engine.gate.set()
    assert_quiescent(cache)
    assert cache.match(PROMPT).device_hit_tokens == 10
    assert_kv(dev, PROMPT, cache.match(PROMPT).device_indices)


def test_load_back_wait_past_its_deadline(hc):
    cache, dev, host = hc()
    only_on_host(cache, dev, PROMPT)
    cache.engine.gate.clear()
    h = start(cache, PROMPT)

    async def wait_with_deadline():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(h.wait(), timeout=0.05)

    asyncio.run(wait_with_deadline())  # the deadline cancels the wait, not the copy
    cache.release(h)
    cache.engine.gate.set()
    assert_quiescent(cache)
    assert cache.match(PROMPT).device_hit_tokens == 10
    assert_kv(dev, PROMPT, cache.match(PROMPT).device_indices)


def test_retracted_request_resumed(hc):
    cache, dev, host = hc(write_policy="write_back")
    run(cache, dev, PROMPT)
    tokens = PROMPT + (20, 21, 22)
    h = start(cache, tokens)
    asyncio.run(h.wait())
    pages = h.take_pages()
    write_kv(dev, tokens, pages, first_page=h.prefix_tokens // PS)
    more = cache.alloc_device(1)  # decoding grew the request into a new page
    tokens, pages = tokens + (23, 24), np.concatenate([pages, more])
    write_kv(dev, tokens, pages)
    # retract: the tree keeps its full pages, backed up to L2 now, and the request lets go of the rest
    cache.insert(tokens, pages, backup=True)
    cache.free_device(pages[7:])
    cache.release(h)
    tokens = tokens[:14]
    cache.drain()
    assert cache.evict_device(100) == 7  # L1 pressure: demoted to L2
    assert_quiescent(cache)
    # resume
    m = cache.match(tokens)
    assert (m.device_hit_tokens, m.host_hit_tokens) == (0, 14)
    h = start(cache, tokens + (24,))
    assert finish(cache, dev, tokens + (24,), h) == 14
    assert_quiescent(cache)


def test_five_repeated_requests_on_one_prefix(hc):
    cache, dev, _ = hc(device_pages=20)
    handles = [start(cache, PROMPT) for _ in range(1)]
    finish(cache, dev, PROMPT, handles[0])
    cache.drain()
    handles = [start(cache, PROMPT + (i,)) for i in range(5)]  # five live at once, all hitting the prefix
    node = node_of(cache, PROMPT)
    assert node.lock_ref == 5 and all(h.prefix_tokens == 10 for h in handles)
    for i, h in enumerate(handles):
        finish(cache, dev, PROMPT + (i,), h)
    for _ in range(5):  # and five in a row
        run(cache, dev, PROMPT)
    assert node_of(cache, PROMPT).lock_ref == 0 and node_of(cache, PROMPT).hit_count == 10
    assert_quiescent(cache)


def test_release_twice_is_refused(hc):
    cache, dev, _ = hc()
    h = start(cache, PROMPT)
    cache.release(h)
    with pytest.raises(RuntimeError, match="twice"):
        cache.release(h)


# -- matching and structure ------------------------------------------------------------------------------------


def test_match_is_read_only(hc):
    cache, dev, _ = hc()
    run(cache, dev, PROMPT)
    run(cache, dev, PROMPT[:4] + (9, 9, 9, 9))
    cache.drain()
    cache.evict_device(2)
    before = (cache.tree.version, cache.stats(), [(n.last_access, n.hit_count, n.lock_ref) for n in cache.tree.nodes()])
    m = cache.match(PROMPT[:6] + (0, 0))
    assert m.hit_tokens == 6
    after = (cache.tree.version, cache.stats(), [(n.last_access, n.hit_count, n.lock_ref) for n in cache.tree.nodes()])
    assert before == after


def test_split_keeps_total_size_and_page_alignment(hc):
    cache, dev, _ = hc(device_pages=30)
    seqs = [PROMPT, PROMPT[:6] + (1, 1, 1, 1), PROMPT[:2] + (5, 5, 5), PROMPT + (8, 8)]
    for s in seqs:
        run(cache, dev, s)
    check_invariants(cache, request_pages=0)
    pages_cached = {s[:p] for s in seqs for p in range(PS, len(s) + 1, PS)}
    assert sum(n.num_tokens for n in cache.tree.nodes()) == len(pages_cached) * PS == cache.tree.device_pages * PS
    for q in seqs + [PROMPT[:7], PROMPT[:3] + (1,), (0,), PROMPT[:6] + (1, 1, 1)]:
        m = cache.match(q)
        assert m.hit_tokens % PS == 0 and len(m.device_indices) * PS == m.device_hit_tokens
        assert m.hit_tokens == max(p for p in range(0, len(q) + 1, PS) if p == 0 or q[:p] in pages_cached)
        assert_kv(dev, q, m.device_indices)


def test_load_back_restores_only_the_matched_part_of_a_node(hc):
    cache, dev, host = hc()
    only_on_host(cache, dev, PROMPT)
    h = start(cache, PROMPT[:6] + (4, 4))
    assert h.restored_tokens == 6 and h.prefix_tokens == 6
    asyncio.run(h.wait())
    assert_kv(dev, PROMPT, h.device_indices)
    cache.release(h)
    m = cache.match(PROMPT)
    assert (m.device_hit_tokens, m.host_hit_tokens, len(m.restore_nodes)) == (6, 4, 1)
    assert_quiescent(cache)


def test_stale_match_is_redone(hc):
    cache, dev, _ = hc(device_pages=20)
    run(cache, dev, PROMPT)
    m = cache.match(PROMPT + (1, 1))
    run(cache, dev, PROMPT[:4] + (2, 2, 2, 2))  # splits the node m points into
    h = start(cache, PROMPT)  # fresh match for comparison
    cache.release(h)
    h = cache.load_back_and_lock(m, extra_pages=1)
    assert h.prefix_tokens == 10 and h.node is node_of(cache, PROMPT)
    cache.release(h)
    assert_quiescent(cache)


def test_tokens_as_tensor(hc):
    cache, dev, _ = hc()
    run(cache, dev, PROMPT)
    assert cache.match(torch.tensor(PROMPT)).hit_tokens == 10


@pytest.mark.parametrize("as_ids", [torch.tensor, list])
def test_pages_handed_in_as_a_tensor_or_a_list_are_kept_as_numpy(hc, as_ids):
    """Callers at the edges (the scheduler's page lists, torch code) may pass any ``PageIds``; the tree keeps
    int64 numpy arrays (``check_invariants`` checks the type), and its pages go on to the copy engine."""
    cache, dev, host = hc(device_pages=20)
    h = start(cache, PROMPT + (1,))
    pages = computed(cache, dev, PROMPT + (1,), h)
    h, mine = cache.cache_in_flight(h, PROMPT[:4], as_ids(pages.tolist()))
    assert cache.insert(PROMPT + (1,), as_ids(mine.tolist())) == 4
    cache.free_device(as_ids(mine[5:].tolist()))
    cache.release(h)
    assert_quiescent(cache)
    assert_kv(dev, PROMPT, cache.match(PROMPT).device_indices)
    path = cache.tree.match(token_key(PROMPT))[0]  # and the write_through backups copied them to L2
    assert_kv(host, PROMPT, np.concatenate([n.host_indices for n in path]))


def test_insert_frees_duplicates_and_keeps_partial_page_with_caller(hc):
    cache, dev, _ = hc(device_pages=20)
    run(cache, dev, PROMPT)
    pages = cache.alloc_device(6)  # a request that computed the prompt itself
    write_kv(dev, PROMPT + (1,), pages)
    assert cache.insert(PROMPT + (1,), pages) == 10
    assert cache.device_alloc.num_used == 5 + 1  # the duplicates went back, the partial page is the caller's
    cache.free_device(pages[5:])
    assert_quiescent(cache)


def test_insert_stops_at_a_node_still_loading(hc):
    cache, dev, _ = hc(device_pages=20)
    only_on_host(cache, dev, PROMPT)
    cache.engine.gate.clear()
    h = start(cache, PROMPT)  # node is being restored
    pages = cache.alloc_device(7)
    write_kv(dev, PROMPT + (3, 3, 3, 3), pages)
    assert cache.insert(PROMPT + (3, 3, 3, 3), pages) == 0
    cache.engine.gate.set()
    asyncio.run(h.wait())
    cache.release(h)
    assert cache.match(PROMPT + (3, 3, 3, 3)).hit_tokens == 10
    assert_quiescent(cache)


# -- caching a running request's pages ---------------------------------------------------------------------------


def computed(cache: HierarchicalCache, dev: KVPool, tokens, h) -> np.ndarray:
    """A running request after its forward pass: load-back done, its pages taken and written."""
    asyncio.run(h.wait())
    pages = h.take_pages()
    write_kv(dev, tokens, pages, first_page=h.prefix_tokens // PS)
    return pages


def finish_in_flight(cache: HierarchicalCache, tokens, h, pages: np.ndarray) -> None:
    cache.insert(tokens, pages)
    cache.free_device(pages[max(len(tokens) // PS, len(h.device_indices)) :])
    cache.release(h)


def test_cache_in_flight_shares_a_new_prefix(hc):
    cache, dev, _ = hc()
    tokens = PROMPT + (7,)
    h = start(cache, tokens)
    pages = computed(cache, dev, tokens, h)
    h2, mine = cache.cache_in_flight(h, tokens, pages)
    cache.drain()  # the write_through backup's lock
    assert h.released and np.array_equal(mine, pages) and h2.prefix_tokens == 10
    assert node_of(cache, tokens).lock_ref == 1
    check_invariants(cache, request_pages=1)  # the partial last page
    assert cache.match(PROMPT + (9,)).device_hit_tokens == 10  # a concurrent request hits it now
    with pytest.raises(RuntimeError, match="twice"):
        cache.release(h)
    assert cache.cache_in_flight(h2, tokens, mine) == (h2, mine)  # nothing new: unchanged
    assert_kv(dev, tokens, mine[:5])
    finish_in_flight(cache, tokens, h2, mine)
    assert_quiescent(cache)


def test_cache_in_flight_adopts_the_tree_pages_of_a_prefix_another_request_cached(hc):
    cache, dev, _ = hc(device_pages=16)
    a_tokens, b_tokens = PROMPT, PROMPT + (1, 2, 3)
    a, b = start(cache, a_tokens), start(cache, b_tokens)  # both miss: nothing is cached yet
    a_pages, b_pages = computed(cache, dev, a_tokens, a), computed(cache, dev, b_tokens, b)
    a, a_mine = cache.cache_in_flight(a, a_tokens, a_pages)
    free = cache.device_alloc.num_free
    b, b_mine = cache.cache_in_flight(b, b_tokens, b_pages)
    cache.drain()
    assert cache.device_alloc.num_free == free + 5  # b's copy of the prompt went back
    assert np.array_equal(b_mine[:5], a_pages) and np.array_equal(b_mine[5:], b_pages[5:])
    assert b.prefix_tokens == 12 and node_of(cache, PROMPT).lock_ref == 2
    assert_kv(dev, b_tokens, b_mine[:6])
    check_invariants(cache, request_pages=1)
    finish_in_flight(cache, a_tokens, a, a_mine)
    finish_in_flight(cache, b_tokens, b, b_mine)
    assert_quiescent(cache)


def test_cache_in_flight_revives_a_host_only_node(hc):
    cache, dev, _ = hc(device_pages=16)
    tokens = PROMPT + (3,)
    h = start(cache, tokens)  # admitted before the prompt was cached
    only_on_host(cache, dev, PROMPT)
    node = node_of(cache, PROMPT)
    host = node.host_indices.copy()
    pages = computed(cache, dev, tokens, h)
    h, mine = cache.cache_in_flight(h, tokens, pages)
    assert np.array_equal(mine, pages) and np.array_equal(node.device_indices, pages[:5])
    assert np.array_equal(node.host_indices, host) and node.lock_ref == 1
    check_invariants(cache, request_pages=1)
    finish_in_flight(cache, tokens, h, mine)
    assert_quiescent(cache)


def test_cache_in_flight_keeps_the_pages_past_a_load_back_in_flight(hc):
    cache, dev, _ = hc(device_pages=16)
    tokens = PROMPT + (3,)
    h = start(cache, tokens)  # admitted before anything was cached
    run(cache, dev, PROMPT[:4])
    run(cache, dev, PROMPT)
    cache.drain()
    assert cache.evict_device(3) == 3  # PROMPT[4:] is host-only, PROMPT[:4] stays on L1
    pages = computed(cache, dev, tokens, h)
    cache.engine.gate.clear()
    other = start(cache, PROMPT + (4,))  # restores PROMPT[4:]
    h, mine = cache.cache_in_flight(h, tokens, pages)
    assert h.prefix_tokens == 4 and np.array_equal(mine[2:], pages[2:])  # past the loading node: still the request's
    assert np.array_equal(mine[:2], node_of(cache, PROMPT[:4]).device_indices)
    check_invariants(cache, request_pages=4 + len(other.delta_pages))
    assert_kv(dev, tokens, mine[:5])
    cache.engine.gate.set()
    asyncio.run(other.wait())
    assert_kv(dev, tokens, mine[:5])
    finish(cache, dev, PROMPT + (4,), other)
    h, mine = cache.cache_in_flight(h, tokens, mine)  # the load-back landed: now the rest joins
    assert h.prefix_tokens == 10 and np.array_equal(mine[2:5], node_of(cache, PROMPT).device_indices)
    check_invariants(cache, request_pages=1)
    finish_in_flight(cache, tokens, h, mine)
    assert_quiescent(cache)


# -- tiers and policies ----------------------------------------------------------------------------------------


def test_write_through_backs_up_on_insert(hc):
    cache, dev, host = hc()
    run(cache, dev, PROMPT)
    cache.drain()
    node = node_of(cache, PROMPT)
    assert node.on_device and node.on_host
    assert_kv(host, PROMPT, node.host_indices)
    assert cache.stats().tokens.backed_up == 10


def test_write_through_selective_backs_up_on_second_hit(hc):
    cache, dev, host = hc(write_policy="write_through_selective")
    run(cache, dev, PROMPT)
    run(cache, dev, PROMPT)
    cache.drain()
    assert not node_of(cache, PROMPT).on_host
    run(cache, dev, PROMPT)
    cache.drain()
    node = node_of(cache, PROMPT)
    assert node.on_host
    assert_kv(host, PROMPT, node.host_indices)


def test_write_back_backs_up_on_eviction(hc):
    cache, dev, host = hc(write_policy="write_back", eviction="lru")  # whole leaves
    run(cache, dev, PROMPT)
    cache.drain()
    assert not node_of(cache, PROMPT).on_host
    cache.engine.gate.clear()
    assert cache.evict_device(1) == 5
    node = node_of(cache, PROMPT)
    assert node.on_host and not node.on_device and node.lock_ref == 1  # the copy pins it
    assert cache.device_alloc.num_used == 5 and cache.available_device_pages() == 8
    with pytest.raises(OutOfPages, match="being backed up"):
        cache.alloc_device(8)  # the old pages return only when the copy lands; no second eviction meanwhile
    cache.engine.gate.set()
    cache.drain()
    assert cache.device_alloc.num_used == 0
    assert_kv(host, PROMPT, node.host_indices)
    h = start(cache, PROMPT)
    assert h.restored_tokens == 10
    finish(cache, dev, PROMPT, h)
    assert_quiescent(cache)


def test_write_back_without_room_drops_the_subtree(hc):
    cache, dev, host = hc(write_policy="write_back", host_pages=3)
    run(cache, dev, PROMPT[:4])
    run(cache, dev, PROMPT)
    cache.evict_device(5)  # the 3-page leaf fits in L2, its 2-page parent then does not
    cache.drain()
    assert cache.match(PROMPT).hit_tokens == 0 and not list(cache.tree.nodes())
    assert_quiescent(cache)


def test_eviction_tiers(hc):
    cache, dev, host = hc(write_policy="write_through_selective")
    run(cache, dev, PROMPT)
    run(cache, dev, PROMPT[:4] + (7, 7), backup=True)
    cache.drain()
    cache.evict_device(100)
    # the backed-up path is demoted to host-only; the rest of PROMPT (never backed up) left the tree
    assert cache.match(PROMPT[:4] + (7, 7)).host_hit_tokens == 6 and cache.match(PROMPT).hit_tokens == 4
    assert cache.tree.device_pages == 0
    assert cache.evict_host(1) == 1  # the host-only leaf (7, 7)
    assert cache.match(PROMPT[:4] + (7, 7)).hit_tokens == 4
    assert cache.evict_host(100) == 2
    assert not list(cache.tree.nodes())
    s = cache.stats().tokens
    assert (s.evicted_device, s.evicted_host) == (12, 6)
    assert_quiescent(cache)


def test_reinserting_an_evicted_node_keeps_its_host_copy(hc):
    cache, dev, host = hc()
    only_on_host(cache, dev, PROMPT)
    old_host = node_of(cache, PROMPT).host_indices.copy()
    backed = cache.counters.backed_up
    pages = cache.alloc_device(5)
    write_kv(dev, PROMPT, pages)
    assert cache.insert(PROMPT, pages) == 0
    cache.drain()
    node = node_of(cache, PROMPT)
    assert node.on_device and np.array_equal(node.host_indices, old_host) and cache.counters.backed_up == backed
    assert_quiescent(cache)


def test_alloc_evicts_in_one_batch(hc, monkeypatch):
    cache, dev, _ = hc(device_pages=11, eviction="lru")
    for i in range(5):
        run(cache, dev, (i, i, i, i))
    cache.drain()  # write_through copies pin their nodes until they land
    calls = []
    real = cache.evict_device
    monkeypatch.setattr(cache, "evict_device", lambda n: calls.append(n) or real(n))
    pages = cache.alloc_device(7)
    assert calls == [7 - 0] and len(pages) == 7
    assert [cache.match((i, i, i, i)).device_hit_tokens for i in range(5)] == [0, 0, 0, 0, 4]  # LRU
    cache.free_device(pages)
    assert_quiescent(cache)


@pytest.mark.parametrize("eviction, survivor", [("lru", 2), ("lfu", 0)])
def test_eviction_policy(hc, eviction, survivor):
    cache, dev, _ = hc(device_pages=20, host_pages=None, eviction=eviction)
    for i in range(3):
        run(cache, dev, (i, i, i, i))
    for _ in range(3):
        run(cache, dev, (0, 0, 0, 0))  # 0 is hit often but long ago
    run(cache, dev, (1, 1, 1, 1))
    run(cache, dev, (2, 2, 2, 2))
    cache.evict_device(4)
    assert [i for i in range(3) if cache.match((i, i, i, i)).hit_tokens] == [survivor]


def test_no_host_tier_is_a_plain_radix_cache(hc):
    cache, dev, _ = hc(host_pages=None)
    run(cache, dev, PROMPT)
    assert cache.evict_device(100) == 5 and not list(cache.tree.nodes())
    assert cache.stats().host is None
    assert_quiescent(cache)


def test_out_of_pages_takes_nothing(hc):
    cache, dev, _ = hc(device_pages=9)
    h1 = start(cache, PROMPT)  # 5 pages held by a live request
    h2 = start(cache, (1, 1, 1))
    with pytest.raises(OutOfPages):
        start(cache, (2,) * 6)
    check_invariants(cache, request_pages=7)
    for h in (h1, h2):
        cache.release(h)
    assert_quiescent(cache)


def test_flush_keeps_locked_paths(hc):
    cache, dev, _ = hc(device_pages=20)
    run(cache, dev, PROMPT)
    run(cache, dev, (3, 3, 3, 3))
    h = start(cache, PROMPT)
    cache.drain()  # write_through copies pin their nodes until they land
    assert cache.flush() == 4
    assert cache.match(PROMPT).hit_tokens == 10 and cache.match((3, 3, 3, 3)).hit_tokens == 0
    cache.release(h)
    cache.flush()
    assert not list(cache.tree.nodes())
    assert_quiescent(cache)


def test_stats_counters(hc):
    cache, dev, _ = hc()
    only_on_host(cache, dev, PROMPT)
    run(cache, dev, PROMPT + (1, 1))
    run(cache, dev, PROMPT + (1, 1))
    cache.drain()
    t = cache.stats().tokens
    assert (t.cached_device, t.cached_host) == (12, 10) and t.loaded_back == 10
    assert t.backed_up == 12 and t.evicted_device == 10


# -- failures ----------------------------------------------------------------------------------------------------


def test_failed_load_back_reverts_and_balances(hc):
    cache, dev, host = hc()
    only_on_host(cache, dev, PROMPT)
    cache.engine.fail_next = 1
    h = start(cache, PROMPT + (1,))
    with pytest.raises(LoadBackError):
        asyncio.run(h.wait())
    cache.release(h)
    assert_quiescent(cache)
    m = cache.match(PROMPT)
    assert (m.device_hit_tokens, m.host_hit_tokens) == (0, 10)  # the host copy is intact
    run(cache, dev, PROMPT)
    assert_quiescent(cache)


def test_failed_write_through_backup_keeps_device_copy(hc):
    cache, dev, host = hc()
    cache.engine.fail_next = 1
    run(cache, dev, PROMPT)
    cache.drain()
    node = node_of(cache, PROMPT)
    assert node.on_device and not node.on_host
    assert_quiescent(cache)


def test_failed_write_back_demotion_removes_the_node(hc):
    cache, dev, host = hc(write_policy="write_back")
    run(cache, dev, PROMPT)
    cache.engine.fail_next = 1
    cache.evict_device(100)
    cache.drain()
    assert not list(cache.tree.nodes())
    assert_quiescent(cache)


def test_load_depending_on_a_failed_demotion_fails(hc):
    cache, dev, host = hc(device_pages=20, write_policy="write_back")
    run(cache, dev, PROMPT)
    cache.engine.gate.clear()
    cache.engine.fail_next = 1
    cache.evict_device(100)
    h = start(cache, PROMPT)  # restores from host pages whose backup is still queued
    cache.engine.gate.set()
    with pytest.raises(LoadBackError):
        asyncio.run(h.wait())
    cache.release(h)
    assert cache.match(PROMPT).hit_tokens == 0
    assert_quiescent(cache)


# -- copy engine ---------------------------------------------------------------------------------------------------


def test_copy_engine_round_trip_in_order():
    dev, host = KVPool(LAYOUT, 6), KVPool(LAYOUT, 6)
    dev.buffer.copy_(torch.randn_like(dev.buffer))
    engine = CopyEngine(dev.buffer, host.buffer)
    try:
        src, mid, back = torch.tensor([1, 4]), torch.tensor([5, 0]), torch.tensor([2, 3])
        futures = [engine.backup(src, mid), engine.load(mid, back)]  # FIFO: the load sees the backup

        async def both():
            await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))

        asyncio.run(both())
        assert torch.equal(host.buffer[mid], dev.buffer[src])
        assert torch.equal(dev.buffer[back], dev.buffer[src])
    finally:
        engine.close()


# -- sizing ----------------------------------------------------------------------------------------------------------


def test_host_pool_sizing():
    big = 10**15
    assert host_pool_pages(LAYOUT, 100, available_bytes=big) == 300
    assert host_pool_pages(LAYOUT, 100, ratio=1.5, available_bytes=big) == 150
    one_gb_pages = 10**9 // LAYOUT.page_bytes
    assert host_pool_pages(LAYOUT, 100, ratio=3.0, size_gb=1, available_bytes=big) == one_gb_pages
    with pytest.raises(ValueError, match="ratio"):
        host_pool_pages(LAYOUT, 100, ratio=0, available_bytes=big)
    with pytest.raises(ValueError, match="size"):
        host_pool_pages(LAYOUT, 100, size_gb=-1, available_bytes=big)


def test_host_pool_refused_when_host_lacks_memory():
    with pytest.raises(InsufficientHostMemory) as err:
        host_pool_pages(LAYOUT, 10, size_gb=64, available_bytes=8 * 10**9)
    msg = str(err.value)
    assert "64.00 GB" in msg and "only 8.00 GB available" in msg and "--disaggregation-decode-hicache-size" in msg
    assert mem_available_bytes() > 0
    with pytest.raises(InsufficientHostMemory):
        host_pool_pages(LAYOUT, 10, size_gb=mem_available_bytes() / 1e9 + 1)


def test_make_host_pool_on_cpu_is_not_pinned():
    dev = KVPool(LAYOUT, 4)
    pool = make_host_pool(LAYOUT, 12, dev)
    assert pool.num_pages == 12 and pool.device.type == "cpu" and not pool.buffer.is_pinned()


# -- the page allocator ------------------------------------------------------------------------------------------


def test_allocator_hands_out_low_pages_first_and_reuses_the_last_freed_first():
    alloc = PageAllocator(8, reserved=1)
    assert alloc.alloc(3).tolist() == [1, 2, 3] and alloc.num_free == 4
    alloc.free(np.array([2, 3]))
    assert alloc.alloc(2).tolist() == [2, 3] and alloc.alloc(4).tolist() == [4, 5, 6, 7]
    with pytest.raises(OutOfPages):
        alloc.alloc(1)
    check_allocator(alloc)


@pytest.mark.parametrize("bad", [[3, 3], [2, 4], [0], [-1], [8], [5, 3]], ids=[
    "twice-in-one-call", "one-already-free", "reserved", "negative", "past-the-pool", "freed-before"])
@pytest.mark.parametrize("as_ids", [np.array, torch.tensor, list])  # the cache's arrays, and what edges pass
def test_allocator_refuses_a_bad_free_and_frees_none_of_it(bad, as_ids):
    alloc = PageAllocator(8, reserved=1)
    alloc.alloc(7)  # every page: -1 must not pass as the last one
    alloc.free(as_ids([4, 5]))
    alloc.free(as_ids([]))
    free = alloc.num_free
    with pytest.raises(RuntimeError, match="free|foreign"):
        alloc.free(as_ids(bad))
    assert alloc.num_free == free
    check_allocator(alloc)
    alloc.free(torch.tensor([3, 1]))  # the good pages of the refused batch are still in use
    assert alloc.num_free == free + 2
