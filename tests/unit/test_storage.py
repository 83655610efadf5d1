"""L3 storage: page records, the file backend, prefetch policies and the StorageTier's failure handling."""
from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import time
from pathlib import Path

import pytest
import torch

from decode_worker.cache.node import chain_hashes, token_key
from decode_worker.cache.pool import KVLayout, KVPool
from decode_worker.cache.radix_tree import RadixTree
from decode_worker.cache.storage import (
    FileStore,
    PrefetchPolicy,
    RecordError,
    StorageTier,
    StoreBackend,
)
from decode_worker.cache.storage.base import HEADER_BYTES, decode_record, encode_record
from decode_worker.config import ServerConfig
from decode_worker.engine.wiring import open_storage

PS = 4
LAYOUT = KVLayout("test", num_layers=2, num_kv_heads=2, head_dim=8, page_size=PS, dtype=torch.float32)
RECORD_BYTES = HEADER_BYTES + LAYOUT.page_bytes


def page_keys(layout: KVLayout, tokens: list[int]) -> list[str]:
    """The L3 keys of the whole pages of ``tokens``, exactly as the radix tree names them."""
    tree = RadixTree(layout.page_size, layout.fingerprint())
    return [h.hex() for h in chain_hashes(token_key(tokens), layout.page_size, tree.root_hash)]


def filled_pool(num_pages: int = 16, seed: int = 0, layout: KVLayout = LAYOUT) -> KVPool:
    pool = KVPool(layout, num_pages)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=torch.Generator().manual_seed(seed)))
    return pool


def pages(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64)


KEYS = page_keys(LAYOUT, list(range(8 * PS)))  # 8 pages of one prefix


class Wrapped(StoreBackend):
    """Delegates to a real store; subclasses inject latency or failures into chosen calls."""

    def __init__(self, inner: StoreBackend):
        self.inner = inner
        self.name = "wrapped"
        self.puts: list[list[str]] = []

    async def exists(self, keys):
        return await self.inner.exists(keys)

    async def get(self, keys):
        return await self.inner.get(keys)

    async def put(self, keys, records):
        self.puts.append(list(keys))
        await self.inner.put(keys, records)

    async def delete(self, keys):
        await self.inner.delete(keys)


class Slow(Wrapped):
    """Every get takes ``delay_s`` (a slow disk or network)."""

    def __init__(self, inner, delay_s: float):
        super().__init__(inner)
        self.delay_s = delay_s

    async def get(self, keys):
        await asyncio.sleep(self.delay_s)
        return await self.inner.get(keys)


class Broken(Wrapped):
    """Calls named in ``ops`` raise ``error`` while ``broken`` is set."""

    def __init__(self, inner, error: Exception, ops: tuple[str, ...] = ("exists", "get", "put")):
        super().__init__(inner)
        self.error, self.ops = error, ops
        self.broken = True
        self.calls = 0

    async def _gate(self, op: str):
        self.calls += 1
        if self.broken and op in self.ops:
            raise self.error

    async def exists(self, keys):
        await self._gate("exists")
        return await super().exists(keys)

    async def get(self, keys):
        await self._gate("get")
        return await super().get(keys)

    async def put(self, keys, records):
        await self._gate("put")
        await super().put(keys, records)


def make_tier(tmp_path: Path, wrap=None, **kw) -> StorageTier:
    store = FileStore(tmp_path / "l3", max_bytes=1 << 30)
    return StorageTier(wrap(store) if wrap else store, LAYOUT, **kw)


async def fill(tier: StorageTier, src: KVPool, keys: list[str] = KEYS) -> None:
    assert tier.backup(keys, src, torch.arange(len(keys))) == len(keys)
    await tier.flush()


def same_pages(a: KVPool, a_pages: torch.Tensor, b: KVPool, b_pages: torch.Tensor) -> bool:
    return torch.equal(a.buffer[a_pages], b.buffer[b_pages])


# -- records -----------------------------------------------------------------------------------------------------------


def test_record_round_trip_and_every_header_check():
    payload = os.urandom(LAYOUT.page_bytes)
    fp, key = LAYOUT.fingerprint(), KEYS[0]
    rec = encode_record(key, fp, payload)
    assert len(rec) == RECORD_BYTES and bytes(decode_record(rec, key, fp, LAYOUT.page_bytes)) == payload

    def reason(record: bytes, key: str = key, fp: str = fp) -> str:
        with pytest.raises(RecordError) as err:
            decode_record(record, key, fp, LAYOUT.page_bytes)
        return err.value.reason

    flip = lambda i: rec[:i] + bytes([rec[i] ^ 1]) + rec[i + 1 :]  # noqa: E731
    assert reason(rec[:10]) == "short"
    assert reason(rec[:-1]) == "short"
    assert reason(rec + b"\0") == "corrupt"
    assert reason(flip(0)) == "corrupt"  # magic
    assert reason(flip(HEADER_BYTES + 100)) == "corrupt"  # payload bit: checksum
    assert reason(flip(6)) == "corrupt"  # reserved header field: covered by the checksum too
    assert reason(rec, key=KEYS[1]) == "corrupt"  # a record stored under another page's key
    assert reason(rec, fp="0" * 32) == "foreign"
    bigger = KVLayout("other", 2, 2, 8, PS, torch.float64)  # another model's page is another size
    assert reason(encode_record(key, bigger.fingerprint(), bytes(bigger.page_bytes))) == "foreign"


# -- file backend ------------------------------------------------------------------------------------------------------


def test_file_store_round_trip(tmp_path):
    store = FileStore(tmp_path, max_bytes=1 << 30)
    records = [os.urandom(100) for _ in KEYS[:3]]

    async def go():
        assert await store.exists(KEYS[:3]) == 0
        await store.put(KEYS[:3], records)
        assert await store.exists(KEYS) == 3
        assert await store.get(KEYS[:4]) == [*records, None]
        await store.put(KEYS[:1], [b"other"])  # a present key keeps its record
        assert await store.get(KEYS[:1]) == records[:1]
        await store.delete(KEYS[1:2])
        assert await store.exists(KEYS[:3]) == 1

    asyncio.run(go())
    assert store.used_bytes == 200


def test_file_store_write_is_atomic(tmp_path, monkeypatch):
    """A writer dying mid-record leaves neither a partial page nor its temporary file."""
    store = FileStore(tmp_path, max_bytes=1 << 30)
    real = Path.write_bytes

    def dies_halfway(self, data):
        real(self, data[: len(data) // 2])
        raise OSError(errno.EIO, "disk gone")

    monkeypatch.setattr(Path, "write_bytes", dies_halfway)
    with pytest.raises(OSError):
        asyncio.run(store.put(KEYS[:1], [os.urandom(1000)]))
    monkeypatch.undo()
    assert not any(p.is_file() for p in tmp_path.rglob("*")), list(tmp_path.rglob("*"))
    assert asyncio.run(store.exists(KEYS[:1])) == 0 and store.used_bytes == 0
    asyncio.run(store.put(KEYS[:1], [b"x" * 1000]))
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == [KEYS[0] + ".page"]


def test_file_store_lru_cap(tmp_path):
    """Past the cap, least recently used pages go first (a read counts as a use), down to 90% of the cap."""
    rec = b"x" * 1000
    store = FileStore(tmp_path, max_bytes=4400)

    async def go():
        await store.put(KEYS[:4], [rec] * 4)
        await store.get(KEYS[:1])  # page 0 is now the most recently used
        await asyncio.sleep(0.01)  # file times have a few ms granularity
        await store.put(KEYS[4:5], [rec])  # 5000 > 4400: evict down to 3960, i.e. pages 1 then 2
        return [k for k in KEYS[:5] if await store.exists([k])]

    assert asyncio.run(go()) == [KEYS[0], KEYS[3], KEYS[4]]
    assert store.used_bytes == 3000
    time.sleep(0.01)
    asyncio.run(store.get(KEYS[3:4]))  # on disk (mtime) too: a fresh index orders by it
    smaller = FileStore(tmp_path, max_bytes=2000)  # restart with a lower cap: clean-up at start, LRU first
    assert smaller.used_bytes == 1000
    assert [k for k in KEYS[:5] if asyncio.run(smaller.exists([k]))] == [KEYS[3]]


def test_file_store_removes_stale_temp_files_at_start(tmp_path):
    store = FileStore(tmp_path, max_bytes=1 << 30)
    asyncio.run(store.put(KEYS[:1], [b"page"]))
    sub = store.path(KEYS[0]).parent
    stale, fresh = sub / ".a.1.2.tmp", sub / ".b.1.2.tmp"
    stale.write_bytes(b"half")
    fresh.write_bytes(b"half")  # may be a live writer of another worker sharing the folder
    os.utime(stale, (time.time() - 7200,) * 2)
    FileStore(tmp_path, max_bytes=1 << 30)
    assert not stale.exists() and fresh.exists()


# -- tier: data path ---------------------------------------------------------------------------------------------------


def test_tier_backup_then_prefetch_round_trip(tmp_path):
    src, dst = filled_pool(seed=1), KVPool(LAYOUT, 16)
    tier = make_tier(tmp_path)
    dst_pages = pages(15, 3, 9, 4, 11, 2, 7, 8)  # any L2 pages, any order

    async def go():
        await fill(tier, src)
        assert await tier.exists(KEYS) == 8
        assert await tier.prefetch(KEYS, dst, dst_pages, None) == 8
        await tier.close()

    asyncio.run(go())
    assert same_pages(src, torch.arange(8), dst, dst_pages)
    stats = tier.stats()
    assert stats.backed_up_tokens == stats.prefetched_tokens == 8 * PS and stats.failures == {}


def test_tier_backup_copies_pages_before_returning(tmp_path):
    """L2 may reuse a page as soon as backup() returns: what is stored is the data at the call."""
    src, dst = filled_pool(seed=2), KVPool(LAYOUT, 16)
    expect = src.buffer[:4].clone()
    tier = make_tier(tmp_path)

    async def go():
        tier.backup(KEYS[:4], src, torch.arange(4))
        src.buffer.zero_()  # evicted and overwritten before the background put ran
        await tier.flush()
        return await tier.prefetch(KEYS[:4], dst, torch.arange(4), None)

    assert asyncio.run(go()) == 4
    assert torch.equal(dst.buffer[:4], expect)


def test_tier_backup_skips_pages_already_stored(tmp_path):
    src = filled_pool()
    tier = make_tier(tmp_path, wrap=Wrapped, batch_pages=8)

    async def go():
        await fill(tier, src, KEYS[:3])
        await fill(tier, src, KEYS[:5])  # a second pod's backup of a longer prefix: only the new pages go out

    asyncio.run(go())
    assert tier.backend.puts == [KEYS[:3], KEYS[3:5]]


def test_prefetch_stops_at_first_gap(tmp_path):
    src, dst = filled_pool(), KVPool(LAYOUT, 16)
    tier = make_tier(tmp_path, batch_pages=8)

    async def go():
        await fill(tier, src)
        await tier.backend.delete(KEYS[2:3])
        assert await tier.exists(KEYS) == 2
        return await tier.prefetch(KEYS, dst, torch.arange(8), None)

    assert asyncio.run(go()) == 2
    assert same_pages(src, torch.arange(2), dst, torch.arange(2))
    assert not dst.buffer[2:].any(), "pages after the gap were written"
    assert tier.stats().failures == {}  # a miss is not a failure


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda p: p.write_bytes(p.read_bytes()[: RECORD_BYTES // 2]), "short"),
        (lambda p: p.write_bytes(p.read_bytes()[:-1]), "short"),
        (lambda p: p.write_bytes(p.read_bytes()[:-7] + bytes(7)), "corrupt"),
    ],
    ids=["truncated", "last-byte-missing", "bad-checksum"],
)
def test_damaged_page_is_a_counted_miss_and_gets_deleted(tmp_path, damage, reason):
    src, dst = filled_pool(), KVPool(LAYOUT, 16)
    tier = make_tier(tmp_path)

    async def go():
        await fill(tier, src)
        damage(tier.backend.path(KEYS[3]))
        n = await tier.prefetch(KEYS, dst, torch.arange(8), None)
        await asyncio.gather(*tier._side_tasks)  # the background delete of the damaged page
        return n, await tier.exists(KEYS)

    assert asyncio.run(go()) == (3, 3)  # pages before it arrive; it is gone so a later backup can rewrite it
    assert same_pages(src, torch.arange(3), dst, torch.arange(3)) and not dst.buffer[3:].any()
    assert tier.stats().failures == {"prefetch": {reason: 1}}


def test_foreign_fingerprint_page_is_a_miss(tmp_path):
    """A page of another model under one of our keys (same page size in bytes) is never loaded."""
    other = KVLayout("another-model", LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, PS, LAYOUT.dtype)
    assert other.page_bytes == LAYOUT.page_bytes and page_keys(other, list(range(PS))) != KEYS[:1]
    src, dst = filled_pool(), KVPool(LAYOUT, 16)
    tier = make_tier(tmp_path)

    async def go():
        await fill(tier, src, KEYS[:2])
        foreign = encode_record(KEYS[2], other.fingerprint(), os.urandom(other.page_bytes))
        await tier.backend.put(KEYS[2:3], [foreign])
        return await tier.prefetch(KEYS[:3], dst, torch.arange(3), None), await tier.exists(KEYS[:3])

    assert asyncio.run(go()) == (2, 3)  # not deleted: it is someone else's page
    assert not dst.buffer[2].any()
    assert tier.stats().failures == {"prefetch": {"foreign": 1}}


def test_records_of_the_layer_major_layout_are_never_loaded(tmp_path):
    """The pool went page-major: a page's bytes are ordered differently, so records stored by a layer-major worker
    (same shape, a fingerprint without ``order``) must neither share our keys nor load under them."""
    described = {k: v for k, v in LAYOUT.describe().items() if k != "order"}
    assert LAYOUT.describe()["order"] == "page_major" and LAYOUT.differences(described) == [
        "order: ours='page_major' theirs=None"]
    legacy = hashlib.sha256(";".join(f"{k}={v}" for k, v in sorted(described.items())).encode()).hexdigest()[:32]
    assert legacy != LAYOUT.fingerprint()
    assert [h.hex() for h in chain_hashes(token_key(list(range(PS))), PS, RadixTree(PS, legacy).root_hash)] != KEYS[:1]
    dst, tier = KVPool(LAYOUT, 4), make_tier(tmp_path)

    async def go():
        await tier.backend.put(KEYS[:1], [encode_record(KEYS[0], legacy, os.urandom(LAYOUT.page_bytes))])
        return await tier.prefetch(KEYS[:1], dst, torch.arange(1), None)

    assert asyncio.run(go()) == 0 and not dst.buffer.any()
    assert tier.stats().failures == {"prefetch": {"foreign": 1}}


def test_tier_rejects_a_host_pool_of_another_layout(tmp_path):
    other = KVLayout("test", 2, 2, 8, PS, torch.float16)
    with pytest.raises(ValueError, match="layout"):
        make_tier(tmp_path).backup(KEYS[:1], KVPool(other, 4), pages(0))


# -- tier: prefetch policies and deadlines -----------------------------------------------------------------------------


def test_policy_deadlines():
    timeout = PrefetchPolicy("timeout", base_s=1.0, per_1k_tokens_s=0.5, cap_s=4.0)
    assert timeout.deadline_s(0) == 1.0
    assert timeout.deadline_s(2000) == 2.0
    assert timeout.deadline_s(100_000) == 4.0  # capped
    assert PrefetchPolicy("best_effort").deadline_s(10_000) == 0.0
    assert PrefetchPolicy("wait_complete", hard_cap_s=30.0).deadline_s(10**9) == 30.0
    with pytest.raises(ValueError):
        PrefetchPolicy("eventually")


def test_prefetch_deadline_honoured_with_a_slow_store(tmp_path):
    """timeout policy: the request proceeds at its deadline with the pages that arrived; nothing lands later."""
    src, dst = filled_pool(), KVPool(LAYOUT, 16)
    policy = PrefetchPolicy("timeout", base_s=0.45, per_1k_tokens_s=0.0, cap_s=10.0)
    tier = make_tier(tmp_path, wrap=lambda s: Slow(s, 0.2), batch_pages=1, policy=policy)

    async def go():
        await fill(tier, src)
        deadline = tier.prefetch_deadline_s(len(KEYS) * PS)
        t0 = time.monotonic()
        n = await tier.prefetch(KEYS, dst, torch.arange(8), deadline)
        waited = time.monotonic() - t0
        await asyncio.sleep(0.5)  # the fetch that was in flight at the deadline completes in its thread
        return n, waited

    n, waited = asyncio.run(go())
    assert 0.44 <= waited < 1.0, waited
    assert 1 <= n <= 2, n  # one page per 0.2 s
    assert same_pages(src, torch.arange(n), dst, torch.arange(n))
    assert not dst.buffer[n:].any(), "a page was written after the prefetch stopped"


def test_best_effort_does_not_wait_and_wait_complete_gets_everything(tmp_path):
    src, dst = filled_pool(), KVPool(LAYOUT, 16)
    tier = make_tier(tmp_path, wrap=lambda s: Slow(s, 0.05), batch_pages=2)

    async def go():
        await fill(tier, src)
        t0 = time.monotonic()
        op = tier.start_prefetch(KEYS, dst, torch.arange(8))
        first = await op.wait(PrefetchPolicy("best_effort").deadline_s(8 * PS))
        immediate = time.monotonic() - t0
        done = await op.wait(PrefetchPolicy("wait_complete").deadline_s(8 * PS))  # still running in the background
        return first, immediate, done, op.done

    first, immediate, done, finished = asyncio.run(go())
    assert first == 0 and immediate < 0.5
    assert done == 8 and finished
    assert same_pages(src, torch.arange(8), dst, torch.arange(8))


# -- tier: store failures ----------------------------------------------------------------------------------------------


def test_store_down_degrades_to_misses_and_recovers(tmp_path):
    src, dst = filled_pool(), KVPool(LAYOUT, 16)
    tier = make_tier(tmp_path, wrap=lambda s: Broken(s, ConnectionRefusedError("store down")), down_for_s=0.3)
    store = tier.backend

    async def go():
        assert await tier.exists(KEYS) == 0  # fails: the circuit opens
        assert tier.is_down
        calls = store.calls
        assert await tier.prefetch(KEYS, dst, torch.arange(8), 1.0) == 0
        assert tier.backup(KEYS, src, torch.arange(8)) == 0
        assert store.calls == calls, "calls reached the store while its circuit was open"
        store.broken = False
        await asyncio.sleep(0.35)
        await fill(tier, src)  # the first call after the window probes the store, finds it back
        return await tier.exists(KEYS), await tier.prefetch(KEYS, dst, torch.arange(8), None)

    assert asyncio.run(go()) == (8, 8)
    assert tier.stats().failures == {
        "exists": {"down": 1},
        "prefetch": {"unavailable": 1},
        "backup": {"unavailable": 1},
    }


def test_slow_store_calls_time_out(tmp_path):
    tier = make_tier(tmp_path, wrap=lambda s: Slow(s, 5.0), op_timeout_s=0.1)
    dst = KVPool(LAYOUT, 16)

    async def go():
        t0 = time.monotonic()
        n = await tier.prefetch(KEYS, dst, torch.arange(8), None)  # wait_complete-like: bounded by the op deadline
        return n, time.monotonic() - t0

    n, took = asyncio.run(go())
    assert n == 0 and took < 1.0
    assert tier.stats().failures == {"prefetch": {"timeout": 1}} and tier.is_down


def test_full_store_counts_but_keeps_serving_reads(tmp_path):
    src, dst = filled_pool(), KVPool(LAYOUT, 16)
    tier = make_tier(tmp_path, wrap=lambda s: Broken(s, OSError(errno.ENOSPC, "No space left on device"), ops=("put",)))

    async def go():
        tier.backend.broken = False
        await fill(tier, src, KEYS[:2])
        tier.backend.broken = True
        await fill(tier, src, KEYS)
        return await tier.prefetch(KEYS, dst, torch.arange(8), None)

    assert asyncio.run(go()) == 2
    assert tier.stats().failures == {"backup": {"full": 1}} and not tier.is_down


def test_backup_queue_is_bounded(tmp_path):
    src = filled_pool()
    tier = make_tier(tmp_path, backup_queue_bytes=3 * LAYOUT.page_bytes)

    async def go():
        assert tier.backup(KEYS[:2], src, torch.arange(2)) == 2
        assert tier.backup(KEYS[2:4], src, torch.arange(2, 4)) == 0  # 4 pages > 3 queued: dropped
        await tier.flush()
        assert tier.backup(KEYS[2:4], src, torch.arange(2, 4)) == 2  # drained: room again
        await tier.flush()
        return await tier.exists(KEYS)

    assert asyncio.run(go()) == 4
    assert tier.stats().failures == {"backup": {"queue_full": 1}}


def test_open_storage_from_flags(tmp_path):
    cfg = ServerConfig(hicache_storage_backend="file", hicache_storage_url=str(tmp_path),
                       hicache_storage_prefetch_policy="timeout", hicache_storage_prefetch_timeout_base_s=0.5,
                       hicache_storage_prefetch_timeout_per_1k_tokens_s=1.0, hicache_storage_prefetch_timeout_cap_s=2.0,
                       hicache_storage_file_max_gb=0.001)
    tier = open_storage(cfg, LAYOUT)
    assert isinstance(tier.backend, FileStore) and tier.backend.max_bytes == 1_000_000
    assert tier.prefetch_deadline_s(1000) == 1.5 and tier.prefetch_deadline_s(10_000) == 2.0
    assert open_storage(ServerConfig(), LAYOUT) is None
