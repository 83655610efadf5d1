"""Property test: random request flows on a tiny HierarchicalCache against a flat reference model.

The reference is two sets of page prefixes (token tuples ending on a page boundary): those on L1 and those on
L2. Matching is checked against it, every operation's effect is checked against what it may change (an insert
puts its pages on L1, a load-back its prefix, locked prefixes never leave L1, an eviction releases exactly what
it reports, L2 never evicts for an allocation that then fails), and the tree's state is then adopted as the new
reference. After every step: page accounting per pool, tree invariants, KV contents of every page equal what
was written for that prefix, no free L2 page written, and no lock left once nothing is live.

Copies run only when a rule says so and fail where a rule says so, so every interleaving replays
deterministically; some rules let copies finish without applying them, so that the poll inside the next cache
call applies them (as the scheduler's calls do with copies that finished on the copy thread). Every rule and
interesting branch counts its hits in ``HITS``; ``test_every_rule_and_branch_fires`` fails if one never fires.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import struct
import zlib
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, settings, strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test,
)

from decode_worker.cache.copies import PendingCopy
from decode_worker.cache.copy_engine import CopyEngine, CopyJob, CopyQueue
from decode_worker.cache.hicache import HierarchicalCache, LoadBackError, LoadHandle
from decode_worker.cache.node import token_key
from decode_worker.cache.pool import KVLayout, KVPool, OutOfPages
from decode_worker.core.policies import EvictionPolicy, WritePolicy
from tests.cache_invariants import check_invariants, host_evictable_pages_by_walk, key_tokens, prefix_key

PS = 2
LAYOUT = KVLayout("prop", num_layers=2, num_kv_heads=1, head_dim=4, page_size=PS, dtype=torch.float32)
PAGE_SHAPE = (LAYOUT.num_layers, 2, PS, LAYOUT.num_kv_heads, LAYOUT.head_dim)
DEVICE_PAGES = 13  # 12 usable L1 pages (page 0 is scratch): live requests of up to 5 pages compete for them
HOST_PAGES = 16  # more than L1, fewer than the documents' 27 distinct pages: backups and prefetches meet a full L2
MAX_LIVE = 4  # live requests
MAX_FILLS = 3  # L2 page sets taken for a prefetch and not yet attached
MAX_TOKENS = 10
OVERSIZE = (0,) * (2 * HOST_PAGES)  # appended to a prompt: a prefetch larger than all of L2

# Prompts are prefixes of a few documents that part ways at different pages (and inside one), so requests share
# deep prefixes and meet each other's load-backs and backups, and the tree splits at every kind of boundary.
DOCS = (
    (0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
    (0, 0, 0, 0, 0, 0, 1, 1, 1, 1),  # leaves DOCS[0] at page 3
    (0, 0, 0, 0, 0, 1, 0, 0, 0, 0),  # ...inside page 2
    (0, 0, 1, 1, 0, 0, 1, 1, 0, 0),  # ...at page 1
    (1, 1, 1, 1, 1, 1, 1, 1, 1, 1),  # shares nothing with those
    (1, 1, 1, 1, 0, 0, 0, 0, 0, 0),  # leaves DOCS[4] at page 2
    (1, 0, 1, 0, 1, 0, 1, 0, 1, 0),  # shares nothing
)
PROMPT = st.tuples(st.integers(0, len(DOCS) - 1), st.integers(1, MAX_TOKENS))  # (document, tokens)

HITS: Counter[str] = Counter()  # rule and branch -> times it fired, across every machine run in this process


@functools.lru_cache(maxsize=None)  # a few dozen prefixes, checked thousands of times; callers never mutate it
def page_value(prefix: tuple[int, ...]) -> torch.Tensor:
    pid = zlib.crc32(struct.pack(f"<{len(prefix)}q", *prefix)) % (1 << 17)
    return (pid * 64 + torch.arange(PS * 16, dtype=torch.float32)).view(PAGE_SHAPE)


def page_prefixes(tokens: tuple[int, ...], n_tokens: int) -> list[tuple[int, ...]]:
    return [tokens[:p] for p in range(PS, n_tokens + 1, PS)]


@dataclass(eq=False)
class Copy:
    job: CopyJob = field(repr=False)
    seq: int  # submission order
    fail: bool = False  # set by a rule: the copy raises instead of copying

    @property
    def future(self) -> Future:
        return self.job.future


class ManualEngine(CopyEngine):
    """The real copy code, run in the real engine's order (its ``CopyQueue``: a load-back ahead of queued backups
    that do not touch its pages) when the test calls ``run``; a copy marked ``fail`` raises.

    A copy that raises by itself (the cache handed it bad pages) fails its future, as the copy thread would, and
    is kept in ``errors`` for the checks to report."""

    def __init__(self, device: KVPool, host: KVPool):
        super().__init__(device.buffer, host.buffer)
        self.copies: dict[CopyJob, Copy] = {}
        self.submitted = 0
        self.errors: list[Exception] = []

    def _submit(self, job: CopyJob) -> Future:
        self.pending.push(job)
        self.copies[job] = Copy(job, self.submitted)
        self.submitted += 1
        return job.future

    @property
    def queue(self) -> list[Copy]:
        """Queued copies in the order they will run."""
        return [self.copies[job] for job in self.pending.order()]

    def head(self, n: int) -> list[Copy]:
        return self.queue[:n]

    def run(self, n: int | None = None) -> None:
        """Finish the next ``n`` copies (all by default); the cache sees them at its next poll."""
        for _ in range(len(self.pending) if n is None else min(n, len(self.pending))):
            self.note_overtaking()
            copy = self.copies.pop(self.pending.pop())
            if copy.fail:
                copy.future.set_exception(RuntimeError("injected copy failure"))
                continue
            self.run_job(copy.job)
            if copy.future.exception() is not None:
                self.errors.append(copy.future.exception())

    def note_overtaking(self) -> None:
        """Count the next copy's branch: a load-back overtaking older backups, or a backup run first because the
        oldest load-back touches its pages."""
        loads, backups = self.pending.loads, self.pending.backups
        if not (loads and backups):
            return
        if self.pending.waits_for_backup(loads[0]):
            HITS["load_waits_for_backup"] += 1
        elif self.copies[backups[0]].seq < self.copies[loads[0]].seq:
            HITS["load_overtakes_backup"] += 1


@dataclass
class Req:
    tokens: tuple[int, ...]
    handle: LoadHandle
    pages: np.ndarray | None = None  # after take_pages: the handle's prefix pages, then the request's own
    grown: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))  # decode's pages

    @property
    def owned(self) -> int:
        """L1 pages the request holds outside the tree."""
        if self.pages is None:
            return len(self.handle.delta_pages) + len(self.grown)
        return len(self.pages) - len(self.handle.device_indices) + len(self.grown)

    def waits_ok(self) -> bool:
        """No copy its prefix depends on has failed (a failed one takes the prefix off L1 until it retries)."""
        return all(op.ok is not False for op in self.handle.waits)


@dataclass(eq=False)
class Fill:
    """L2 pages taken with ``alloc_host`` for pages ``from_page, ...`` of ``tokens``, not yet attached or freed."""

    tokens: tuple[int, ...]
    from_page: int
    pages: np.ndarray
    prefetch: Any = None  # the L3 Prefetch writing them; None: the test wrote them all at once


@dataclass
class Tiers:
    """What the tree holds, as page prefixes per tier, plus nodes in neither tier and the L2 pages in use."""

    dev: set[tuple[int, ...]] = field(default_factory=set)
    host: set[tuple[int, ...]] = field(default_factory=set)
    gap: set[tuple[int, ...]] = field(default_factory=set)
    host_pages: set[int] = field(default_factory=set)


class CacheMachine(RuleBasedStateMachine):
    RULES: tuple[str, ...] = (
        "start", "stale_start", "twins", "share", "finish", "request", "abort", "grow", "evict", "copies_land",
        "copy_fails", "flush", "host_fill", "host_attach",
    )
    BRANCHES: tuple[str, ...] = (
        "start_out_of_pages", "grow_out_of_pages",  # an allocation that cannot be met takes nothing
        "load_back_failed",  # a request's wait raised LoadBackError after an injected failure
        "fail_load", "fail_backup", "fail_demotion",  # a queued L2->L1, L1->L2 or write_back L1->L2 copy will fail
        "stale_load_failed_on_path",  # a match taken before a load on its path failed, locked after
        "stale_demotion_failed_on_path",  # ...before a write_back demotion on its path failed
        "share_stops_at_loading", "finish_stops_at_loading",  # cache_in_flight / insert meet a load in flight
        "backup_evicted_l2", "backup_skipped_l2_full",  # an insert's backup made room on L2 / found none
        "flush_kept_locked",  # flush left locked paths in place
        "host_fill_oversized", "host_alloc_refused",  # alloc_host larger than L2 / refused
        "host_attach_connected", "host_attach_duplicate", "host_attach_dropped",  # insert_host outcomes
        "evict_split",  # an slru eviction batch (a rule's or an allocation's) split its last victim
        "load_overtakes_backup",  # a load-back ran ahead of older backups queued before it
        "load_waits_for_backup",  # ...or behind the backups writing the L2 pages it reads (a demotion)
    )

    def __init__(self):
        super().__init__()
        self.reqs: list[Req] = []
        self.fills: list[Fill] = []
        self.loop = asyncio.new_event_loop()
        self.cache: HierarchicalCache | None = None
        self.failed = False  # some copy was made to fail
        self.clean = False  # the last step passed its checks (teardown then checks that everything ends cleanly)
        self.l2_snap: torch.Tensor | None = None  # the L2 buffer as of the last check
        self.l2_snap_free: set[int] = set()  # ...and its free pages then
        self.l2_handed_out: set[int] = set()  # L2 pages allocated since the last check

    @initialize(
        policy=st.sampled_from(tuple(WritePolicy)),
        eviction=st.sampled_from(tuple(EvictionPolicy)),
        l2=st.sampled_from((True, True, True, False)),  # most rules need L2
    )
    def setup(self, policy, eviction, l2):
        self.build(policy, eviction, l2)

    def build(self, policy: str, eviction: str, l2: bool, **cache_kw) -> None:
        self.dev = KVPool(LAYOUT, DEVICE_PAGES)
        self.host = KVPool(LAYOUT, HOST_PAGES) if l2 else None
        self.engine = ManualEngine(self.dev, self.host) if l2 else None
        self.cache = HierarchicalCache(
            self.dev, self.host, write_policy=policy, eviction=eviction, engine=self.engine, **cache_kw
        )
        self.dev_ref: set = set()
        self.host_ref: set = set()
        if self.cache.host_alloc is not None:
            self.cache.host_alloc.alloc = self.recording(self.cache.host_alloc.alloc)
        self.splits = 0
        self.cache._split = self.counting(self.cache._split)
        self.cache.evict_device = self.noting_splits(self.cache.evict_device)
        self.cache.evict_host = self.noting_splits(self.cache.evict_host)
        self.cache._alloc_host = self.checking_host_count(self.cache._alloc_host)

    def checking_host_count(self, alloc_host: Callable) -> Callable:
        """The cache's L2 allocation, first checking its pre-check count against a walk: also inside a write_back
        eviction batch, whose victims are not locked yet (the step invariants only see the state between steps)."""

        def check_then_alloc(n: int):
            fast, walk = self.cache._host_evictable_pages(), host_evictable_pages_by_walk(self.cache)
            assert fast == walk, f"L2 evictable pages {fast} != {walk} by a walk"
            return alloc_host(n)

        return check_then_alloc

    def counting(self, split: Callable) -> Callable:
        """The cache's split, counted: an eviction batch that splits is a page-precise one."""

        def split_and_count(*args):
            self.splits += 1
            return split(*args)

        return split_and_count

    def noting_splits(self, evict: Callable[[int], int]) -> Callable[[int], int]:
        """An eviction batch (from a rule or inside an allocation) that notes when it split its last victim."""

        def evict_and_note(n: int) -> int:
            splits = self.splits
            freed = evict(n)
            if self.splits > splits:
                self.hit("evict_split")
            return freed

        return evict_and_note

    def recording(self, alloc: Callable[[int], np.ndarray]) -> Callable[[int], np.ndarray]:
        """The L2 allocator, noting what it hands out: a page allocated, written and freed again within one step
        (a composite rule) is no stray write."""

        def alloc_and_note(n: int) -> np.ndarray:
            pages = alloc(n)
            self.l2_handed_out.update(pages.tolist())
            return pages

        return alloc_and_note

    def hit(self, name: str) -> None:
        """Count a rule (called first thing) or branch; a step under way is not clean until its checks pass."""
        assert name in self.RULES + self.BRANCHES, f"unknown rule or branch {name}"
        HITS[name] += 1
        self.clean = False

    def call(self, fn: Callable, *args, **kwargs) -> Any:
        """A cache call that may poll finished copies (the L3 machine runs these on its event loop)."""
        return fn(*args, **kwargs)

    @staticmethod
    def prompt(spec: tuple[int, int]) -> tuple[int, ...]:
        doc, n = spec
        return DOCS[doc][:n]

    # -- reference model ------------------------------------------------------------------------------------

    def expected_match(self, tokens) -> tuple[int, int]:
        pages = page_prefixes(tokens, len(tokens))
        d = 0
        while d < len(pages) and pages[d] in self.dev_ref:
            d += 1
        h = d
        while h < len(pages) and pages[h] in self.host_ref and pages[h] not in self.dev_ref:
            h += 1
        return d * PS, (h - d) * PS

    def expected_span(self, tokens: tuple[int, ...], from_page: int, end: int) -> range:
        """What insert_host attaches: the pages past the cached run of ``tokens``, if that run reaches
        ``from_page`` and no node in neither tier holds the spot."""
        t = self.tree_state()
        cached, have = t.dev | t.host, 0
        while have < end and tokens[: (have + 1) * PS] in cached:
            have += 1
        blocked = have < end and tokens[: (have + 1) * PS] in t.gap
        start = max(have, from_page)
        return range(0) if blocked or have < from_page or start >= end else range(start, end)

    def tree_state(self) -> Tiers:
        """Page prefixes per tier, read off the tree, checking each page's KV on the way."""
        t = Tiers()
        stack = [(self.cache.tree.root, ())]
        while stack:
            node, prefix = stack.pop()
            for child in node.children.values():
                tokens = key_tokens(child.key)
                for j in range(len(tokens) // PS):
                    p = prefix + tokens[: (j + 1) * PS]
                    if child.on_device:
                        t.dev.add(p)
                        if child.loading is None:
                            page = int(child.device_indices[j])
                            assert torch.equal(self.dev.buffer[page], page_value(p)), f"L1 data of {p}"
                    if child.on_host:
                        t.host.add(p)
                        page = int(child.host_indices[j])
                        t.host_pages.add(page)
                        if child.saving is None:
                            assert torch.equal(self.host.buffer[page], page_value(p)), f"L2 data of {p}"
                    if not (child.on_device or child.on_host):
                        t.gap.add(p)
                stack.append((child, prefix + tokens))
        return t

    def adopt(self, on_device: list | None = None) -> tuple[set, set]:
        """Check what an operation may have changed, then take the tree's state as the reference."""
        t = self.tree_state()
        for r in self.reqs:
            if r.waits_ok():
                missing = set(page_prefixes(r.tokens, r.handle.prefix_tokens)) - t.dev
                assert not missing, f"locked prefixes left L1: {missing}"
        assert set(on_device or ()) <= t.dev, f"expected on L1: {set(on_device) - t.dev}"
        old = self.dev_ref, self.host_ref
        self.dev_ref, self.host_ref = t.dev, t.host
        return old

    def run_copies(self, n: int | None = None) -> None:
        if self.engine is not None:
            self.engine.run(n)
        self.call(self.cache.poll)

    def land(self, n: int) -> bool:
        """Finish the next ``n`` copies without applying them: the next cache call's poll does. True if one
        of them fails (itself, or a copy it reads from)."""
        if self.engine is None or not n:
            return False
        landing = self.engine.head(n)
        doomed = {c.future for c in landing if c.fail}
        failing = any(c.fail or any(d.ok is False or d.future in doomed for d in self.pending_op(c).deps)
                      for c in landing)
        self.engine.run(n)
        return failing

    def pending_op(self, copy: Copy) -> PendingCopy:
        return next(op for op in self.cache.copies.queue if op.future is copy.future)

    # -- requests -----------------------------------------------------------------------------------------------

    def lock(self, tokens: tuple[int, ...], m) -> Req | None:
        """load_back_and_lock for the whole request; checks the handle covers it. None when out of pages."""
        total = -(-len(tokens) // PS)
        try:
            h = self.call(self.cache.load_back_and_lock, m, extra_pages=total - m.hit_tokens // PS)
        except OutOfPages:
            self.hit("start_out_of_pages")
            self.adopt()
            return None
        assert h.prefix_tokens % PS == 0 and h.prefix_tokens // PS + len(h.delta_pages) == total, (
            f"{h.prefix_tokens}-token prefix and {len(h.delta_pages)} pages for a {total}-page request"
        )
        self.reqs.append(Req(tokens, h))
        self.adopt(on_device=page_prefixes(tokens, h.prefix_tokens))
        return self.reqs[-1]

    @precondition(lambda self: len(self.reqs) < MAX_LIVE)
    @rule(p=PROMPT)
    def start(self, p):
        self.hit("start")
        self.start_tokens(self.prompt(p))

    def start_tokens(self, tokens: tuple[int, ...]) -> Req | None:
        m = self.cache.match(tokens)
        assert (m.device_hit_tokens, m.host_hit_tokens) == self.expected_match(tokens)
        assert len(m.device_indices) * PS == m.device_hit_tokens
        r = self.lock(tokens, m)
        if r is not None:
            assert r.handle.prefix_tokens == m.hit_tokens and r.handle.restored_tokens == m.host_hit_tokens
        return r

    @precondition(lambda self: len(self.reqs) < MAX_LIVE and self.engine is not None and self.engine.queue)
    @rule(i=st.integers(0, 7), n=st.integers(1, 4), fail=st.booleans())
    def stale_start(self, i, n, fail):
        """A request for the prefix that copy ``i`` of the next ``n`` writes (a load-back or demotion if any)
        matches, then those copies finish before its lock (with ``fail``, those writing the matched path fail):
        load_back_and_lock applies them, so the tiers on the matched path may change under it."""
        self.hit("stale_start")
        landing = [c for c in self.engine.head(n) if self.pending_op(c).nodes]  # an undone load writes none
        if not landing:
            return
        targets = [c for c in landing if self.copy_kind(c) != "backup"] or landing
        op = self.pending_op(targets[i % len(targets)])
        self.stale(key_tokens(prefix_key(self.cache.tree, op.nodes[-1])), n, fail)

    def stale(self, tokens: tuple[int, ...], n: int, fail: bool) -> None:
        """Match ``tokens``, let ``n`` copies finish unapplied (failing those on the path with ``fail``), lock."""
        m = self.cache.match(tokens)
        assert (m.device_hit_tokens, m.host_hit_tokens) == self.expected_match(tokens)
        path = set(m.path)
        for copy in self.engine.head(n):
            on_path = path & set(self.pending_op(copy).nodes)
            if fail and on_path:
                self.doom(copy)
            if copy.fail and on_path and self.copy_kind(copy) != "backup":
                self.hit(f"stale_{self.copy_kind(copy)}_failed_on_path")
        self.engine.run(n)
        self.lock(tokens, m)  # it may redo the match: the prefix may differ, the pages must still cover the request

    def _take(self, i: int) -> Req | None:
        """Wait for request ``i``'s load-back and check its KV; a failed one is aborted and dropped."""
        r = self.reqs[i % len(self.reqs)]
        while any(not op.future.done() for op in r.handle.waits):  # just its own copies: later ones stay queued
            self.engine.run(1)
        try:
            self.loop.run_until_complete(r.handle.wait())
        except LoadBackError:
            assert self.failed, "load-back failed without an injected failure"
            self.hit("load_back_failed")
            self.reqs.remove(r)
            self._abort(r)
            self.adopt()
            return None
        for j, page in enumerate(r.handle.device_indices.tolist()):
            assert torch.equal(self.dev.buffer[page], page_value(r.tokens[: (j + 1) * PS])), "loaded KV"
        return r

    def _own(self, r: Req) -> np.ndarray:
        """The request's pages; on first use the "forward pass" writes the delta KV into them."""
        if r.pages is None:
            r.pages = r.handle.take_pages()
            for j in range(r.handle.prefix_tokens // PS, len(r.tokens) // PS):
                self.dev.buffer[r.pages[j]] = page_value(r.tokens[: (j + 1) * PS])
        return r.pages

    def reach(self, tokens: tuple[int, ...]) -> tuple[int, bool]:
        """Tokens of ``tokens`` the tree path covers before a node whose load-back is in flight, and whether
        one stopped it (insert and cache_in_flight graft nothing below such a node)."""
        reach = 0
        for node in self.cache.tree.match(token_key(tokens))[0]:
            if node.loading is not None:
                return reach, True
            reach += node.num_tokens
        return reach, False

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 7), computed=st.integers(0, 10))
    def share(self, i, computed):
        """A live request's load-back is awaited, its delta arrives, and it puts its first ``computed`` tokens'
        full pages into the tree (cache_in_flight; with none past its prefix this is just the wait)."""
        self.hit("share")
        self.share_req(i, computed)

    def share_req(self, i: int, computed: int) -> None:
        r = self._take(i)
        if r is None:
            return
        old, pages = r.handle, self._own(r)
        computed = min(computed, len(r.tokens))
        reach, stopped = self.reach(r.tokens[:computed])
        stop = reach if stopped else computed
        if stopped and reach // PS < computed // PS:
            self.hit("share_stops_at_loading")
        r.handle, new = self.cache.cache_in_flight(old, r.tokens[:computed], pages)
        r.pages = new
        prefix = len(r.handle.device_indices)
        expect = max(len(old.device_indices), stop // PS)
        assert prefix == expect and len(new) == len(pages)
        assert np.array_equal(new[:prefix], r.handle.device_indices) and np.array_equal(new[prefix:], pages[prefix:])
        assert (r.handle is old) == (prefix == len(old.device_indices))
        for j, page in enumerate(new[: len(r.tokens) // PS].tolist()):
            assert torch.equal(self.dev.buffer[page], page_value(r.tokens[: (j + 1) * PS])), f"KV of page {j}"
        self.adopt(on_device=page_prefixes(r.tokens, prefix * PS))

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 7), backup=st.booleans(), resume=st.booleans())
    def finish(self, i, backup, resume):
        """The delta arrived and decoding ended (or, with ``resume``, the request was retracted and restarts)."""
        self.hit("finish")
        self.finish_req(i, backup, resume)

    def finish_req(self, i: int, backup: bool, resume: bool) -> None:
        r = self._take(i)
        if r is None:
            return
        self.reqs.remove(r)
        h, tokens = r.handle, r.tokens
        pages = self._own(r)
        n_full = len(tokens) // PS
        stop, stopped = self.reach(tokens)
        if stopped and stop < n_full * PS:
            self.hit("finish_stops_at_loading")
        grafted = stop if stopped else n_full * PS  # never short of the prefix: that is locked on L1
        before = self.tree_state()
        cached = self.cache.insert(tokens, pages, backup=backup)
        assert cached % PS == 0 and cached <= n_full * PS
        if self.host is not None and (backup or self.cache.write_policy == "write_through"):
            self.check_backup_room(tokens, before)
        self.cache.free_device(np.concatenate([pages[n_full:], r.grown]))
        self.call(self.cache.release, h)
        self.adopt(on_device=page_prefixes(tokens, grafted))
        if resume:
            self.start_tokens(tokens)

    def check_backup_room(self, tokens: tuple[int, ...], before: Tiers) -> None:
        """An insert's backup evicts L2 only to make room it then uses: no L2 lost to a skipped backup."""
        after = self.tree_state()
        lost = (before.host - before.dev) - after.host
        skipped = any(p in after.dev and p not in after.host for p in page_prefixes(tokens, len(tokens)))
        if skipped:
            self.hit("backup_skipped_l2_full")
            assert not lost, f"L2 evicted {sorted(lost)} for a backup it then skipped"
        elif lost:
            self.hit("backup_evicted_l2")

    @precondition(lambda self: len(self.reqs) < MAX_LIVE)
    @rule(p=PROMPT, backup=st.booleans(), demote=st.booleans(), squeeze=st.booleans())
    def request(self, p, backup, demote, squeeze):
        """A whole request at once: the common case, and what fills the cache. With ``squeeze``, prefetches hold
        every free L2 page meanwhile, so a backup it needs must evict host-only pages or be skipped."""
        self.hit("request")
        held = self.cache.alloc_host(self.cache.host_alloc.num_free) if squeeze and self.host is not None else None
        self.whole_request(self.prompt(p), backup, demote)
        if held is not None:
            self.cache.free_host(held)

    def whole_request(self, tokens: tuple[int, ...], backup: bool, demote: bool) -> None:
        """Start and finish; with ``demote`` its copies land and L1 is evicted as far as it goes, so that the
        prompt's pages end up on L2 only (an old prompt)."""
        r = self.start_tokens(tokens)
        if r is not None:
            self.finish_req(self.reqs.index(r), backup, resume=False)
        if demote:
            self.run_copies()
            self.adopt()
            self.evict_l1(DEVICE_PAGES)

    @precondition(lambda self: self.host is not None and len(self.reqs) < MAX_LIVE - 2)
    @rule(p=PROMPT, then=st.sampled_from(("wait", "share", "finish", "fail", "stale", "halves")))
    def twins(self, p, then):
        """A request starts, and while its pages past the cached prefix are not in the tree yet, its prompt
        arrives twice more (retries, n > 1): the first copy is served and pushed to L2 (backed up now where the
        policy would not, demoted under write_back), the second restores it. Then the first request may at once
        share or insert its pages over that load-back in flight, or the load-back is doomed to fail, or a third
        copy matches now and locks once the twin's copies failed. With ``halves`` a copy of the prompt's first
        half restores those pages first, the twin's load-back of the rest rides on it, and the first copy
        writing that path is doomed. (At most one live request before: L1 has room for the rest.)"""
        self.hit("twins")
        r = self.start_tokens(self.prompt(p))
        if r is None or r.handle.prefix_tokens == len(r.tokens) // PS * PS:
            return
        self.whole_request(r.tokens, backup=self.cache.write_policy == "write_through_selective", demote=True)
        if then == "halves":
            self.start_tokens(r.tokens[: len(r.tokens) // 2])
        twin = self.start_tokens(r.tokens)
        if then == "fail" and twin is not None:
            for copy in self.engine.queue:
                if self.pending_op(copy) in twin.handle.waits:
                    self.doom(copy)
        if then == "halves":
            path = set(self.cache.tree.match(token_key(r.tokens))[0])
            first = next((c for c in self.engine.queue if path & set(self.pending_op(c).nodes)), None)
            if first is not None:
                self.doom(first)
        if then == "stale" and len(self.reqs) < MAX_LIVE:
            self.stale(r.tokens, len(self.engine.queue), fail=True)
        if then == "share":
            self.share_req(self.reqs.index(r), len(r.tokens))
        elif then == "finish":
            self.finish_req(self.reqs.index(r), backup=False, resume=False)

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 7))
    def abort(self, i):
        self.hit("abort")
        self._abort(self.reqs.pop(i % len(self.reqs)))
        self.adopt()

    def _abort(self, r: Req) -> None:
        if r.pages is not None:
            self.cache.free_device(r.pages[len(r.handle.device_indices) :])
        self.cache.free_device(r.grown)
        self.call(self.cache.release, r.handle)

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 7), n=st.integers(1, 4), land=st.integers(0, 2))
    def grow(self, i, n, land):
        """Decode takes ``n`` more L1 pages for request ``i`` after ``land`` copies finished unapplied:
        alloc_device polls them, then evicts."""
        self.hit("grow")
        r = self.reqs[i % len(self.reqs)]
        self.land(land)
        try:
            pages = self.call(self.cache.alloc_device, n)
        except OutOfPages:
            self.hit("grow_out_of_pages")
            self.adopt()
            return
        tree_pages = {int(p) for node in self.cache.tree.nodes() if node.on_device for p in node.device_indices}
        assert not set(pages.tolist()) & tree_pages, "alloc_device handed out pages the tree holds"
        r.grown = np.concatenate([r.grown, pages])
        self.adopt()

    # -- tiers and copies ---------------------------------------------------------------------------------------

    @rule(n=st.integers(1, 12), host=st.booleans())
    def evict(self, n, host):
        """Free ``n`` pages of L1, or of L2 (``host``)."""
        self.hit("evict")
        if host:
            freed = self.cache.evict_host(n)
            old_dev, old_host = self.adopt()
            assert old_dev == self.dev_ref and freed == len(old_host - self.host_ref)
        else:
            self.evict_l1(n)

    def evict_l1(self, n: int) -> None:
        evictable = self.cache.tree.device_pages - self.cache.tree.locked_device_pages
        released = self.cache.evict_device(n)
        old_dev, _ = self.adopt()
        assert released == len(old_dev - self.dev_ref) and released >= min(n, evictable)
        if self.cache.eviction == EvictionPolicy.SLRU:
            assert released == min(n, evictable), "slru frees exactly the pages asked for"

    @precondition(lambda self: self.engine is not None and self.engine.queue)
    @rule(n=st.integers(1, 3), fail=st.booleans())
    def copies_land(self, n, fail):
        """The next ``n`` copies finish and are applied; with ``fail`` the first of them fails."""
        self.hit("copies_land")
        if fail:
            self.doom(self.engine.queue[0])
        self.run_copies(n)
        self.adopt()

    @precondition(lambda self: self.engine is not None and self.engine.queue)
    @rule(i=st.integers(0, 7), kind=st.sampled_from(("load", "backup", "demotion")))
    def copy_fails(self, i, kind):
        """The ``i``-th queued copy of a kind (L2->L1, L1->L2, write_back eviction) will fail when it runs."""
        self.hit("copy_fails")
        copies = [c for c in self.engine.queue if self.copy_kind(c) == kind]
        if copies:
            self.doom(copies[i % len(copies)])

    def copy_kind(self, copy: Copy) -> str:
        op = self.pending_op(copy)
        return "load" if op.kind == "load" else "demotion" if len(op.drain) else "backup"

    def doom(self, copy: Copy) -> None:
        copy.fail = self.failed = True
        self.hit(f"fail_{self.copy_kind(copy)}")

    @precondition(lambda self: self.reqs)
    @rule(land=st.integers(0, 2))
    def flush(self, land):
        """POST /flush_cache while requests run, after ``land`` copies finished unapplied (flush's poll applies
        them first)."""
        self.hit("flush")
        failing = self.land(land)
        dropped = self.call(self.cache.flush)
        old_dev, old_host = self.adopt()
        assert all(n.lock_ref > 0 for n in self.cache.tree.nodes()), "flush left an unlocked node"
        lost = len((old_dev | old_host) - (self.dev_ref | self.host_ref)) * PS
        assert dropped <= lost and (failing or dropped == lost), f"flush reported {dropped} of {lost} tokens"
        if self.dev_ref | self.host_ref:
            self.hit("flush_kept_locked")

    # -- host-only insertion --------------------------------------------------------------------------------------

    def alloc_fill(self, n: int) -> np.ndarray | None:
        """alloc_host for a prefetch of ``n`` pages; a refusal must leave L2 as it was."""
        if n > HOST_PAGES:
            self.hit("host_fill_oversized")
        before = self.tree_state()
        pages = self.cache.alloc_host(n)
        if pages is None:
            self.hit("host_alloc_refused")
            after = self.tree_state()
            assert after.host == before.host, f"L2 lost {sorted(before.host - after.host)} for a refused allocation"
        return pages

    @precondition(lambda self: self.host is not None and len(self.fills) < MAX_FILLS)
    @rule(p=PROMPT, back=st.integers(0, 2), oversize=st.sampled_from((False, False, True)))
    def host_fill(self, p, back, oversize):
        """L2 pages for the pages past the cached prefix (``back`` pages earlier: duplicates), written now,
        as an L3 prefetch would; ``oversize``: more pages than L2 has."""
        self.hit("host_fill")
        tokens = self.prompt(p) + (OVERSIZE if oversize else ())
        m = self.cache.match(tokens)
        from_page = max(0, m.hit_tokens // PS - back)
        if len(tokens) // PS <= from_page:
            return
        pages = self.alloc_fill(len(tokens) // PS - from_page)
        if pages is not None:
            for j, page in enumerate(pages.tolist()):
                self.host.buffer[page] = page_value(tokens[: (from_page + j + 1) * PS])
            self.fills.append(Fill(tokens, from_page, pages))
        self.adopt()

    @precondition(lambda self: self.fills)
    @rule(i=st.integers(0, 7), keep=st.booleans())
    def host_attach(self, i, keep):
        """Settle a fill: the pages that arrived join the tree as host-only nodes (``keep``), the rest are freed."""
        self.hit("host_attach")
        self.settle(self.fills[i % len(self.fills)], keep)

    def settle(self, fill: Fill, keep: bool) -> None:
        self.fills.remove(fill)
        arrived = self.stop_fill(fill)
        for j, page in enumerate(fill.pages[:arrived].tolist()):
            p = fill.tokens[: (fill.from_page + j + 1) * PS]
            assert torch.equal(self.host.buffer[page], page_value(p)), f"L2 data of {p} before insert_host"
        if not (keep and arrived):
            self.cache.free_host(fill.pages)
            self.adopt()
            return
        want = self.expected_span(fill.tokens, fill.from_page, fill.from_page + arrived)
        span = self.cache.insert_host(fill.tokens, fill.pages[:arrived], fill.from_page)
        assert span == want, f"insert_host attached {span}, expected {want}"
        self.hit("host_attach_connected" if span else "host_attach_dropped")
        if span and span.start > fill.from_page:
            self.hit("host_attach_duplicate")
        self.cache.free_host(fill.pages[arrived:])
        self.adopt()
        missing = {fill.tokens[: (j + 1) * PS] for j in span} - self.host_ref
        assert not missing, f"attached pages not on L2: {missing}"

    def stop_fill(self, fill: Fill) -> int:
        """Pages of the fill that hold data (the L3 machine stops its prefetch here)."""
        return len(fill.pages)

    def release_all(self) -> None:
        while self.reqs:
            self._abort(self.reqs.pop())
        while self.fills:
            self.settle(self.fills[-1], keep=False)
        self.run_copies()

    # -- invariants ----------------------------------------------------------------------------------------------

    @invariant()
    def consistent(self):
        if self.cache is not None:
            self.check()
            self.clean = True

    def check(self) -> None:
        """Everything that holds after every step."""
        assert self.engine is None or not self.engine.errors, f"a copy failed by itself: {self.engine.errors!r}"
        request_pages = sum(r.owned for r in self.reqs)
        fill_pages = sum(len(f.pages) for f in self.fills)
        check_invariants(self.cache, request_pages=request_pages, prefetch_pages=fill_pages)
        t = self.tree_state()
        dev = self.cache.device_alloc
        assert dev.num_free + len(t.dev) + self.cache.pages.draining + request_pages == dev.total
        if self.cache.host_alloc is not None:
            assert self.cache.host_alloc.num_free + len(t.host) + fill_pages == self.cache.host_alloc.total
            self.check_free_l2(t.host_pages | {p for f in self.fills for p in f.pages.tolist()})
        if not self.reqs and not self.cache.copies.queue:
            assert all(n.lock_ref == 0 for n in self.cache.tree.nodes()), "lock left with nothing live"

    def check_free_l2(self, used: set[int]) -> None:
        """No one writes an L2 page nobody owns: a page free at two checks in a row, and not handed out in
        between, keeps its bytes."""
        free = set(range(HOST_PAGES)) - used
        kept = sorted((free & self.l2_snap_free) - self.l2_handed_out)
        if kept:  # one comparison over all of them: this runs every step
            idx = torch.tensor(kept)
            same = self.host.buffer.index_select(0, idx) == self.l2_snap.index_select(0, idx)
            written = [p for p, ok in zip(kept, same.reshape(len(kept), -1).all(1).tolist()) if not ok]
            assert not written, f"free L2 pages {written} were written"
        self.l2_snap, self.l2_snap_free = self.host.buffer.clone(), free
        self.l2_handed_out.clear()

    def teardown(self):
        """Everything ends: every lock returns and every page is accounted for. After a failed step this only
        frees resources: the cache may be broken, and the step's error is the one to report."""
        try:
            if self.cache is not None and self.clean:
                self.release_all()
                self.check()  # with nothing live and no copy pending: no lock may be left
                assert self.cache.tree.locked_device_pages == 0
        finally:
            self.close_all()

    def close_all(self) -> None:
        if self.cache is not None:
            if self.engine is not None:
                self.engine.run()  # every copy done, so that close() cannot wait forever
            with contextlib.suppress(Exception):
                self.release_all()
                self.call(self.cache.close)
        self.close_loop()

    def close_loop(self) -> None:
        self.loop.close()


FAST = settings(
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
CacheMachine.TestCase.settings = FAST
TestHierarchicalCache = CacheMachine.TestCase


def assert_every_branch_fires(machine: type[CacheMachine], examples: int, names: tuple[str, ...]) -> None:
    """Run ``machine`` on a fixed seed and fail naming each of ``names`` (rules, branches) that never fired.

    The seed follows the machine's source: after a change, a branch the strategies reach only rarely shows here."""
    HITS.clear()
    run_state_machine_as_test(machine, settings=settings(FAST, max_examples=examples, derandomize=True, database=None))
    missing = [name for name in names if not HITS[name]]
    assert not missing, f"never fired: {missing}; hits: {dict(HITS)}"


def test_every_rule_and_branch_fires():
    assert_every_branch_fires(CacheMachine, 400, CacheMachine.RULES + CacheMachine.BRANCHES)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # every step checked against a full walk: ~180 s alone on 2 cores, past 600 s when shared
def test_hierarchical_cache_long():
    run_state_machine_as_test(CacheMachine, settings=settings(FAST, max_examples=3000, stateful_step_count=100))


def test_the_machine_catches_a_load_back_overtaking_the_backup_writing_its_pages(monkeypatch):
    """The ordering check can fail: with the copy queue planted to run every load-back ahead of every backup,
    one that reads L2 pages a queued write_back demotion has not written yet finishes before the copy it depends
    on: the request's wait fails (or, were it applied, its KV would be wrong)."""
    monkeypatch.setattr(CopyQueue, "waits_for_backup", lambda self, load: False)
    with pytest.raises(AssertionError, match="load-back failed without an injected failure|L1 data of|loaded KV"):
        run_state_machine_as_test(CacheMachine, settings=settings(
            FAST, max_examples=200, phases=[Phase.generate], database=None, derandomize=True))
