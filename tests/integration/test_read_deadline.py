"""A read counts only if every byte of it landed while the peer still held its pages (issue 26).

Between two real processes, on both paths (``mapped``: copied out of the peer's shared pool; ``nixl``: a NIXL
READ): a read still queued behind a stalled copy thread at its deadline is dropped and never writes, and a read
whose copy ends after its deadline fails, even though its bytes may be whole, because nothing proves they were
copied before the peer could reuse its pages. Reads that end in time still land.
"""
from __future__ import annotations

import asyncio
import time

import pytest

from decode_worker.transfer import agent as agent_module
from decode_worker.transfer.agent import TransferError
from tests.integration.test_ucx_transfer import PAGES, PeerProcess, decode_side, same_bytes, seeded
from tests.integration.test_ucx_transfer import no_spare_left  # noqa: F401 (autouse: the last spare peer goes)

PATHS = ("nixl", "mapped")


@pytest.fixture(params=PATHS)
def peer(request, monkeypatch):
    monkeypatch.setattr(agent_module, "INLINE_BYTES", 0)  # every read goes through the copy thread
    p = PeerProcess(PAGES, request.param)
    yield p
    p.close()


def read_within(agent, remote, into, source, deadline_s: float) -> tuple[str, float]:
    """(outcome, seconds): ``ok`` or the failure reason."""
    async def go() -> str:
        try:
            await agent.read(1, remote, into, source, time.monotonic() + deadline_s)
            return "ok"
        except TransferError as e:
            return e.reason
    started = time.monotonic()
    outcome = asyncio.run(go())
    return outcome, time.monotonic() - started


def test_a_read_in_time_lands(peer):
    with decode_side(peer) as (pool, agent, remote):
        assert read_within(agent, remote, [3, 4], [10, 11], 10.0)[0] == "ok"
        assert same_bytes(pool.buffer[[3, 4]], seeded(PAGES).buffer[[10, 11]])


def test_a_read_queued_behind_a_stalled_copy_thread_is_dropped_at_its_deadline(peer):
    """The copy thread is busy past the deadline (a long copy before it, or a descheduled thread): the read fails
    at its deadline, not when the thread comes free, and it never writes into our pages afterwards."""
    with decode_side(peer) as (pool, agent, remote):
        read_within(agent, remote, [1], [1], 10.0)  # connected (the mapped path's test read)
        before = pool.buffer.clone()
        stall = agent._copier.submit(time.sleep, 1.0)
        outcome, took = read_within(agent, remote, [5, 6, 7], [20, 21, 22], 0.3)
        assert outcome == "timeout" and took < 0.8, (outcome, took)
        stall.result()
        agent._copier.submit(lambda: None).result()  # anything queued after the stall has run by now
        assert same_bytes(pool.buffer, before)  # the dropped read never wrote


def test_a_read_that_ends_after_its_deadline_fails(peer, monkeypatch):
    """The copy itself runs late (the thread is preempted mid-copy): the bytes may be whole, but nothing proves
    they were copied before the peer could reuse its pages, so the read fails."""
    with decode_side(peer) as (pool, agent, remote):
        read_within(agent, remote, [1], [1], 10.0)
        work = "_copy_mapped" if peer.path == "mapped" else "_post"
        original = getattr(agent, work)

        def late(*args):
            result = original(*args)
            time.sleep(0.5)  # the clock is read after this: the copy ended late
            return result
        monkeypatch.setattr(agent, work, late)
        outcome, took = read_within(agent, remote, [5, 6], [20, 21], 0.2)
        assert outcome == "timeout", outcome
        monkeypatch.setattr(agent, work, original)
        assert read_within(agent, remote, [5, 6], [20, 21], 10.0)[0] == "ok"  # the next read is not affected


def test_a_cancelled_read_returns_only_once_its_copy_has_ended(peer, monkeypatch):
    """The client leaves while the copy thread is inside the read: the cancelled read waits for the copy to end
    (its pages are then freed and may be handed on), and a read still queued behind it never starts."""
    with decode_side(peer) as (pool, agent, remote):
        read_within(agent, remote, [1], [1], 10.0)
        work = "_copy_mapped" if peer.path == "mapped" else "_post"
        original = getattr(agent, work)

        def slow(*args):
            time.sleep(0.4)
            return original(*args)
        monkeypatch.setattr(agent, work, slow)

        async def go() -> tuple[float, bool]:
            first = asyncio.ensure_future(agent.read(1, remote, [5, 6], [20, 21], time.monotonic() + 10))
            queued = asyncio.ensure_future(agent.read(2, remote, [7], [22], time.monotonic() + 10))
            await asyncio.sleep(0.1)
            started = time.monotonic()
            first.cancel()
            queued.cancel()
            await asyncio.gather(first, queued, return_exceptions=True)
            return time.monotonic() - started, first.cancelled() and queued.cancelled()

        waited, both_cancelled = asyncio.run(go())
        assert both_cancelled and waited >= 0.25, waited  # the first waited for its copy
        agent._copier.submit(lambda: None).result()
        assert int(pool.buffer[[7]].count_nonzero()) == 0  # the queued one never ran
