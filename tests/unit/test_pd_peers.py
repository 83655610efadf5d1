"""A prefill peer replaced mid-read, and the prefill's lease-expiry task, fail only cleanly; a new peer is loaded
without stalling decode's event loop (issue 26)."""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch

from decode_worker.core.request import RequestError
from decode_worker.engine import engine as engine_module
from decode_worker.engine.engine import Engine
from decode_worker.metrics import Metrics
from decode_worker.pd.decode import DeltaKVFetcher
from decode_worker.pd.prefill import KVHandoff
from decode_worker.transfer.agent import KVAgent
from tests.unit.test_unstoppable_read import nixl_peer, read_failure


class FakeAgent:
    """Decode's agent as the fetcher sees it: reads wait for ``gate``; a read of a dropped peer's handles would be a
    use after release, so it is recorded."""

    name, pool = "decode-x", SimpleNamespace(page_bytes=64)

    def __init__(self):
        self.peers: dict[str, SimpleNamespace] = {}
        self.dropped: list[str] = []
        self.used_after_drop: list[str] = []
        self.gate = asyncio.Event()

    def peer(self, name):
        return self.peers.get(name)

    def add_peer(self, metadata, pool):
        self.peers[pool.agent] = peer = SimpleNamespace(name=pool.agent)
        return peer

    async def load_peer(self, metadata, pool, timeout_s):
        return self.add_peer(metadata, pool)

    def drop_peer(self, name):
        self.dropped.append(name)
        self.peers.pop(name, None)

    async def read(self, room, peer, into, source, deadline):
        await self.gate.wait()
        if peer.name in self.dropped:
            self.used_after_drop.append(peer.name)

    def notify(self, peer, message):
        return True


def answer(agent: str) -> SimpleNamespace:
    return SimpleNamespace(pool=SimpleNamespace(agent=agent), metadata=b"meta", room=1, lease=1, pages=[3, 4],
                           waited_s=0.0, hold_s=30.0)


def test_replacing_a_peer_waits_for_its_reads_in_flight():
    """A restarted prefill brings a new agent for the same host and port; the old one's reads still in flight
    must end before its handles go (dropping them first would free the descriptors and mapping a read uses)."""
    async def scenario() -> FakeAgent:
        agent = FakeAgent()
        config = SimpleNamespace(handshake_timeout_s=5.0, transfer_timeout_s=5.0)
        pool = SimpleNamespace(page_size=16, layout=SimpleNamespace(page_bytes=64))
        fetcher = DeltaKVFetcher(config, pool, agent, Metrics(), vocab_size=100)
        key = ("127.0.0.1", 9)
        old = await fetcher._peer(key, answer("prefill-old"))
        room = SimpleNamespace(asked=asyncio.get_running_loop().time(), boot=SimpleNamespace(host="h", port=9),
                               released=False)
        pending = SimpleNamespace(prompt=SimpleNamespace(rid="r", prompt_ids=[1] * 20), prefix_pages=0)
        reading = asyncio.ensure_future(fetcher._read(pending, room, answer("prefill-old"), old, [7, 8]))
        await asyncio.sleep(0.01)
        new = await fetcher._peer(key, answer("prefill-new"))
        assert new.name == "prefill-new" and agent.dropped == []  # the old agent's read is still in flight
        agent.gate.set()
        await reading
        assert agent.dropped == ["prefill-old"] and agent.used_after_drop == []
        await fetcher.http.aclose()
        return agent

    asyncio.run(scenario())


def test_a_read_of_a_dropped_peer_fails_as_peer_lost():
    """An answer that named the old agent, admitted after it was replaced, never touches its released handles."""
    agent = KVAgent(torch.zeros(4, 1, 2, 16), "decode")
    try:
        assert read_failure(agent, 1, nixl_peer(agent, "prefill-old"), 1) == "peer_lost"
    finally:
        agent.close()


def test_lease_expiry_survives_a_failing_pass(monkeypatch):
    """One pass of ``expire`` raises; the task logs it and later leases still expire (before, the task died
    silently and every later lease was held for good)."""
    real_sleep = asyncio.sleep
    monkeypatch.setattr(engine_module.asyncio, "sleep", lambda s, *a: real_sleep(min(s, 0.005), *a))
    released = []
    handoff = KVHandoff(SimpleNamespace(kv_lease_s=0.02), None, None, Metrics())
    expire, failed = handoff.expire, []

    def flaky() -> None:
        if not failed:
            failed.append(True)
            raise RuntimeError("one bad pass")
        expire()
    handoff.expire = flaky

    async def scenario() -> None:
        task = asyncio.ensure_future(Engine._expire_leases(SimpleNamespace(handoff=handoff)))
        try:
            await real_sleep(0.05)
            assert failed and not task.done()
            held = SimpleNamespace(prompt=SimpleNamespace(bootstrap=SimpleNamespace(room=5)))
            held.release = lambda: released.append(held)
            handoff.hold(held)
            for _ in range(200):
                if released:
                    break
                await real_sleep(0.005)
        finally:
            task.cancel()

    asyncio.run(scenario())
    assert len(released) == 1


SLOW_LOAD_S = 0.3


def slow_loads(monkeypatch, agent: KVAgent) -> list[bytes]:
    """``agent`` takes ``SLOW_LOAD_S`` to load a peer's metadata (as NIXL may on a busy host, or with many
    registered regions); returns the metadata it was asked to load, one entry per call."""
    real, calls = agent.agent.add_remote_agent, []

    def slow(metadata):
        calls.append(metadata)
        time.sleep(SLOW_LOAD_S)
        return real(metadata)
    monkeypatch.setattr(agent.agent, "add_remote_agent", slow)
    return calls


async def worst_loop_gap(work) -> tuple[object, float]:
    """``work``'s result, and the longest the event loop went without running a 2 ms ticker meanwhile."""
    gaps: list[float] = []

    async def tick() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.002)
            now = time.monotonic()
            gaps.append(now - last - 0.002)
            last = now
    ticker = asyncio.ensure_future(tick())
    await asyncio.sleep(0.01)
    try:
        result = await work
        await asyncio.sleep(0.01)  # the ticker's wake-up after the work, which measures a stall the work caused
    finally:
        ticker.cancel()
    return result, max(gaps)


def fetcher_over(agent: KVAgent, handshake_timeout_s: float, metrics: Metrics) -> DeltaKVFetcher:
    config = SimpleNamespace(handshake_timeout_s=handshake_timeout_s, transfer_timeout_s=5.0)
    pool = SimpleNamespace(page_size=16, layout=SimpleNamespace(page_bytes=agent.pool.page_bytes))
    return DeltaKVFetcher(config, pool, agent, metrics, vocab_size=100)


@pytest.fixture
def agents():
    made = [KVAgent(torch.zeros(4, 1, 2, 16), role) for role in ("prefill", "decode", "decode")]
    yield made
    for agent in made:
        agent.close()


def test_a_new_prefill_agent_is_loaded_off_the_event_loop(monkeypatch, agents):
    """The first handshake with a prefill loads its NIXL agent: a slow load stalls the loop when done on it (the
    old way, kept by ``add_peer`` for tools), not through the fetcher, and two handshakes arriving together
    load it once."""
    prefill, on_loop, decode = agents
    slow_loads(monkeypatch, on_loop)
    calls = slow_loads(monkeypatch, decode)
    fetcher = fetcher_over(decode, 5.0, Metrics())
    ans = SimpleNamespace(pool=prefill.pool, metadata=prefill.metadata())

    async def inline() -> object:
        return on_loop.add_peer(ans.metadata, ans.pool)

    async def scenario() -> None:
        _, blocked = await worst_loop_gap(inline())
        assert blocked >= SLOW_LOAD_S * 0.8, blocked  # the probe sees a load done on the loop
        two = asyncio.gather(*(fetcher._peer(("127.0.0.1", 9), ans) for _ in range(2)))
        (first, second), gap = await worst_loop_gap(two)
        assert gap < 0.1, f"the loop stalled {gap * 1000:.0f} ms while a new peer was loaded"
        assert first is second is decode.peer(prefill.name) and len(calls) == 1
        await fetcher.http.aclose()

    asyncio.run(scenario())


def test_a_load_past_the_handshake_timeout_fails_its_request_and_the_peer_still_arrives(monkeypatch, agents):
    prefill, _, decode = agents
    slow_loads(monkeypatch, decode)
    metrics = Metrics()
    fetcher = fetcher_over(decode, SLOW_LOAD_S / 4, metrics)
    ans = SimpleNamespace(pool=prefill.pool, metadata=prefill.metadata())

    async def scenario() -> None:
        with pytest.raises(RequestError) as failed:
            await fetcher._peer(("127.0.0.1", 9), ans)
        assert failed.value.status == 504 and "took over" in str(failed.value), str(failed.value)
        for _ in range(100):
            if decode.peer(prefill.name) is not None:
                break
            await asyncio.sleep(0.01)
        assert decode.peer(prefill.name) is not None  # the next handshake finds it loaded
        assert await fetcher._peer(("127.0.0.1", 9), ans) is decode.peer(prefill.name)
        await fetcher.http.aclose()

    asyncio.run(scenario())
    assert metrics.transfer_failures.labels("timeout")._value.get() == 1
