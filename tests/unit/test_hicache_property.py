"""Property test: random request flows on a tiny HierarchicalCache against a flat reference model.

The reference is two sets of page prefixes (token tuples ending on a page boundary): those on L1 and those on
L2. Matching is checked against it, every operation's effect is checked against what it may change (an insert
puts its pages on L1, a load-back its prefix, locked prefixes never leave L1, an eviction releases exactly what
it reports), and the tree's state is then adopted as the new reference. After every step: page accounting per
pool, tree invariants, KV contents of every page equal what was written for that prefix, and no lock left
once nothing is live. Copies run only when a rule says so, so every interleaving replays deterministically.
"""
from __future__ import annotations

import asyncio
import struct
import zlib
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from decode_worker.cache.copy_engine import CopyEngine
from decode_worker.cache.hicache import EVICTION_POLICIES, WRITE_POLICIES, HierarchicalCache, LoadBackError, LoadHandle
from decode_worker.cache.pool import KVLayout, KVPool, OutOfPages
from decode_worker.cache.radix_tree import key_tokens, token_key

PS = 2
LAYOUT = KVLayout("prop", num_layers=2, num_kv_heads=1, head_dim=4, page_size=PS, dtype=torch.float32)
PAGE_SHAPE = (LAYOUT.num_layers, 2, PS, LAYOUT.num_kv_heads, LAYOUT.head_dim)
DEVICE_PAGES, HOST_PAGES = 13, 16  # 12 usable L1 pages (page 0 is scratch): up to 3 live requests of 5 pages
MAX_LIVE = 3

TOKENS = st.lists(st.integers(0, 1), min_size=1, max_size=10).map(tuple)  # small alphabet: shared prefixes


def page_value(prefix: tuple[int, ...]) -> torch.Tensor:
    pid = zlib.crc32(struct.pack(f"<{len(prefix)}q", *prefix)) % (1 << 17)
    return (pid * 64 + torch.arange(PS * 16, dtype=torch.float32)).view(PAGE_SHAPE)


def page_prefixes(tokens: tuple[int, ...], n_tokens: int) -> list[tuple[int, ...]]:
    return [tokens[:p] for p in range(PS, n_tokens + 1, PS)]


class ManualEngine(CopyEngine):
    """The real copy code, run in submission order when the test calls ``run``."""

    def __init__(self, device: KVPool, host: KVPool):
        super().__init__(device.buffer, host.buffer)
        self.queue: deque = deque()
        self.fail_next = 0

    def load(self, host_pages, device_pages) -> Future:
        return self._enqueue(self.host_buffer, self.device_buffer, host_pages, device_pages)

    def backup(self, device_pages, host_pages) -> Future:
        return self._enqueue(self.device_buffer, self.host_buffer, device_pages, host_pages)

    def _enqueue(self, *args) -> Future:
        future = Future()
        self.queue.append((future, args))
        return future

    def run(self, n: int | None = None) -> None:
        for _ in range(len(self.queue) if n is None else min(n, len(self.queue))):
            future, args = self.queue.popleft()
            if self.fail_next:
                self.fail_next -= 1
                future.set_exception(RuntimeError("injected copy failure"))
            else:
                self._copy(*args)
                future.set_result(None)


@dataclass
class Req:
    tokens: tuple[int, ...]
    handle: LoadHandle
    pages: torch.Tensor | None = None  # after take_pages: the handle's prefix pages, then the request's own

    @property
    def owned(self) -> int:
        """L1 pages the request holds outside the tree."""
        if self.pages is None:
            return self.handle.delta_pages.numel()
        return self.pages.numel() - self.handle.device_indices.numel()


class CacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.reqs: list[Req] = []
        self.loop = asyncio.new_event_loop()
        self.failures = False  # an injected copy failure may have undone copies since

    @initialize(policy=st.sampled_from(WRITE_POLICIES), eviction=st.sampled_from(EVICTION_POLICIES), l2=st.booleans())
    def setup(self, policy, eviction, l2):
        self.dev = KVPool(LAYOUT, DEVICE_PAGES)
        self.host = KVPool(LAYOUT, HOST_PAGES) if l2 else None
        self.engine = ManualEngine(self.dev, self.host) if l2 else None
        self.cache = HierarchicalCache(self.dev, self.host, write_policy=policy, eviction=eviction, engine=self.engine)
        self.dev_ref: set = set()
        self.host_ref: set = set()

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

    def tree_state(self) -> tuple[set, set]:
        """Page prefixes per tier, read off the tree, checking each page's KV on the way."""
        dev, host = set(), set()
        stack = [(self.cache.tree.root, ())]
        while stack:
            node, prefix = stack.pop()
            for child in node.children.values():
                tokens = key_tokens(child.key)
                for j in range(len(tokens) // PS):
                    p = prefix + tokens[: (j + 1) * PS]
                    if child.on_device:
                        dev.add(p)
                        if child.loading is None:
                            page = int(child.device_indices[j])
                            assert torch.equal(self.dev.buffer[:, :, page], page_value(p)), f"L1 data of {p}"
                    if child.on_host:
                        host.add(p)
                        if child.saving is None:
                            page = int(child.host_indices[j])
                            assert torch.equal(self.host.buffer[:, :, page], page_value(p)), f"L2 data of {p}"
                stack.append((child, prefix + tokens))
        return dev, host

    def adopt(self, on_device: list | None = None) -> tuple[set, set]:
        """Check what an operation may have changed, then take the tree's state as the reference."""
        dev, host = self.tree_state()
        if not self.failures:
            for r in self.reqs:
                missing = set(page_prefixes(r.tokens, r.handle.prefix_tokens)) - dev
                assert not missing, f"locked prefixes left L1: {missing}"
            assert set(on_device or ()) <= dev, f"expected on L1: {set(on_device) - dev}"
        old = self.dev_ref, self.host_ref
        self.dev_ref, self.host_ref = dev, host
        return old

    def run_copies(self, n: int | None = None) -> None:
        if self.engine is not None:
            self.engine.run(n)
        self.cache.poll()

    # -- rules --------------------------------------------------------------------------------------------------

    @precondition(lambda self: len(self.reqs) < MAX_LIVE)
    @rule(tokens=TOKENS)
    def start(self, tokens):
        m = self.cache.match(tokens)
        assert (m.device_hit_tokens, m.host_hit_tokens) == self.expected_match(tokens)
        assert m.device_indices.numel() * PS == m.device_hit_tokens
        total = -(-len(tokens) // PS)
        try:
            h = self.cache.load_back_and_lock(m, extra_pages=total - m.hit_tokens // PS)
        except OutOfPages:
            self.adopt()
            return
        assert h.prefix_tokens == m.hit_tokens and h.restored_tokens == m.host_hit_tokens
        self.reqs.append(Req(tokens, h))
        self.adopt(on_device=page_prefixes(tokens, m.hit_tokens))

    def _take(self, i: int) -> Req | None:
        """Wait for request ``i``'s load-back and check its KV; a failed one is aborted and dropped."""
        r = self.reqs[i % len(self.reqs)]
        while any(not op.future.done() for op in r.handle.waits):  # just its own copies: later ones stay queued
            self.engine.run(1)
        try:
            self.loop.run_until_complete(r.handle.wait())
        except LoadBackError:
            assert self.failures, "load-back failed without an injected failure"
            self.reqs.remove(r)
            self.cache.release(r.handle)
            self.adopt()
            return None
        for j, page in enumerate(r.handle.device_indices.tolist()):
            assert torch.equal(self.dev.buffer[:, :, page], page_value(r.tokens[: (j + 1) * PS])), "loaded KV"
        return r

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 7))
    def wait(self, i):
        if self._take(i) is not None:
            self.adopt()

    def _own(self, r: Req) -> torch.Tensor:
        """The request's pages; on first use the "forward pass" writes the delta KV into them."""
        if r.pages is None:
            r.pages = r.handle.take_pages()
            for j in range(r.handle.prefix_tokens // PS, len(r.tokens) // PS):
                self.dev.buffer[:, :, r.pages[j]] = page_value(r.tokens[: (j + 1) * PS])
        return r.pages

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 7), computed=st.integers(0, 10))
    def share(self, i, computed):
        """A live request puts its first ``computed`` tokens' full pages into the tree (cache_in_flight)."""
        r = self._take(i)
        if r is None:
            return
        old, pages = r.handle, self._own(r)
        computed = min(computed, len(r.tokens))
        reach, stop = 0, computed  # it stops at a node whose load-back is in flight
        for node in self.cache.tree.match(token_key(r.tokens[:computed]))[0]:
            if node.loading is not None:
                stop = reach
                break
            reach += node.num_tokens
        r.handle, new = self.cache.cache_in_flight(old, r.tokens[:computed], pages)
        r.pages = new
        prefix = r.handle.device_indices.numel()
        expect = max(old.device_indices.numel(), stop // PS)
        assert prefix == expect and new.numel() == pages.numel()
        assert torch.equal(new[:prefix], r.handle.device_indices) and torch.equal(new[prefix:], pages[prefix:])
        assert (r.handle is old) == (prefix == old.device_indices.numel())
        for j, page in enumerate(new[: len(r.tokens) // PS].tolist()):
            assert torch.equal(self.dev.buffer[:, :, page], page_value(r.tokens[: (j + 1) * PS])), f"KV of page {j}"
        self.adopt(on_device=page_prefixes(r.tokens, prefix * PS))

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 7), backup=st.booleans(), resume=st.booleans())
    def finish(self, i, backup, resume):
        """The delta arrived and decoding ended (or, with ``resume``, the request was retracted and restarts)."""
        r = self._take(i)
        if r is None:
            return
        self.reqs.remove(r)
        h, tokens = r.handle, r.tokens
        pages = self._own(r)
        n_full, stop = len(tokens) // PS, 0
        path, _ = self.cache.tree.match(token_key(tokens))
        for node in path:  # insert stops at a node whose load-back is still in flight
            if node.loading is not None:
                break
            stop += node.num_tokens
        cached = self.cache.insert(tokens, pages, backup=backup)
        assert cached % PS == 0 and cached <= n_full * PS
        self.cache.free_device(pages[n_full:])
        self.cache.release(h)
        expect = page_prefixes(tokens, n_full * PS if stop >= h.prefix_tokens else h.prefix_tokens)
        self.adopt(on_device=expect)
        if resume:
            self.start(tokens)

    @precondition(lambda self: len(self.reqs) < MAX_LIVE)
    @rule(tokens=TOKENS, backup=st.booleans())
    def request(self, tokens, backup):
        """A whole request at once: the common case, and what fills the cache."""
        self.start(tokens)
        if self.reqs and self.reqs[-1].tokens == tokens:
            self.finish(len(self.reqs) - 1, backup, resume=False)

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 7))
    def abort(self, i):
        r = self.reqs.pop(i % len(self.reqs))
        self._abort(r)
        self.adopt()

    def _abort(self, r: Req) -> None:
        if r.pages is not None:
            self.cache.free_device(r.pages[r.handle.device_indices.numel() :])
        self.cache.release(r.handle)

    @rule(n=st.integers(1, 12))
    def evict_device(self, n):
        evictable = self.cache.tree.device_pages - self.cache.tree.locked_device_pages
        released = self.cache.evict_device(n)
        old_dev, _ = self.adopt()
        assert released == len(old_dev - self.dev_ref) and released >= min(n, evictable)

    @rule(n=st.integers(1, 12))
    def evict_host(self, n):
        freed = self.cache.evict_host(n)
        old_dev, old_host = self.adopt()
        assert old_dev == self.dev_ref and freed == len(old_host - self.host_ref)

    @rule(n=st.integers(1, 3))
    def copies_land(self, n):
        self.run_copies(n)
        self.adopt()

    @precondition(lambda self: self.engine is not None)
    @rule()
    def next_copy_fails(self):
        self.engine.fail_next = 1
        self.failures = True

    @rule(tokens=TOKENS)
    def match_only(self, tokens):
        m = self.cache.match(tokens)
        assert (m.device_hit_tokens, m.host_hit_tokens) == self.expected_match(tokens)

    # -- invariants ----------------------------------------------------------------------------------------------

    @invariant()
    def consistent(self):
        request_pages = sum(r.owned for r in self.reqs)
        self.cache.check_invariants(request_pages=request_pages)
        dev_ref, host_ref = self.tree_state()
        dev = self.cache.device_alloc
        assert dev.num_free + len(dev_ref) + self.cache._draining + request_pages == dev.total
        if self.cache.host_alloc is not None:
            assert self.cache.host_alloc.num_free + len(host_ref) == self.cache.host_alloc.total
        for p in host_ref - dev_ref:  # host-only pages hang below cached pages, never below a gap
            parent = p[:-PS]
            assert not parent or parent in dev_ref or parent in host_ref, f"{p} below a gap"
        if not self.reqs and not self.cache._pending:
            assert all(n.lock_ref == 0 for n in self.cache.tree.nodes()), "lock left with nothing live"

    def teardown(self):
        if getattr(self, "cache", None) is None:
            return
        for r in self.reqs:
            self._abort(r)
        self.run_copies()
        self.cache.check_invariants(request_pages=0)
        assert all(n.lock_ref == 0 for n in self.cache.tree.nodes())
        assert self.cache.tree.locked_device_pages == 0
        self.cache.close()
        self.loop.close()


CacheMachine.TestCase.settings = settings(
    max_examples=250,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestHierarchicalCache = CacheMachine.TestCase
