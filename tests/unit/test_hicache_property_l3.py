"""Property test: the cache machine of test_hicache_property with an L3 tier whose records arrive when a rule says.

The real StorageTier runs over an in-memory store whose ``get`` waits until a rule opens its gate, on an event
loop that the rules drive one iteration at a time; worker-thread steps (record checks) run inline, so every
interleaving of prefetch steps with cache calls and ``Prefetch.stop`` replays. A request's L3 side follows
StorageLookahead: look past the L1 + L2 hit, take L2 pages, prefetch, and on settling stop the prefetch, attach
the pages that arrived with ``insert_host`` and free the rest.

On top of the base model's checks (KV of every tree page, no free L2 page written, page accounting): a stopped
prefetch writes nothing more, prefetched pages hold their prompt's KV, and every record in the store holds the
KV of the page its key names.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
from concurrent.futures import Future, ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import dataclass

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import initialize, precondition, rule, run_state_machine_as_test

from decode_worker.cache.node import chain_hashes, token_key
from decode_worker.cache.storage import Prefetch, StorageTier, StoreBackend, decode_record, encode_record
from decode_worker.core.policies import EvictionPolicy, StorageBackup, WritePolicy
from tests.unit.test_hicache_property import (
    DOCS, FAST, LAYOUT, MAX_FILLS, OVERSIZE, PROMPT, PS, CacheMachine, Fill, assert_every_branch_fires, page_prefixes,
    page_value,
)

FILL: ContextVar[Fill | None] = ContextVar("fill", default=None)  # the fill a prefetch task (and its gets) serves
SOMETIMES = st.sampled_from((False, False, True))


def page_bytes(prefix: tuple[int, ...]) -> bytes:
    return page_value(prefix).numpy().tobytes()


def l3_keys(tokens: tuple[int, ...], root_hash: bytes) -> list[str]:
    return [h.hex() for h in chain_hashes(token_key(tokens), PS, root_hash)]


@functools.lru_cache(maxsize=None)
def l3_pages(root_hash: bytes) -> dict[str, tuple[int, ...]]:
    """L3 key -> the page prefix it names, for every page any prompt of the machine can have."""
    out = {}
    for doc in DOCS:
        for n in range(1, len(doc) + 1):
            tokens = doc[:n] + OVERSIZE
            out.update(zip(l3_keys(tokens, root_hash), page_prefixes(tokens, len(tokens))))
    return out


class InlineExecutor(ThreadPoolExecutor):
    """Runs ``asyncio.to_thread`` work at once, on the loop's thread: with a worker thread, the loop iteration in
    which a prefetch's record check returns would depend on timing, and a failing interleaving would not replay."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task, as a thread pool would
            future.set_exception(exc)
        return future


@dataclass(eq=False)
class Get:
    fill: Fill | None
    keys: list[str]
    gate: asyncio.Event
    state: str = "waiting"  # then "answered" or "cancelled"


class GatedStore(StoreBackend):
    """Records in a dict; every ``get`` waits for its gate, which only the test opens."""

    name = "gated"

    def __init__(self):
        self.records: dict[str, bytes] = {}
        self.gets: list[Get] = []

    def waiting(self) -> list[Get]:
        return [g for g in self.gets if g.state == "waiting"]

    async def exists(self, keys: list[str]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.records:
            n += 1
        return n

    async def get(self, keys: list[str]) -> list[bytes | None]:
        call = Get(FILL.get(), list(keys), asyncio.Event())
        self.gets.append(call)
        try:
            await call.gate.wait()
        except asyncio.CancelledError:
            call.state = "cancelled"
            raise
        call.state = "answered"
        return [self.records.get(k) for k in keys]

    async def put(self, keys: list[str], records: list[memoryview]) -> None:
        for key, record in zip(keys, records):
            self.records.setdefault(key, bytes(record))

    async def delete(self, keys: list[str]) -> None:
        for key in keys:
            self.records.pop(key, None)


L3_BRANCHES = (  # what the L3 side must reach; the base machine's own test covers the base branches
    "l3_miss",  # the store holds none of the pages past the hit
    "l3_prefetch",  # a prefetch started
    "l3_stop_waiting",  # stopped while its get waits for the store
    "l3_stop_answer_pending",  # stopped after the store answered, before the prefetch took the answer
    "l3_stop_done",  # stopped after the prefetch ended by itself
    "l3_partial",  # stopped with some but not all pages arrived
    "l3_arrive_after_stop",  # a stopped prefetch's get answers
    "l3_backed_up",  # pages of finished L1->L2 copies reached the store since the last l3_step
)


class L3Machine(CacheMachine):
    RULES = CacheMachine.RULES + ("l3_lookup", "l3_arrive", "l3_step")
    BRANCHES = CacheMachine.BRANCHES + L3_BRANCHES

    @initialize(
        policy=st.sampled_from(tuple(WritePolicy)),
        eviction=st.sampled_from(tuple(EvictionPolicy)),
        backup=st.sampled_from(tuple(StorageBackup)),
    )
    def setup(self, policy, eviction, backup):
        self.loop.set_default_executor(InlineExecutor())
        self.store = GatedStore()
        # no deadline: rules decide what arrives; a page a get: a prefetch can stop between any two pages
        self.tier = StorageTier(self.store, LAYOUT, op_timeout_s=1e6, batch_pages=1)
        self.build(policy, eviction, l2=True, storage=self.tier, storage_backup_policy=backup)
        self.page_of = l3_pages(self.cache.tree.root_hash)
        self.verified: set[str] = set()  # records already checked (a key's record never changes)
        self.stopped: list[tuple[Prefetch, int]] = []  # stopped prefetches and the count stop() returned
        self.backed_up = 0  # the tier's stored-page count at the last l3_step

    def keys(self, tokens: tuple[int, ...]) -> list[str]:
        return l3_keys(tokens, self.cache.tree.root_hash)

    def call(self, fn, *args, **kwargs):
        """On the loop: a finished backup hands its pages to the tier, which queues them for a loop task."""

        async def inside():
            return fn(*args, **kwargs)

        return self.loop.run_until_complete(inside())

    def step_loop(self, n: int) -> None:
        """``n`` iterations of the event loop; each runs the callbacks that were ready when it began."""
        for _ in range(n):
            self.loop.call_soon(self.loop.stop)
            self.loop.run_forever()

    # -- rules ---------------------------------------------------------------------------------------------------

    def seed(self, tokens: tuple[int, ...]) -> None:
        """Another pod stored these pages."""
        for key, prefix in zip(self.keys(tokens), page_prefixes(tokens, len(tokens))):
            self.store.records.setdefault(key, bytes(encode_record(key, self.tier.fingerprint, page_bytes(prefix))))

    @precondition(lambda self: len(self.fills) < MAX_FILLS)
    @rule(p=PROMPT, stored=st.booleans(), oversize=SOMETIMES)
    def l3_lookup(self, p, stored, oversize):
        """A queued request looks past its L1 + L2 hit in the store (where, with ``stored``, another pod has
        just put the whole document), takes L2 pages for what it finds and starts prefetching into them.
        ``oversize``: the prompt goes on for more pages than L2 holds."""
        self.hit("l3_lookup")
        if stored:
            self.seed(DOCS[p[0]] + (OVERSIZE if oversize else ()))
        tokens = self.prompt(p) + (OVERSIZE if oversize else ())
        m = self.cache.match(tokens)
        keys = self.cache.storage_keys(m)
        found = self.loop.run_until_complete(self.tier.exists(keys))
        if not found:
            if keys:
                self.hit("l3_miss")
            self.adopt()
            return
        pages = self.alloc_fill(found)
        if pages is not None:
            self.hit("l3_prefetch")
            fill = Fill(tokens, m.hit_tokens // PS, pages)
            fill.prefetch = self.call(self.start_prefetch, fill, keys[:found])
            self.fills.append(fill)
            self.step_loop(2)  # its first get reaches the store
        self.adopt()

    def start_prefetch(self, fill: Fill, keys: list[str]) -> Prefetch:
        FILL.set(fill)  # inside the call's task: the prefetch task inherits it, nothing else does
        return self.tier.start_prefetch(keys, self.host, fill.pages)

    @precondition(lambda self: self.store.waiting())
    @rule(i=st.integers(0, 7), steps=st.integers(0, 4), stop=st.sampled_from(("never", "before", "after")))
    def l3_arrive(self, i, steps, stop):
        """A waiting get's records arrive and the loop runs ``steps`` iterations. The request settles that
        prefetch just ``before`` they arrive, or right ``after`` those iterations (a scheduler step may run
        whatever the prefetch task is about to do next)."""
        self.hit("l3_arrive")
        waiting = self.store.waiting()
        get = waiting[i % len(waiting)]
        if stop == "before" and get.fill in self.fills:
            self.settle(get.fill, keep=True)
        if get.fill not in self.fills:
            self.hit("l3_arrive_after_stop")
        get.gate.set()
        self.step_loop(steps)
        if stop == "after" and get.fill in self.fills:
            self.settle(get.fill, keep=True)
        else:
            self.adopt()

    @rule(n=st.integers(1, 6), answer=st.booleans())
    def l3_step(self, n, answer):
        """The loop runs on (with ``answer``, every waiting get's records arrive first): prefetches copy what
        arrived, backups reach the store, stopped tasks end."""
        self.hit("l3_step")
        if answer:
            for get in self.store.waiting():
                get.gate.set()
        self.step_loop(n)
        if self.tier.backed_up_pages > self.backed_up:
            self.hit("l3_backed_up")
            self.backed_up = self.tier.backed_up_pages
        self.adopt()

    def stop_fill(self, fill: Fill) -> int:
        prefetch = fill.prefetch
        if prefetch is None:
            return super().stop_fill(fill)
        gets = [g for g in self.store.gets if g.fill is fill]
        if prefetch.done:
            self.hit("l3_stop_done")
        elif any(g.state == "answered" and prefetch.arrived <= prefetch.keys.index(g.keys[0]) for g in gets):
            self.hit("l3_stop_answer_pending")
        elif any(g.state == "waiting" for g in gets):
            self.hit("l3_stop_waiting")
        arrived = prefetch.stop()
        if 0 < arrived < len(prefetch.keys):
            self.hit("l3_partial")
        self.stopped.append((prefetch, arrived))
        return arrived

    # -- invariants ----------------------------------------------------------------------------------------------

    def check(self) -> None:
        super().check()
        for prefetch, arrived in self.stopped:  # Prefetch.stop's promise: the caller has freed the other pages
            assert prefetch.arrived == arrived, f"a prefetch stopped at {arrived} pages wrote up to {prefetch.arrived}"
        for key in self.store.records.keys() - self.verified:
            assert key in self.page_of, f"a record under {key}, which names no page of any prompt"
            prefix = self.page_of[key]
            payload = decode_record(self.store.records[key], key, self.tier.fingerprint, LAYOUT.page_bytes)
            assert bytes(payload) == page_bytes(prefix), f"the L3 record of {prefix} holds other KV"
            self.verified.add(key)

    def close_loop(self) -> None:
        """Store what is queued, end every task (a prefetch that ignored its stop may wait on a gate), close."""
        with contextlib.suppress(Exception):
            self.loop.run_until_complete(self.tier.close())
        for _ in range(3):
            for get in self.store.waiting():
                get.gate.set()
            for task in asyncio.all_tasks(self.loop):
                task.cancel()
            self.step_loop(5)
        super().close_loop()


L3Machine.TestCase.settings = FAST
TestHierarchicalCacheL3 = L3Machine.TestCase


def test_every_l3_rule_and_branch_fires():
    assert_every_branch_fires(L3Machine, 200, L3Machine.RULES + L3_BRANCHES)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # every step checked against a full walk: ~140 s alone on 2 cores, past 600 s when shared
def test_hierarchical_cache_l3_long():
    run_state_machine_as_test(L3Machine, settings=settings(FAST, max_examples=2000, stateful_step_count=100))
