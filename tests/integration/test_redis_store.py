"""L3 against real stores: a redis-server the suite starts on loopback, and the file backend across a restart.

Pages are SmolLM2-sized (30 layers, 3 KV heads, head_dim 64, 16-token pages, fp32: 737,280 bytes each).
"""
from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import torch

from decode_worker.cache.node import chain_hashes, token_key
from decode_worker.cache.pool import KVLayout, KVPool
from decode_worker.cache.radix_tree import RadixTree
from decode_worker.cache.storage import FileStore, StorageTier
from decode_worker.cache.storage.redis_store import RedisStore
from tests.servers import free_port

LAYOUT = KVLayout(
    "SmolLM2-135M-Instruct", num_layers=30, num_kv_heads=3, head_dim=64, page_size=16, dtype=torch.float32
)
PAGES = 6
PROMPT = [(7 * i + 3) % 49152 for i in range(PAGES * LAYOUT.page_size + 5)]  # 6 whole pages and a partial one
REDIS_SERVER = shutil.which("redis-server")


def page_keys(layout: KVLayout, tokens: list[int]) -> list[str]:
    """The L3 keys of the whole pages of ``tokens``, exactly as the radix tree names them."""
    tree = RadixTree(layout.page_size, layout.fingerprint())
    return [h.hex() for h in chain_hashes(token_key(tokens), layout.page_size, tree.root_hash)]


KEYS = page_keys(LAYOUT, PROMPT)


def source_pool(seed: int = 0) -> KVPool:
    """The KV a worker computed for PROMPT, in L2 pages 0..PAGES-1 (deterministic, so a restart can compare)."""
    pool = KVPool(LAYOUT, PAGES + 2)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=torch.Generator().manual_seed(seed)))
    return pool


class RedisServer:
    """A throwaway redis-server on a loopback port: no persistence, stoppable and restartable on that port."""

    def __init__(self, binary: str, port: int, workdir: Path):
        self.binary, self.port, self.workdir = binary, port, workdir
        self.url = f"redis://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.workdir / "redis.log", "ab") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", str(self.workdir), "--daemonize", "no"],
                stdout=log, stderr=subprocess.STDOUT,
            )
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not start:\n" + (self.workdir / "redis.log").read_text())
                time.sleep(0.05)
            finally:
                client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


@pytest.fixture
def redis_server(tmp_path):
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (`make system-deps` installs it: apt-get install redis-server)")
    server = RedisServer(REDIS_SERVER, free_port(), tmp_path)
    server.start()
    yield server
    server.stop()


def redis_tier(server: RedisServer, **kw) -> StorageTier:
    return StorageTier(RedisStore(server.url, timeout_s=1.0), LAYOUT, **kw)


def test_redis_store_round_trip(redis_server):
    store = RedisStore(redis_server.url)
    records = [bytes([i]) * 737_280 for i in range(3)]

    async def go():
        assert await store.exists(KEYS) == 0
        await store.put(KEYS[:3], records)
        assert await store.exists(KEYS) == 3
        assert await store.get(KEYS[:4]) == [*records, None]
        await store.put(KEYS[:1], [b"other"])  # present keys keep their record
        assert (await store.get(KEYS[:1]))[0] == records[0]
        await store.delete(KEYS[1:2])
        assert await store.exists(KEYS) == 1
        await store.close()

    asyncio.run(go())
    assert redis.Redis(port=redis_server.port).exists("dwkv:" + KEYS[0]) == 1  # namespaced keys


def test_two_workers_share_one_redis(redis_server):
    """A prefix the first worker backed up is a storage hit for the second, byte for byte."""
    src = source_pool()
    other_model = KVLayout("another-model", 30, 3, 64, 16, torch.float32)

    async def go():
        first, second = redis_tier(redis_server), redis_tier(redis_server)
        assert await second.exists(KEYS) == 0
        assert first.backup(KEYS, src, torch.arange(PAGES)) == PAGES
        await first.flush()
        hits = await second.exists(KEYS)
        dst = KVPool(LAYOUT, PAGES + 3)
        dst_pages = torch.arange(PAGES + 2, 2, -1)[:PAGES]
        arrived = await second.prefetch(KEYS, dst, dst_pages, None)
        same = torch.equal(dst.buffer[dst_pages].view(torch.uint8), src.buffer[:PAGES].view(torch.uint8))
        foreign = StorageTier(RedisStore(redis_server.url), other_model)
        foreign_hits = await foreign.exists(page_keys(other_model, PROMPT))  # another model's keys never match
        for tier in (first, second, foreign):
            await tier.close()
        return hits, arrived, same, foreign_hits, first.stats(), second.stats()

    hits, arrived, same, foreign_hits, s1, s2 = asyncio.run(go())
    assert (hits, arrived, same, foreign_hits) == (PAGES, PAGES, True, 0)
    assert s1.backed_up_tokens == s2.prefetched_tokens == PAGES * 16
    assert s1.failures == s2.failures == {}


class PauseAfter(RedisStore):
    """Holds the get after the first ``n`` until released: lets a test stop the server mid-prefetch."""

    def __init__(self, url: str, n: int):
        super().__init__(url, timeout_s=1.0)
        self.n, self.paused, self.release = n, asyncio.Event(), asyncio.Event()

    async def get(self, keys):
        if self.n == 0:
            self.paused.set()
            await self.release.wait()
        self.n -= 1
        return await super().get(keys)


def test_redis_stopped_mid_run_degrades_and_recovers(redis_server):
    src = source_pool()

    async def go():
        tier = redis_tier(redis_server, down_for_s=0.5, batch_pages=1)
        await asyncio.wait_for(_fill(tier, src), 10)
        reader = StorageTier(PauseAfter(redis_server.url, 2), LAYOUT, op_timeout_s=1.0, down_for_s=0.5, batch_pages=1)
        dst = KVPool(LAYOUT, PAGES)
        op = reader.start_prefetch(KEYS, dst, torch.arange(PAGES))
        await reader.backend.paused.wait()  # two pages arrived, the third get is about to go out
        await asyncio.to_thread(redis_server.stop)
        reader.backend.release.set()
        t0 = time.monotonic()
        arrived = await op.wait(None)
        # While it is down every call returns a miss at once: the first fails fast, the rest skip the store.
        misses = (
            await tier.exists(KEYS),
            await tier.exists(KEYS),
            await tier.prefetch(KEYS, dst, torch.arange(PAGES), 5.0),
            tier.backup(KEYS, src, torch.arange(PAGES)),
        )
        degraded_s = time.monotonic() - t0
        during = tier.stats().failures, reader.stats().failures
        await asyncio.to_thread(redis_server.start)  # a new, empty server on the same port
        await asyncio.sleep(0.6)
        await asyncio.wait_for(_fill(tier, src), 10)
        after = await reader.exists(KEYS), await reader.prefetch(KEYS, dst, torch.arange(PAGES), None)
        await tier.close()
        await reader.close()
        return arrived, misses, degraded_s, during, after, dst

    arrived, misses, degraded_s, (failures, reader_failures), after, dst = asyncio.run(go())
    assert arrived == 2
    assert misses == (0, 0, 0, 0) and degraded_s < 1.0
    assert reader_failures == {"prefetch": {"down": 1}}
    assert failures == {
        "exists": {"down": 1, "unavailable": 1}, "prefetch": {"unavailable": 1}, "backup": {"unavailable": 1}
    }
    assert after == (PAGES, PAGES)
    assert torch.equal(dst.buffer.view(torch.uint8), source_pool().buffer[:PAGES].view(torch.uint8))


async def _fill(tier: StorageTier, src: KVPool) -> None:
    before = tier.backed_up_pages
    assert tier.backup(KEYS, src, torch.arange(PAGES)) == PAGES
    await tier.flush()
    assert tier.backed_up_pages == before + PAGES, tier.stats()


_FILL_IN_A_WORKER = """
import asyncio, sys, torch
from decode_worker.cache.storage import FileStore, StorageTier
from tests.integration.test_redis_store import KEYS, LAYOUT, PAGES, _fill, source_pool

async def main():
    tier = StorageTier(FileStore(sys.argv[1], max_bytes=1 << 30), LAYOUT)
    await _fill(tier, source_pool())
    await tier.close()

asyncio.run(main())
"""


def test_file_store_survives_a_worker_restart(tmp_path):
    """A worker process fills L3 and exits; a fresh one on the same folder gets hits and identical KV."""
    folder = tmp_path / "l3"
    repo = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", _FILL_IN_A_WORKER, str(folder)], cwd=repo, check=True, timeout=120)

    async def go():
        tier = StorageTier(FileStore(folder, max_bytes=1 << 30), LAYOUT)
        dst = KVPool(LAYOUT, PAGES)
        found = await tier.exists(KEYS), await tier.prefetch(KEYS, dst, torch.arange(PAGES), None)
        await tier.close()
        return found, dst, tier

    (hits, arrived), dst, tier = asyncio.run(go())
    assert (hits, arrived) == (PAGES, PAGES)
    assert torch.equal(dst.buffer.view(torch.uint8), source_pool().buffer[:PAGES].view(torch.uint8))
    assert tier.backend.used_bytes == sum(p.stat().st_size for p in folder.rglob("*.page"))
