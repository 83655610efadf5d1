"""Prefill's side of a handshake that arrives before the prompt's KV: a peer asking with ``wait_s`` hears "not yet"
(None) and asks again, within one lease time from its first ask; rooms nobody asks for again are forgotten."""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from decode_worker.core.request import RequestError
from decode_worker.metrics import Metrics
from decode_worker.pd.prefill import KVHandoff

LEASE_S = 0.3


def handoff() -> KVHandoff:
    return KVHandoff(SimpleNamespace(kv_lease_s=LEASE_S), None, None, Metrics())


def held(room: int) -> SimpleNamespace:
    h = SimpleNamespace(prompt=SimpleNamespace(bootstrap=SimpleNamespace(room=room)))
    h.release = lambda: None
    return h


def test_a_poll_answers_not_yet_then_the_kv_once_it_arrives():
    async def scenario():
        h = handoff()
        assert await h._wait_for_room(7, 0.02) is None  # still computing
        assert await h._wait_for_room(7, 0.02) is None
        prompt = held(7)
        asyncio.get_running_loop().call_later(0.03, h.hold, prompt)
        lease = await h._wait_for_room(7, 0.2)
        assert lease is not None and lease.held is prompt
        assert not h.asked_since and not h._arrived and not h.leases

    asyncio.run(scenario())


def test_polls_give_up_one_lease_after_the_first_ask():
    async def scenario():
        h = handoff()
        started = time.monotonic()
        answers = []
        with pytest.raises(RequestError, match="unknown room") as e:
            while True:
                answers.append(await h._wait_for_room(8, 0.05))
        assert e.value.status == 404 and answers and all(a is None for a in answers)
        assert LEASE_S <= time.monotonic() - started < LEASE_S + 0.1  # each poll did not restart the clock
        assert not h.asked_since and not h._arrived

    asyncio.run(scenario())


def test_a_peer_that_stops_asking_is_forgotten_at_lease_end():
    async def scenario():
        h = handoff()
        assert await h._wait_for_room(9, 0.01) is None
        h.expire()
        assert 9 in h.asked_since  # its peer may still ask again
        await asyncio.sleep(LEASE_S + 0.01)
        h.expire()
        assert not h.asked_since and not h._arrived

    asyncio.run(scenario())


def test_without_wait_s_the_answer_waits_for_the_kv_as_before():
    async def scenario():
        h = handoff()
        prompt = held(10)
        asyncio.get_running_loop().call_later(0.1, h.hold, prompt)
        lease = await h._wait_for_room(10, None)
        assert lease is not None and lease.held is prompt

    asyncio.run(scenario())


def test_a_prefill_that_answers_pending_at_once_is_asked_once_per_wait_and_given_up_on():
    """A lying or broken prefill answering 202 without waiting is not hammered (one call per ``wait_s``), and
    decode gives up on its own clock: its lease time plus its handshake timeout from the first ask."""
    import httpx

    from decode_worker.core.request import Bootstrap
    from decode_worker.pd.decode import DeltaKVFetcher, _Room

    calls = []

    def pending(request: httpx.Request) -> httpx.Response:
        calls.append(time.monotonic())
        return httpx.Response(202, json={"status": "pending", "room": 1})

    async def scenario():
        config = SimpleNamespace(handshake_timeout_s=0.2, transfer_timeout_s=1.0, kv_lease_s=0.4, prefill_hosts="",
                                 pd_token="", api_key="")
        pool = SimpleNamespace(page_size=16, layout=SimpleNamespace(describe=lambda: {}))
        agent = SimpleNamespace(name="decode-x", pool=SimpleNamespace(page_bytes=64))
        fetcher = DeltaKVFetcher(config, pool, agent, Metrics(), vocab_size=100)
        fetcher.http = httpx.AsyncClient(transport=httpx.MockTransport(pending))
        room = _Room(Bootstrap("127.0.0.1", 9, 1), time.monotonic())
        started = time.monotonic()
        with pytest.raises(RequestError, match="had not computed room 1") as e:
            await fetcher._handshake(room, [1, 2, 3])
        await fetcher.http.aclose()
        return e.value, time.monotonic() - started

    error, took = asyncio.run(scenario())
    assert error.status == 504
    assert 0.6 <= took < 3.0
    assert 2 <= len(calls) <= 8, len(calls)  # 0.6 s of asking at one call per 0.1 s (not hundreds)
    assert all(b - a >= 0.09 for a, b in zip(calls, calls[1:]))
