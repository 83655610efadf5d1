"""L3 storage benchmark: put / get throughput of each backend on SmolLM2-sized pages.

A page is 16 tokens of SmolLM2-135M KV in fp32: 30 layers x K,V x 16 slots x 3 KV heads x 64 dims = 737,280
bytes. For each backend (a folder in a temporary directory; a redis-server started on a loopback port, or
``--redis-url``) it times two layers: the raw store (pre-encoded records) and the StorageTier the cache calls
(backup: copy out of L2, checksum, put; prefetch: get, verify, write into L2), the time the synchronous
``backup()`` call holds the event loop (its copy out of L2), and the longest event-loop stall while the backup is
stored and the prefetch runs (the tier must keep the loop free). Prints one JSON line.

    .venv/bin/python benchmarks/bench_storage.py [--pages 64] [--redis-url redis://host:port]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from decode_worker.cache.node import chain_hashes, token_key
from decode_worker.cache.pool import KVLayout, KVPool
from decode_worker.cache.radix_tree import RadixTree
from decode_worker.cache.storage import FileStore, StorageTier, StoreBackend, encode_record
from decode_worker.cache.storage.redis_store import RedisStore

LAYOUT = KVLayout(
    "SmolLM2-135M-Instruct", num_layers=30, num_kv_heads=3, head_dim=64, page_size=16, dtype=torch.float32
)


def keys_for(run: int, pages: int) -> list[str]:
    tokens = [run] + list(range(pages * LAYOUT.page_size - 1))
    seed = RadixTree(LAYOUT.page_size, LAYOUT.fingerprint()).root_hash
    return [h.hex() for h in chain_hashes(token_key(tokens), LAYOUT.page_size, seed)]


class LoopStall:
    """Longest gap between ticks of a 1 ms ticker: how long the event loop was blocked."""

    def __init__(self):
        self.max_s = 0.0
        self._task = asyncio.get_running_loop().create_task(self._tick())

    async def _tick(self):
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            self.max_s = max(self.max_s, now - last - 0.001)
            last = now

    def stop(self) -> float:
        self._task.cancel()
        return self.max_s


def rate(pages: int, seconds: float) -> dict:
    return {"pages_per_s": round(pages / seconds, 1), "mb_per_s": round(pages * LAYOUT.page_bytes / seconds / 1e6, 1)}


async def bench_backend(make: Callable[[], StoreBackend], pages: int) -> dict:
    src = KVPool(LAYOUT, pages)
    src.buffer.normal_()
    dst = KVPool(LAYOUT, pages)

    backend = make()
    keys = keys_for(0, pages)
    payload = os.urandom(LAYOUT.page_bytes)
    records = [encode_record(k, LAYOUT.fingerprint(), payload) for k in keys]
    t0 = time.perf_counter()
    for i in range(0, pages, 4):
        await backend.put(keys[i : i + 4], records[i : i + 4])
    put_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(0, pages, 4):
        assert all(r is not None for r in await backend.get(keys[i : i + 4]))
    get_s = time.perf_counter() - t0
    await backend.close()

    tier = StorageTier(make(), LAYOUT, op_timeout_s=30.0)
    keys = keys_for(1, pages)
    stall = LoopStall()
    t0 = time.perf_counter()
    assert tier.backup(keys, src, torch.arange(pages)) == pages
    backup_call_s = time.perf_counter() - t0
    await tier.flush()
    backup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    arrived = await tier.prefetch(keys, dst, torch.arange(pages), None)
    prefetch_s = time.perf_counter() - t0
    max_stall = stall.stop()
    assert arrived == pages and torch.equal(src.buffer, dst.buffer), "prefetched KV differs from what was backed up"
    assert not tier.failures, tier.stats()
    await tier.close()
    return {
        "store_put": rate(pages, put_s),
        "store_get": rate(pages, get_s),
        "tier_backup": rate(pages, backup_s),
        "tier_prefetch": rate(pages, prefetch_s),
        "backup_call_ms": round(backup_call_s * 1e3, 1),  # the synchronous copy-out on the event loop
        "loop_max_stall_ms": round(max_stall * 1e3, 1),
    }


def start_redis(workdir: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            return proc, f"redis://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start")


async def main(args) -> dict:
    out: dict = {"page_bytes": LAYOUT.page_bytes, "pages": args.pages}
    with tempfile.TemporaryDirectory() as tmp:
        out["file"] = await bench_backend(lambda: FileStore(Path(tmp) / "l3", max_bytes=1 << 40), args.pages)
        proc, url = None, args.redis_url
        if url is None and shutil.which("redis-server"):
            proc, url = start_redis(Path(tmp))
        try:
            out["redis"] = await bench_backend(lambda: RedisStore(url, timeout_s=30.0), args.pages) if url else None
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait()
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=64, help="pages per run (64 pages = 47 MB)")
    ap.add_argument("--redis-url", help="benchmark this server instead of starting one")
    print(json.dumps(asyncio.run(main(ap.parse_args()))))
