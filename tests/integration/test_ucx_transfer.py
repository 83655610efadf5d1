"""The NIXL data plane (UCX backend) between two real processes: decode reads pages from a peer's registered pool.

The peer is a child process with a ``KVAgent`` over a pool of seeded bytes, as a prefill worker has; it prints its
metadata and every notification it receives. Reads must land exactly the pages asked for, notify the peer once
they landed, and fail fast and cleanly (never a write after the read returned) when the peer dies.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from decode_worker.cache.pool import KVLayout, KVPool
from decode_worker.transfer.agent import KVAgent, TransferError
from decode_worker.transfer.descriptors import PoolDescriptor

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = KVLayout("t@0", num_layers=4, num_kv_heads=2, head_dim=32, page_size=8, dtype=torch.float32)
PAGES = 256  # 16 KB pages (runs of 2 KB): 4 MB per pool
BIG_PAGES = 4096  # 64 MB: a read long enough to be killed in the middle of
SEED = 7

PEER = """
import base64, json, sys, threading, time, torch
from decode_worker.cache.pool import KVPool
from tests.integration.test_ucx_transfer import LAYOUT, seeded
pages = int(sys.argv[1])
agent = __import__("decode_worker.transfer.agent", fromlist=["KVAgent"]).KVAgent(seeded(pages).buffer, "peer")
print(json.dumps({"metadata": base64.b64encode(agent.metadata()).decode(), "pool": agent.pool.to_dict()}), flush=True)
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
while not done.is_set():
    for m in agent.notifications():
        print(m.decode(), flush=True)
    time.sleep(0.001)
"""


def seeded(pages: int) -> KVPool:
    pool = KVPool(LAYOUT, pages)
    pool.buffer.view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(SEED))
    return pool


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality: random bytes make NaNs, which ``torch.equal`` on floats never calls equal."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


class PeerProcess:
    def __init__(self, pages: int = PAGES):
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, "-c", PEER, str(pages)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        hello = json.loads(self.proc.stdout.readline())
        self.metadata, self.pool = base64.b64decode(hello["metadata"]), PoolDescriptor.from_dict(hello["pool"])

    def next_notification(self) -> str:
        return self.proc.stdout.readline().strip()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(10)


@pytest.fixture
def peer():
    p = PeerProcess()
    yield p
    p.close()


@pytest.fixture
def big_peer():
    p = PeerProcess(BIG_PAGES)
    yield p
    p.close()


@contextlib.contextmanager
def decode_side(peer: PeerProcess, pages: int = PAGES):
    """Our pool (zeros) and agent, connected to ``peer``: ``(pool, agent, remote)``; the agent is closed after."""
    pool = KVPool(LAYOUT, pages)
    agent = KVAgent(pool.buffer, "decode")
    try:
        yield pool, agent, agent.add_peer(peer.metadata, peer.pool)
    finally:
        agent.close()


def read(agent: KVAgent, peer, into, source, deadline_s: float = 10.0) -> None:
    async def go():
        await agent.read(1, peer, list(into), list(source), asyncio.get_running_loop().time() + deadline_s)
    asyncio.run(go())


def test_scattered_pages_land_exactly_and_the_peer_hears_the_release(peer):
    with decode_side(peer) as (pool, agent, remote):
        source, into = [200, 3, 4, 5, 77, 255], [9, 10, 11, 100, 1, 0]
        read(agent, remote, into, source)
        reference = seeded(PAGES).buffer
        assert same_bytes(pool.buffer[into], reference[source])
        untouched = [p for p in range(PAGES) if p not in into]
        assert int(pool.buffer[untouched].count_nonzero()) == 0  # nothing outside the pages asked for
        assert agent.notify(remote.name, b"release 2 2") and peer.next_notification() == "release 2 2"


def test_large_read_goes_through_the_copy_thread_and_keeps_the_loop_free(big_peer):
    with decode_side(big_peer, BIG_PAGES) as (pool, agent, remote):
        order = torch.randperm(BIG_PAGES, generator=torch.Generator().manual_seed(1)).tolist()

        async def go() -> int:
            ticks = 0

            async def tick():
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.0005)
                    ticks += 1
            ticker = asyncio.ensure_future(tick())
            await agent.read(1, remote, order, list(range(BIG_PAGES)), asyncio.get_running_loop().time() + 30)
            ticker.cancel()
            return ticks
        assert asyncio.run(go()) > 0  # the loop ran while the 64 MB were copied
        assert same_bytes(pool.buffer[order], seeded(BIG_PAGES).buffer)


def test_a_dead_peer_fails_the_read_at_once(peer):
    with decode_side(peer) as (_, agent, remote):
        read(agent, remote, [1], [1])  # connected
        peer.proc.send_signal(signal.SIGKILL)
        peer.proc.wait(10)
        started = time.monotonic()
        with pytest.raises(TransferError) as e:
            read(agent, remote, [2, 3], [2, 3])
        assert e.value.reason == "peer_lost" and time.monotonic() - started < 2.0
        agent.notify(remote.name, b"release 1 1")  # to a dead peer: dropped quietly, no exception


def test_peer_killed_mid_read_leaves_no_late_write(big_peer):
    """SIGKILL while a 64 MB read runs: it fails (peer_lost) or completes, and once it returned nothing writes into
    our pages any more."""
    with decode_side(big_peer, BIG_PAGES) as (pool, agent, remote):

        async def go() -> str:
            loop = asyncio.get_running_loop()
            loop.call_later(0.002, big_peer.proc.send_signal, signal.SIGKILL)
            try:
                await agent.read(1, remote, list(range(BIG_PAGES)), list(range(BIG_PAGES)), loop.time() + 30)
                return "done"
            except TransferError as e:
                return e.reason
        outcome = asyncio.run(go())
        assert outcome in ("done", "peer_lost")
        snapshot = pool.buffer.clone()
        time.sleep(0.2)
        assert same_bytes(pool.buffer, snapshot)
        if outcome == "done":
            assert same_bytes(pool.buffer, seeded(BIG_PAGES).buffer)


def test_mismatched_page_lists_are_refused_before_anything_moves(peer):
    with decode_side(peer) as (pool, agent, remote):
        with pytest.raises(TransferError) as e:
            read(agent, remote, [1, 2], [1])
        assert e.value.reason == "size_mismatch"
        with pytest.raises(ValueError, match="outside"):
            read(agent, remote, [PAGES], [0])
        assert int(pool.buffer.count_nonzero()) == 0
