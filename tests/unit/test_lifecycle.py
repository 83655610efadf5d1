"""A request aborted at each stage of its life, and the out-of-pages path of admission, on a tiny model.

Every exit must give back exactly the pages and locks the request took (``settle``), tell the client why, and
leave the cache usable: a later request with the same prompt still matches the cache-free reference.
"""
from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest
import torch

from decode_worker.cache.copy_engine import CopyEngine
from decode_worker.cache.hicache import HierarchicalCache, LoadHandle, MatchResult
from decode_worker.cache.pool import OutOfPages
from decode_worker.core.request import GenerateInput, RequestError, RequestStream
from decode_worker.model.forward_batch import ForwardBatch
from decode_worker.scheduler.req import Req
from decode_worker.scheduler.scheduler import Scheduler
from tests.cache_invariants import check_invariants
from tests.unit.test_scheduler import GREEDY, make_scheduler, offline, settle  # noqa: F401

PAGE = 4
rng = random.Random(11)
PREFIX = [rng.randrange(320) for _ in range(6 * PAGE)]
WARM = PREFIX + [rng.randrange(320) for _ in range(PAGE)]  # leaves the 6-page prefix cached
FOLLOW = PREFIX + [rng.randrange(320) for _ in range(6 * PAGE)]  # shares only the prefix with WARM
OTHER = [rng.randrange(320) for _ in range(28 * PAGE)]  # shares nothing


class HeldLoads(CopyEngine):
    """L2->L1 copies wait in the copy thread until ``gate`` opens, so a test can act while one is in flight."""

    def __init__(self, device_buffer: torch.Tensor, host_buffer: torch.Tensor):
        super().__init__(device_buffer, host_buffer)
        self.gate = threading.Event()

    def _copy(self, src: torch.Tensor, dst: torch.Tensor, *args: object) -> None:
        if src is self.host_buffer:
            self.gate.wait(30)
        super()._copy(src, dst, *args)


async def wait_until(condition: Callable[[], bool], timeout_s: float = 10) -> None:
    """Yield to the scheduler until ``condition`` holds."""
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.002)


T = TypeVar("T")


async def collect(stream: RequestStream) -> list[int] | RequestError:
    """A stream's tokens, or the error it ended with."""
    ids = []
    async for event in stream:
        if event.error is not None:
            return event.error
        ids += event.token_ids
    return ids


def submit(scheduler: Scheduler, rid: str, prompt: list[int], max_new_tokens: int = GREEDY.max_new_tokens) -> RequestStream:
    return scheduler.submit(GenerateInput(rid, prompt, dataclasses.replace(GREEDY, max_new_tokens=max_new_tokens)))


def assert_aborted(result: list[int] | RequestError) -> None:
    assert isinstance(result, RequestError), f"expected an abort error, got tokens {result}"
    assert result.status == 499 and "abort" in str(result), (result.status, str(result))


def run(scheduler: Scheduler, scenario: Callable[[], Awaitable[T]]) -> T:
    """Run ``scenario()`` with the scheduler's loop going. Deadlines turn a request or a stop that hangs (an abort
    that never lands) into a failure."""
    async def main():
        scheduler.start()
        try:
            return await asyncio.wait_for(scenario(), 30)
        finally:
            await asyncio.wait_for(scheduler.stop(grace_s=0), 10)

    return asyncio.run(main())


def test_abort_while_queued(tiny_models, offline):
    """Aborted in prealloc (the batch is full): it fails at once and the running request is unaffected."""
    scheduler = make_scheduler(tiny_models["llama"], 4096, max_running=1)

    async def scenario():
        running = asyncio.ensure_future(collect(submit(scheduler, "running", WARM)))
        await wait_until(lambda: scheduler.queues.running)
        queued = submit(scheduler, "queued", FOLLOW)
        assert scheduler.requests["queued"] in scheduler.queues.prealloc
        scheduler.abort("queued")
        return await collect(queued), await running

    queued, running = run(scheduler, scenario)
    assert_aborted(queued)
    assert running == offline.generate([WARM], GREEDY)[0].output_ids
    settle(scheduler)


def test_abort_while_loading_back_from_l2(tiny_models, offline):
    """Aborted while its prefix is copied L2->L1: the abort frees the request's own pages and its lock; the copy
    keeps its own lock until it lands, and the restored prefix then serves the next request."""
    scheduler = make_scheduler(tiny_models["llama"], 4096, 3.0, engine=HeldLoads)
    cache = scheduler.cache

    async def scenario():
        await collect(submit(scheduler, "warm", WARM))
        await wait_until(lambda: not cache.busy)  # write_through: the prefix is on L2 too
        cache.evict_device(cache.tree.device_pages)  # now only on L2
        stream = submit(scheduler, "restoring", FOLLOW)
        req = scheduler.requests["restoring"]
        await wait_until(lambda: req in scheduler.queues.loading)
        assert req.handle.restored_tokens >= len(PREFIX) and not req.handle.ready()
        scheduler.abort("restoring")
        aborted = await collect(stream)
        check_invariants(cache, request_pages=0)  # the copy still runs: its pages belong to the tree, not the request
        cache.engine.gate.set()
        await wait_until(lambda: not cache.busy)
        return aborted, await collect(submit(scheduler, "again", FOLLOW))

    aborted, again = run(scheduler, scenario)
    assert_aborted(aborted)
    assert again == offline.generate([FOLLOW], GREEDY)[0].output_ids
    assert cache.counters.loaded_back >= len(PREFIX)
    settle(scheduler)


def test_abort_mid_extend_forward(tiny_models, offline):
    """Aborted while the forward over its prompt runs (on the forward thread), with its cached prefix locked:
    its pages go back only after the forward that writes into them has ended."""
    scheduler = make_scheduler(tiny_models["llama"], 4096)
    entered, go = threading.Event(), threading.Event()
    forward = scheduler.runner.forward

    def held_forward(fb: ForwardBatch) -> torch.Tensor:
        if not fb.is_decode and "extending" in scheduler.requests and not go.is_set():
            entered.set()
            go.wait(30)
        return forward(fb)

    scheduler.runner.forward = held_forward

    async def scenario():
        await collect(submit(scheduler, "warm", WARM))
        stream = submit(scheduler, "extending", FOLLOW)
        await wait_until(entered.is_set)
        assert scheduler.requests["extending"].prefix_pages == len(PREFIX) // PAGE
        free = scheduler.cache.device_alloc.num_free
        scheduler.abort("extending")
        await asyncio.sleep(0.05)  # the loop runs on while the forward writes into the request's pages
        assert scheduler.cache.device_alloc.num_free == free, "pages freed while the forward still wrote into them"
        go.set()
        return await collect(stream), await collect(submit(scheduler, "again", FOLLOW))

    aborted, again = run(scheduler, scenario)
    assert_aborted(aborted)
    assert again == offline.generate([FOLLOW], GREEDY)[0].output_ids
    settle(scheduler)


class BlockedTransfer:
    """A PD KV source that never delivers: it waits until cancelled, then, like a receiver letting go of its
    buffer, takes a moment to unwind, noting whether the request's pages were still allocated meanwhile."""

    def __init__(self) -> None:
        self.cache: HierarchicalCache | None = None  # set once the scheduler exists
        self.started = False
        self.cancelled = False
        self.free_in_transfer = self.free_while_unwinding = -1

    async def __call__(self, req: Req, pages: torch.Tensor) -> tuple[int, float]:
        self.started = True
        self.free_in_transfer = self.cache.device_alloc.num_free
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            try:
                await asyncio.sleep(0.05)  # the scheduler keeps stepping: it must not free the pages yet
            finally:
                self.free_while_unwinding = self.cache.device_alloc.num_free
            raise


def test_abort_mid_pd_transfer(tiny_models):
    """Aborted while prefill's KV is arriving: the transfer is cancelled, and the request's pages go back only
    once the transfer task has ended (a receiver may still be writing into them until then)."""
    source = BlockedTransfer()
    scheduler = make_scheduler(tiny_models["llama"], 4096, kv_source=source)
    cache = source.cache = scheduler.cache
    cache.insert(PREFIX, cache.alloc_device(len(PREFIX) // PAGE))  # a cached prefix: the request locks a real node

    async def scenario():
        stream = submit(scheduler, "receiving", FOLLOW)
        await wait_until(lambda: source.started)
        assert scheduler.requests["receiving"].prefix_pages == len(PREFIX) // PAGE
        scheduler.abort("receiving")
        return await collect(stream)

    assert_aborted(run(scheduler, scenario))
    assert source.cancelled, "the abort did not cancel the transfer"
    assert source.free_while_unwinding == source.free_in_transfer, "pages freed while the transfer still ran"
    settle(scheduler)


def watch_out_of_pages(cache: HierarchicalCache) -> list[int]:
    """Prefix hits (tokens) of the load_back_and_lock calls that raised OutOfPages, filled in as they happen."""
    raised: list[int] = []
    inner = cache.load_back_and_lock

    def watched(match: MatchResult, extra_pages: int = 0) -> LoadHandle:
        try:
            return inner(match, extra_pages=extra_pages)
        except OutOfPages:
            raised.append(match.hit_tokens)
            raise

    cache.load_back_and_lock = watched
    return raised


def test_out_of_pages_at_admission_leaks_no_lock(tiny_models, offline):
    """A request with a cached prefix is admitted when L1 must evict for it. Under write_back the victims' pages
    come free only once their L2 copy lands, so the first attempt raises OutOfPages after locking the prefix:
    that lock must be dropped, the request waits, and it runs once the pages are free."""
    scheduler = make_scheduler(tiny_models["llama"], 40 * PAGE, 3.0, "write_back")
    cache = scheduler.cache
    raised = watch_out_of_pages(cache)

    async def scenario():
        await collect(submit(scheduler, "warm", WARM))
        await collect(submit(scheduler, "filler", OTHER, max_new_tokens=1))  # L1 nearly full, nothing locked
        assert cache.device_alloc.num_free < len(FOLLOW) // PAGE - len(PREFIX) // PAGE
        return await collect(submit(scheduler, "follow", FOLLOW))

    follow = run(scheduler, scenario)
    assert raised and raised[0] == len(PREFIX), f"admission never hit OutOfPages with the prefix matched: {raised}"
    assert follow == offline.generate([FOLLOW], GREEDY)[0].output_ids
    settle(scheduler)
