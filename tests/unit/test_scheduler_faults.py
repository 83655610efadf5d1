"""Regression tests for the scheduler's race and failure windows (issue 11), on a tiny random-weight model.

Each test reproduces one defect found by review and failed before its fix.
"""
from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter

import pytest
import torch

from decode_worker.cache.copy_engine import CopyEngine
from decode_worker.cache.hicache import HierarchicalCache
from decode_worker.core.request import Bootstrap, GenerateInput, RequestError
from decode_worker.scheduler.admission import PEER_LOOKAHEAD
from decode_worker.scheduler.roles import PeerPrompt, PendingReceive
from decode_worker.transfer.deadline import run_to_the_end
from tests.unit.test_scheduler import (GREEDY, PeerKV, StepEngine, collect, make_scheduler, run_all, settle,
                                   step_copies)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Ten prompts sharing a 24-token prefix: together they outgrow a 160-token L1."""
    rng = random.Random(5)
    shared = [rng.randrange(320) for _ in range(24)]
    return [shared + [rng.randrange(320) for _ in range(rng.randrange(1, 30))] for _ in range(10)]


@pytest.fixture(scope="module")
def reference(tiny_models, prompts) -> list[list[int]]:
    """Outputs with L1 to spare: no retraction, no eviction."""
    return asyncio.run(run_all(make_scheduler(tiny_models["llama"], 4096), prompts))


class HeldEngine(CopyEngine):
    """Copies wait in the copy thread while ``gate`` is closed; ``held`` records that one did."""

    def __init__(self, device_buffer: torch.Tensor, host_buffer: torch.Tensor):
        super().__init__(device_buffer, host_buffer)
        self.gate = threading.Event()
        self.gate.set()
        self.held = False

    def _copy(self, *args) -> None:
        if not self.gate.is_set():
            self.held = True
        assert self.gate.wait(10), "gate never opened"
        super()._copy(*args)


# -- defect 3: no retraction cascade while a retracted request's backup pins its pages ----------------------------


def test_one_retraction_per_step_while_backups_pin_pages(tiny_models, prompts, reference):
    scheduler = make_scheduler(tiny_models["llama"], 160, 3.0, engine=StepEngine)
    engine = step_copies(scheduler)
    retracted_at: Counter[int] = Counter()
    retract = scheduler._retract

    def counting(req) -> None:
        retracted_at[scheduler.steps] += 1
        retract(req)

    scheduler._retract = counting
    assert asyncio.run(run_all(scheduler, prompts)) == reference
    assert retracted_at, "the test needs L1 to run out"
    assert max(retracted_at.values()) == 1, f"retractions per step: {dict(retracted_at)}"
    engine.run()
    settle(scheduler)


# -- defect 5: a step that ran no batch yields the event loop ----------------------------------------------------


def test_loop_keeps_serving_while_requests_wait_for_a_copy(tiny_models):
    """Under write_back a running request waits for a demotion copy to free the pages it needs; meanwhile the
    event loop must go on serving (HTTP, SSE, UCX): a ticker task measures the longest stall."""
    first, second = list(range(1, 101)), list(range(200, 252))  # 27 pages cached, then 13 (+3 to decode); L1: 40
    expected = asyncio.run(run_all(make_scheduler(tiny_models["llama"], 1024), [first, second]))
    scheduler = make_scheduler(tiny_models["llama"], 160, 3.0, "write_back", engine=HeldEngine)
    engine = scheduler.cache.engine
    gaps: list[float] = []

    async def collect(stream) -> list[int]:
        return [t for event in [e async for e in stream] for t in event.token_ids]

    async def scenario():
        scheduler.start()
        out = [await collect(scheduler.submit(GenerateInput("first", first, GREEDY)))]
        engine.gate.clear()  # the second request's growth must demote the first's pages: that copy is held
        threading.Timer(0.6, engine.gate.set).start()
        done = asyncio.Event()

        async def tick():
            last = time.monotonic()
            while not done.is_set():
                await asyncio.sleep(0.005)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        ticker = asyncio.ensure_future(tick())
        try:
            return out + [await collect(scheduler.submit(GenerateInput("second", second, GREEDY)))]
        finally:
            done.set()
            await ticker
            await scheduler.stop(grace_s=0)

    assert asyncio.run(scenario()) == expected
    assert engine.held, "no copy was held: the test did not reach the window"
    assert max(gaps) < 0.3, f"the event loop stalled for {max(gaps):.2f} s"
    settle(scheduler)


# -- defect 4: a step error frees PD delta pages only after the transfer task ended ------------------------------


def test_step_error_frees_delta_pages_only_after_the_transfer_ended(tiny_models):
    writes: list[bool] = []  # for each page the "scatter" wrote: was it still allocated?
    started, landed = threading.Event(), threading.Event()

    def scatter(cache: HierarchicalCache, pages: list[int]) -> None:
        started.set()
        time.sleep(0.3)
        writes.extend(cache.device_alloc.in_use(p) for p in pages)
        landed.set()

    async def kv_source(req, pages: torch.Tensor):
        copy = asyncio.get_running_loop().run_in_executor(None, scatter, scheduler.cache, pages.tolist())
        await run_to_the_end(copy)
        return 0, 0.0

    scheduler = make_scheduler(tiny_models["llama"], 160, kv_source=kv_source)
    poll, broken = scheduler.loading.poll, []

    def failing_once():
        live = [r for r in scheduler.queues.loading if r.transfer is not None and r.transfer.in_flight()]
        if live and started.is_set() and not broken:
            broken.append(True)
            raise RuntimeError("injected scheduler bug")
        return poll()

    scheduler.loading.poll = failing_once

    async def scenario():
        scheduler.start()
        stream = scheduler.submit(GenerateInput("pd", list(range(1, 30)), GREEDY))
        events = [e async for e in stream]
        await asyncio.to_thread(landed.wait, 5)
        for _ in range(10):
            await asyncio.sleep(0.01)
        await scheduler.stop(grace_s=0)
        return events

    events = asyncio.run(scenario())
    assert broken and writes, "the injected error or the scatter did not happen"
    assert isinstance(events[0].error, RequestError) and events[0].error.status == 500
    assert all(writes), "the transfer wrote into pages the scheduler had already freed"
    settle(scheduler)


class StalledPeer(PeerKV):
    """Decode's prompt source with handshakes: a request's peer answers once its handshake started (``prepare``),
    except the peer on port ``STALLED``, which never answers. Records which requests got a handshake."""

    STALLED = 1

    def __init__(self, kv_source):
        super().__init__(kv_source)
        self.prepared: set[str] = set()

    def prepare(self, prompt: PeerPrompt, wakeup) -> None:
        if prompt.rid not in self.prepared:
            self.prepared.add(prompt.rid)
            asyncio.get_running_loop().call_soon(wakeup)

    def answered(self, prompt: PeerPrompt) -> bool:
        return prompt.rid in self.prepared and prompt.bootstrap.port != self.STALLED


def test_a_stalled_peer_at_the_head_of_the_queue_does_not_hold_up_another_peer(tiny_models, prompts):
    """Issue 26: 40 requests for a prefill that never answers fill the queue's head; a request for a healthy
    prefill behind them starts its handshake and is served (the look-ahead was one global window of 32, which the
    stalled peer's requests filled, so it never started). Each peer still gets at most ``PEER_LOOKAHEAD``."""
    async def kv_source(pending: PendingReceive, pages) -> tuple[int, float]:
        return 7, 0.0

    async def scenario():
        scheduler = make_scheduler(tiny_models["llama"], 4096, kv_source=kv_source, peer=StalledPeer)
        source = scheduler.admission.source
        scheduler.start()
        try:
            stalled = [scheduler.submit(GenerateInput(f"s{i}", prompts[i % 10], GREEDY,
                                                      bootstrap=Bootstrap("127.0.0.1", StalledPeer.STALLED, i)))
                       for i in range(40)]
            healthy = scheduler.submit(GenerateInput("h", prompts[0], GREEDY, bootstrap=Bootstrap("127.0.0.1", 2, 99)))
            events = await asyncio.wait_for(collect(healthy), 10)
            handshakes = sum(rid.startswith("s") for rid in source.prepared)
            for s in stalled:
                scheduler.abort(s.rid)
            await asyncio.wait_for(asyncio.gather(*(collect(s) for s in stalled)), 10)
            return events, handshakes, scheduler
        finally:
            await scheduler.stop(grace_s=0)

    events, handshakes, scheduler = asyncio.run(scenario())
    assert not any(e.error for e in events) and sum(len(e.token_ids) for e in events) == GREEDY.max_new_tokens
    assert handshakes == PEER_LOOKAHEAD  # one peer's requests beyond its window start nothing
    settle(scheduler)
