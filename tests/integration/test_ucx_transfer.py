"""The PD data plane between two real processes: decode reads pages from a peer's registered pool.

The peer is a child process with a ``KVAgent`` over a pool of seeded bytes, as a prefill worker has; it prints its
metadata and every notification it receives. Reads must land exactly the pages asked for, notify the peer once
they landed, and fail fast and cleanly (never a write after the read returned) when the peer dies. Every test runs
on both paths: ``nixl`` (the peer's pool is private, so reads go over NIXL's UCX backend, as between hosts) and
``mapped`` (the peer shares its pool, as a prefill worker does, so decode on this host receives its file over a
Unix socket, maps it and copies).
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from decode_worker.cache.pool import KVLayout, KVPool
from decode_worker.core.shared_memory import boot_id
from decode_worker.transfer import agent as agent_module
from decode_worker.transfer import pool_share
from decode_worker.transfer.agent import SHARED_MEMORY_ENV, KVAgent, TransferError
from decode_worker.transfer.descriptors import PoolDescriptor
from decode_worker.transfer.pool_share import SharedRegion, socket_name

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = KVLayout("t@0", num_layers=4, num_kv_heads=2, head_dim=32, page_size=8, dtype=torch.float32)
PAGES = 256  # 16 KB pages (runs of 2 KB): 4 MB per pool
BIG_PAGES = 4096  # 64 MB: a read long enough to be killed in the middle of
SEED = 7

PEER = """
import base64, json, sys, threading, time, torch
from decode_worker.cache.pool import KVPool
from decode_worker.transfer.agent import KVAgent
from tests.integration.test_ucx_transfer import LAYOUT, seeded
pages, path = sys.stdin.readline().split()  # a spare waits here, its imports done
pool = seeded(int(pages), path == "mapped")
agent = KVAgent(pool.buffer, "peer", pool.shared)
print(json.dumps({"metadata": base64.b64encode(agent.metadata()).decode(), "pool": agent.pool.to_dict()}), flush=True)
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
while not done.is_set():
    for m in agent.notifications():
        print(m.decode(), flush=True)
    time.sleep(0.001)
"""
PEER_ENV = {**os.environ, "PYTHONPATH": str(ROOT)}  # as the session began: tests that patch the environment patch
# their own side, and a spare started during one of them must not inherit it


def seeded(pages: int, shared: bool = False) -> KVPool:
    pool = KVPool(LAYOUT, pages, shared=shared)
    pool.buffer.view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(SEED))
    return pool


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality: random bytes make NaNs, which ``torch.equal`` on floats never calls equal."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


class PeerProcess:
    """A peer with ``pages`` of seeded bytes on ``path``. Its process was started one peer ahead (a spare that has
    imported torch and NIXL while the previous test ran), so a test waits only for the pool and the agent."""

    spare: subprocess.Popen | None = None

    def __init__(self, pages: int = PAGES, path: str = "nixl"):
        self.path = path
        self.proc, PeerProcess.spare = PeerProcess.spare or _spawn_peer(), _spawn_peer()
        self.proc.stdin.write(f"{pages} {path}\n")
        self.proc.stdin.flush()
        hello = json.loads(self.proc.stdout.readline())
        self.metadata, self.pool = base64.b64decode(hello["metadata"]), PoolDescriptor.from_dict(hello["pool"])

    def next_notification(self) -> str:
        return self.proc.stdout.readline().strip()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(10)


def _spawn_peer() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PEER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=PEER_ENV, cwd=ROOT)


@pytest.fixture(scope="module", autouse=True)
def no_spare_left():
    """The last spare goes with the module."""
    yield
    if PeerProcess.spare is not None:
        PeerProcess.spare.kill()
        PeerProcess.spare.wait()
        PeerProcess.spare = None


PATHS = ("nixl", "mapped")


@pytest.fixture(params=PATHS)
def peer(request):
    p = PeerProcess(PAGES, request.param)
    yield p
    p.close()


@pytest.fixture(params=PATHS)
def big_peer(request):
    p = PeerProcess(BIG_PAGES, request.param)
    yield p
    p.close()


@contextlib.contextmanager
def decode_side(peer: PeerProcess, pages: int = PAGES):
    """Our pool (zeros) and agent, connected to ``peer``: ``(pool, agent, remote)``; the agent is closed after."""
    pool = KVPool(LAYOUT, pages)
    agent = KVAgent(pool.buffer, "decode")
    try:
        remote = agent.add_peer(peer.metadata, peer.pool)
        assert (remote.mapped is not None) == (peer.path == "mapped")  # the path the test is about is taken
        yield pool, agent, remote
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


def test_a_mapped_peer_that_exits_is_unmapped_without_waiting_for_a_read():
    """Its whole pool stays in memory while mapped: the mapping goes as soon as the peer's process does."""
    peer = PeerProcess(PAGES, "mapped")
    with decode_side(peer) as (_, agent, _):
        async def go():
            remote = agent.add_peer(peer.metadata, peer.pool)  # again, under a running loop, which watches the peer
            await remote.mapping  # asked for in a thread
            assert remote.mapped is not None
            peer.proc.kill()
            loop = asyncio.get_running_loop()
            give_up = loop.time() + 5
            while remote.mapped is not None and loop.time() < give_up:
                await asyncio.sleep(0.01)
            return remote.mapped
        agent.drop_peer(agent.peer(peer.pool.agent).name)
        assert asyncio.run(go()) is None


def test_mapping_can_be_turned_off_and_a_bad_setting_is_refused(monkeypatch):
    peer = PeerProcess(PAGES, "mapped")
    try:
        monkeypatch.setenv(SHARED_MEMORY_ENV, "off")
        pool = KVPool(LAYOUT, PAGES)
        agent = KVAgent(pool.buffer, "decode")
        remote = agent.add_peer(peer.metadata, peer.pool)
        assert remote.mapped is None
        read(agent, remote, [4, 5], [9, 200])
        assert same_bytes(pool.buffer[[4, 5]], seeded(PAGES).buffer[[9, 200]])
        agent.close()
        prefill = KVAgent(seeded(4, shared=True).buffer, "prefill", KVPool(LAYOUT, 4, shared=True).shared)
        assert prefill.pool.shared is None  # nor does it serve its own pool
        prefill.close()
        monkeypatch.setenv(SHARED_MEMORY_ENV, "sometimes")
        with pytest.raises(ValueError, match=SHARED_MEMORY_ENV):
            KVAgent(pool.buffer, "decode")
    finally:
        peer.close()


def test_a_mapped_peer_is_copied_from_without_nixl_once_connected():
    """The first read connects with one test read over NIXL (so the release notification goes out at once); every
    read copies out of the mapping, so reads still land with NIXL's reads broken."""
    peer = PeerProcess(PAGES, "mapped")
    try:
        with decode_side(peer) as (pool, agent, remote):
            read(agent, remote, [1], [2])
            assert remote.connected
            agent.agent.make_prepped_xfer = None  # a NIXL read from here on would raise
            read(agent, remote, [3, 4, 5], [10, 11, 12])
            assert same_bytes(pool.buffer[[1, 3, 4, 5]], seeded(PAGES).buffer[[2, 10, 11, 12]])
            assert agent.notify(remote.name, b"release 9 9") and peer.next_notification() == "release 9 9"
    finally:
        peer.close()


def mapped_rss(mapping: torch.Tensor) -> int:
    """Bytes of ``mapping`` (a whole mapping) that are mapped into this process, from /proc/self/smaps."""
    start = f"{mapping.data_ptr():x}-"
    lines = Path("/proc/self/smaps").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(start))
    return next(int(line.split()[1]) * 1024 for line in lines[at:] if line.startswith("Rss:"))


def test_a_mapped_read_faults_in_only_the_pages_it_reads():
    """Mapping a peer's pool costs nothing until pages are read, and a read faults in the pages it copies (plus the
    kernel's read-around of a few 4 KB pages), never the peer's whole pool."""
    peer = PeerProcess(BIG_PAGES, "mapped")
    try:
        with decode_side(peer, BIG_PAGES) as (pool, agent, remote):
            time.sleep(0.3)  # anything running in the background would have faulted in the pool by now
            assert mapped_rss(remote.mapped.pages) < (1 << 20)
            read(agent, remote, [1, 2], [9, 3000])
            time.sleep(0.3)
            rss = mapped_rss(remote.mapped.pages)
            assert 2 * LAYOUT.page_bytes <= rss < 2 * LAYOUT.page_bytes + (1 << 20), rss  # of a 64 MB pool
            assert same_bytes(pool.buffer[[1, 2]], seeded(BIG_PAGES).buffer[[9, 3000]])
    finally:
        peer.close()


def test_a_peer_whose_pool_socket_stalls_is_read_over_nixl_and_the_loop_keeps_running(monkeypatch, caplog):
    """Its descriptor names a socket that takes the connection and never answers: asking runs in a thread, the
    loop keeps serving, and after ``MAP_TIMEOUT_S`` the read goes over NIXL, with the reason in the log."""
    monkeypatch.setattr(pool_share, "MAP_TIMEOUT_S", 0.3)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_name(os.getpid(), "5a" * 16))
    listener.listen()
    peer = PeerProcess(PAGES, "mapped")
    stalled = dataclasses.replace(peer.pool, shared=SharedRegion(boot_id(), os.getpid(), "5a" * 16,
                                                                   peer.pool.shared.nbytes, "0" * 64))
    pool = KVPool(LAYOUT, PAGES)
    agent = KVAgent(pool.buffer, "decode")
    try:
        async def go() -> float:
            loop = asyncio.get_running_loop()
            gaps, last = [], loop.time()

            async def tick():
                nonlocal last
                while True:
                    await asyncio.sleep(0.001)
                    gaps.append(loop.time() - last)
                    last = loop.time()
            ticker = asyncio.ensure_future(tick())
            remote = agent.add_peer(peer.metadata, stalled)
            await agent.read(1, remote, [4, 5], [9, 200], time.monotonic() + 10)
            ticker.cancel()
            assert remote.mapped is None and len(gaps) > 50
            return max(gaps)
        with caplog.at_level(logging.WARNING, logger="decode_worker.transfer.agent"):
            assert asyncio.run(go()) < 0.1
        assert "did not answer in time" in caplog.text
        assert same_bytes(pool.buffer[[4, 5]], seeded(PAGES).buffer[[9, 200]])
    finally:
        agent.close()
        peer.close()
        listener.close()


class LateRelay:
    """A pool socket of this process that is not there at first (the peer's socket busy or gone), then relays the
    real peer's pool: what a decode worker meets when a flood of local connections kept its first ask out."""

    def __init__(self, real: SharedRegion):
        self.real, self.socket_id = real, "6b" * 16
        self.region = dataclasses.replace(real, pid=os.getpid(), socket=self.socket_id)
        self.listener: socket.socket | None = None

    def open(self) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(socket_name(os.getpid(), self.socket_id))
        self.listener.listen()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            conn.recv(128)
            fd, why = pool_share._fetch(self.real, os.getuid(), time.monotonic() + 5)
            assert fd >= 0, why
            socket.send_fds(conn, [b"ok"], [fd])
            os.close(fd)

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()


def test_a_peer_whose_first_ask_failed_is_asked_again_and_mapped(monkeypatch, caplog):
    """Decode asked for a same-host pool once: a first ask that failed (sixteen idle connections on the peer's
    socket did it) left that peer on NIXL until a restart. Now it is asked again with backoff and mapped."""
    monkeypatch.setattr(agent_module, "MAP_RETRY_S", (0.2, 1.0))
    peer = PeerProcess(PAGES, "mapped")
    relay = LateRelay(peer.pool.shared)
    pool = KVPool(LAYOUT, PAGES)
    agent = KVAgent(pool.buffer, "decode")
    try:
        async def go() -> None:
            remote = agent.add_peer(peer.metadata, dataclasses.replace(peer.pool, shared=relay.region))
            await agent.read(1, remote, [4], [9], time.monotonic() + 10)  # over NIXL: the socket is not there
            assert remote.mapped is None
            relay.open()
            give_up = time.monotonic() + 10
            while remote.mapped is None and time.monotonic() < give_up:
                await asyncio.sleep(0.05)
            assert remote.mapped is not None, "the pool was never asked for again"
            await agent.read(2, remote, [5, 6], [200, 3], time.monotonic() + 10)
        with caplog.at_level(logging.INFO, logger="decode_worker.transfer.agent"):
            asyncio.run(go())
        assert "cannot be reached" in caplog.text and "asking again in 0.2 s" in caplog.text
        assert "copied from its shared pool (ask 2)" in caplog.text or "(ask 3)" in caplog.text
        assert same_bytes(pool.buffer[[4, 5, 6]], seeded(PAGES).buffer[[9, 200, 3]])
    finally:
        agent.close()
        peer.close()
        relay.close()


def test_a_peer_dropped_or_left_behind_while_its_pool_is_asked_for_keeps_nothing():
    """The pool is asked for in a thread: a peer dropped meanwhile, or a loop that closes meanwhile, never gets the
    mapping, and its pidfd is closed once the thread ends."""
    def pidfds() -> int:
        """This process's pidfds of the peer (another test's thread may hold pidfds of its own peers meanwhile)."""
        count = 0
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):  # closed since listed
                if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]":
                    count += f"Pid:\t{peer.proc.pid}\n" in Path(f"/proc/self/fdinfo/{fd}").read_text()
        return count

    peer = PeerProcess(PAGES, "mapped")
    pool = KVPool(LAYOUT, PAGES)
    agent = KVAgent(pool.buffer, "decode")
    try:
        before = pidfds()  # earlier tests in this process may hold some of their own

        async def dropped():
            remote = agent.add_peer(peer.metadata, peer.pool)
            agent.drop_peer(remote.name)
            await remote.mapping
            return remote.mapped
        assert asyncio.run(dropped()) is None
        assert pidfds() == before

        async def left_behind():  # the loop ends while the asking thread runs: asyncio.run cancels the task
            remote = agent.add_peer(peer.metadata, peer.pool)
            await asyncio.sleep(0)  # the task starts the thread
            return remote
        remote = asyncio.run(left_behind())
        assert remote.mapped is None and remote.mapping.cancelled()
        give_up = time.monotonic() + 5
        while pidfds() > before and time.monotonic() < give_up:
            time.sleep(0.01)
        assert pidfds() == before  # the mapping that came after the loop closed was closed
    finally:
        agent.close()
        peer.close()
