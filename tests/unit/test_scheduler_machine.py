"""A hypothesis state machine over the real Scheduler on a tiny random-weight model.

Rules submit colocated requests (with shared heads, so some wait for another's extend to read them from the cache;
some scoring their prompt from a random position, some generating nothing), requests
whose output a grammar constrains (colocated or PD, where prefill's first token may be one the grammar refuses) and PD
requests to one of two prefill peers (whose handshake answers now, later, never, or
whose KV read fails), flood the queue's head with more requests for a third, stalled peer than one peer may look
ahead for,
answer or fail peers, land or fail reads, abort, step (running the L1<->L2 copies or leaving them in flight, as
``StepEngine`` lets a test decide) and step with a forward that raises. L1 is small, so requests retract and the
tree evicts. After every rule the machine checks page ownership, queues, page-table rows, what a PD request
waiting for its peer holds, that every request ended with an answer it was allowed to get, and that a scored prompt
got its log-probabilities once, equal to a cache-free forward's, and that a constrained output kept to its grammar; at
teardown it
drives everything to completion and checks that every page came back.
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import random
import re
from collections import Counter
from typing import NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from decode_worker.cache.hicache import HierarchicalCache
from decode_worker.cache.pool import KVPool, PageAllocator
from decode_worker.core.lifecycle import ReqState
from decode_worker.core.request import Bootstrap, GenerateInput, RequestError
from decode_worker.core.sampling import SamplingParams
from decode_worker.metrics import Metrics
from decode_worker.model.loader import load_model
from decode_worker.model.runner import ModelRunner
from decode_worker.scheduler import admission
from decode_worker.scheduler import scheduler as scheduler_module
from decode_worker.scheduler.admission import PEER_LOOKAHEAD, Admission
from decode_worker.scheduler.grammar import CompiledGrammar, RowGrammar
from decode_worker.scheduler.queues import Queues
from decode_worker.scheduler.req import KVTransfer, Req
from decode_worker.scheduler.roles import PeerPrompt, PendingReceive
from decode_worker.scheduler.scheduler import Scheduler
from tests.cache_invariants import check_invariants
from tests.unit.test_scheduler import PeerKV, StepEngine, settle

S = ReqState
_rng = random.Random(11)
PREFIXES = [[_rng.randrange(320) for _ in range(n)] for n in (12, 9, 5)]
"""Shared prompt heads, so the radix tree is hit (and split) across requests."""
TAILS = st.lists(st.integers(1, 12), min_size=1, max_size=8)  # a small alphabet: tails share prefixes too
INJECTED = "injected forward failure"
HITS: Counter[str] = Counter()  # what the rules and steps did, by name
BRANCHES = ("retraction", "restore from L2", "L1 eviction", "admitted past an unanswered peer", "peer answered late",
            "peer refused", "read landed", "read failed", "failing step", "failing step, a read in flight",
            "abort QUEUED", "abort TRANSFERRING", "abort RUNNING", "a peer's handshake started behind a stalled peer",
            "failing step, a read running", "scored prompt", "scored prompt after a cache hit", "grammar completed", "grammar dead end",
            "constrained request retracted", "waited for a sharing prompt's extend")
PEERS = (1, 2)  # the bootstrap ports of the healthy peers
SCORE_TOL = 1e-5  # prompt logprobs come back from float32 logits; KV from a wrong page is off by far more
STOP = 0  # the constrained requests' stop token (the machine's requests ignore end-of-sequence otherwise)
LETTERS = "cab"  # token t > 0 reads as LETTERS[t % 3], so most tokens spell a letter the grammar refuses
GRAMMAR = "[ab]{1,4}c"
GRAMMAR_PREFIX = re.compile(r"[ab]{0,4}|[ab]{1,4}c")  # what a constrained output may read as at any point
STALLED = 3  # the port of the peer whose requests flood the queue's head


class ScriptedPeer(PeerKV):
    """A decode role's prompt source whose prefill peer the machine scripts: per PD request its handshake is
    ``pending`` (not answered), ``answered`` or ``refused`` (answered with a failure, as a handshake error or
    timeout does), and its KV read waits on a future the machine lands or fails. A read that lands writes the
    prompt's real KV (from a cache-free forward) into the request's pages, as prefill's would."""

    def __init__(self, model, pool: KVPool) -> None:
        super().__init__(self._read)
        self.model, self.pool = model, pool
        self.peers: dict[str, str] = {}  # PD requests only
        self.reads: dict[str, asyncio.Future] = {}  # started reads, by request id
        self.received: set[str] = set()  # requests whose receive was called: admitted
        self.forgotten: set[str] = set()  # requests the scheduler told to stop their handshake
        self.stray_writes: list[str] = []  # reads that ended after their pages were no longer the request's
        self.prepared: set[str] = set()  # requests whose handshake admission started (``prepare``)
        self.reqs: dict[str, Req] = {}  # the machine's requests, by id

    def owns(self, req: Req, pages) -> bool:
        return req.handle is not None and set(pages.tolist()) <= set(req.handle.delta_pages.tolist())

    def receives(self, prompt: PeerPrompt) -> bool:
        return prompt.rid in self.peers

    def prepare(self, prompt: PeerPrompt, wakeup) -> None:
        if prompt.rid in self.peers:
            self.prepared.add(prompt.rid)

    def answered(self, prompt: PeerPrompt) -> bool:
        """A handshake answers only once it was started, as ``DeltaKVFetcher``'s does."""
        return prompt.rid in self.prepared and self.peers.get(prompt.rid) != "pending"

    def forget(self, prompt: PeerPrompt) -> None:
        self.forgotten.add(prompt.rid)

    async def _read(self, pending: PendingReceive, pages) -> tuple[int, float]:
        req = self.reqs[pending.prompt.rid]  # the scheduler's record, to check the read's pages are still its own
        self.received.add(req.rid)
        # A request failed for another reason (an abort, a failed step) after its read failed never looks at the
        # read's error; retrieve it here so asyncio does not log it as lost when the task is collected.
        asyncio.current_task().add_done_callback(lambda task: task.cancelled() or task.exception())
        if self.peers[req.rid] == "refused":
            raise RequestError(f"prefill handshake for {req.rid} timed out", 504, "timeout")
        future = self.reads[req.rid] = asyncio.get_running_loop().create_future()
        try:
            landed = await future
            if self.owns(req, pages):
                kv = reference(self.model, tuple(req.seq.prompt_ids)).kv
                self.pool.buffer[pages] = kv[req.prefix_pages:req.prefix_pages + len(pages)]
            return landed
        finally:  # a real read writes into ``pages`` until it has unwound: they must still be this request's
            if not self.owns(req, pages):
                self.stray_writes.append(req.rid)


def build(model, max_total_tokens: int, host_ratio: float, write_policy: str, max_running: int) -> Scheduler:
    """A float64 scheduler with 4-token pages whose copies run only when the machine says (``StepEngine``)."""
    runner = ModelRunner(model, max_total_tokens, page_size=4)
    host = KVPool(runner.layout, int((runner.num_pages - 1) * host_ratio)) if host_ratio else None
    engine = StepEngine(runner.pool.buffer, host.buffer) if host is not None else None
    cache = HierarchicalCache(runner.pool, host, write_policy=write_policy, engine=engine)
    return Scheduler(runner, cache, Metrics(), eos_token_ids=(), decode_text=lambda ids: "", max_running=max_running,
                     max_prefill_tokens=64, load_back_timeout_s=1e9, source=ScriptedPeer(model, runner.pool),
                     share_min_tokens=runner.page_size)  # one shared page defers, so the PREFIXES reach it


class Reference(NamedTuple):
    logprobs: torch.Tensor  # [position, vocab]: log-softmax of each position's logits
    kv: torch.Tensor  # the prompt's KV pages, in order


REFERENCES: dict[tuple[int, ...], Reference] = {}  # per prompt, for the machine's one model


def reference(model, ids: tuple[int, ...]) -> Reference:
    """A cache-free forward of ``ids`` on a runner of its own: what prefill hands over, and what scoring must give."""
    if ids not in REFERENCES:
        runner = ModelRunner(model, 64, page_size=4)
        pages = PageAllocator(runner.num_pages, reserved=1).alloc(-(-len(ids) // 4)).tolist()
        logits = runner.forward(runner.build_batch([list(ids)], [0], [pages], all_logits=True))
        REFERENCES[ids] = Reference(torch.log_softmax(logits.double(), -1), runner.pool.page_data(pages))
    return REFERENCES[ids]


@functools.cache
def compiled_grammar() -> CompiledGrammar:
    """``GRAMMAR`` compiled for the machine's vocabulary: token 0 stops, every other spells one of ``LETTERS``."""
    import xgrammar as xgr

    vocab = ["</s>"] + [LETTERS[t % 3] for t in range(1, 320)]
    info = xgr.TokenizerInfo(vocab, vocab_size=320, stop_token_ids=[STOP])
    return CompiledGrammar("regex", GRAMMAR, xgr.GrammarCompiler(info).compile_regex(GRAMMAR))


async def cancel_all(tasks) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def marks_failure(check):
    """Mark the machine failed when ``check`` fails, so that teardown does not drive a broken scheduler on."""
    @functools.wraps(check)
    def checked(self, *args) -> None:
        try:
            check(self, *args)
        except BaseException:
            self.failed = True
            raise

    return checked


class SchedulerMachine(RuleBasedStateMachine):
    model = None  # the LoadedModel, set by the ``loaded`` fixture

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.sched: Scheduler | None = None
        self.reqs: dict[str, Req] = {}  # every request submitted, live or ended
        self.events: dict[str, list] = {}
        self.closed: set[str] = set()
        self.allowed: dict[str, set[int]] = {}  # error statuses a request may end with, given what the machine did
        self.count = 0
        self.failed_steps = 0
        self.failed = False  # a rule or check failed: teardown must not bury that failure under its own
        self.flooded = False  # the stalled peer's requests were submitted

    # ---- helpers ----------------------------------------------------------------------------------------------

    @property
    def peer(self) -> ScriptedPeer:
        return self.sched.admission.source

    @property
    def engine(self) -> StepEngine | None:
        return self.sched.cache.engine

    def on_loop(self, fn):
        """Run ``fn`` inside a coroutine (admission starts receive tasks on the running loop), then let the tasks
        it started run until they wait."""
        async def inside():
            return fn()

        try:
            return self.loop.run_until_complete(inside())
        except Exception as e:
            self.failed = self.failed or str(e) != INJECTED
            raise
        finally:
            for _ in range(3):
                self.loop.run_until_complete(asyncio.sleep(0))
            self.collect()

    def collect(self) -> None:
        for rid, req in self.reqs.items():
            queue = req.stream.queue
            while not queue.empty():
                event = queue.get_nowait()
                assert rid not in self.closed, f"{rid} got an event after its stream closed"
                if event is None:
                    self.closed.add(rid)
                else:
                    self.events[rid].append(event)

    def live(self) -> list[str]:
        return sorted(self.sched.requests)

    def peers_in(self, state: str) -> list[str]:
        return sorted(r for r, s in self.peer.peers.items() if s == state and r in self.sched.requests)

    def open_reads(self) -> list[str]:
        return sorted(r for r, f in self.peer.reads.items() if not f.done())

    # ---- rules ------------------------------------------------------------------------------------------------

    @initialize(l1=st.sampled_from([48, 64, 96]), host=st.sampled_from([0.0, 1.5, 3.0]),
                policy=st.sampled_from(["write_through", "write_back"]), max_running=st.integers(2, 8))
    def start(self, l1: int, host: float, policy: str, max_running: int) -> None:
        self.sched = build(self.model, l1, host, policy, max_running)
        self.peer.reqs = self.reqs
        admission, waits = self.sched.admission, self.sched.admission._waits_for_sharer

        def counted(req: Req, computing: list[bytes]) -> bool:
            waited = waits(req, computing)
            HITS["waited for a sharing prompt's extend"] += waited
            return waited

        admission._waits_for_sharer = counted

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), tail=TAILS, max_new=st.integers(1, 16),
          mode=st.sampled_from(["colocated", "answered", "answered", "pending"]), port=st.sampled_from(PEERS))
    def submit(self, prefix: int, tail: list[int], max_new: int, mode: str, port: int) -> None:
        self.add_request(PREFIXES[prefix] + tail, max_new, mode, port)

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), tail=TAILS, max_new=st.integers(0, 6), data=st.data())
    def submit_scored(self, prefix: int, tail: list[int], max_new: int, data) -> None:
        """A colocated request that scores its prompt from a random position (0 included, whose first entry has no
        logprob), generating ``max_new`` tokens, 0 (score only) included: the cache may give it only the KV before
        the first position it scores."""
        prompt = PREFIXES[prefix] + tail
        self.add_request(prompt, max_new, "colocated", 0, data.draw(st.integers(0, len(prompt) - 1)))

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), tail=TAILS, max_new=st.integers(1, 8),
          mode=st.sampled_from(["colocated", "answered", "pending"]), port=st.sampled_from(PEERS))
    def submit_constrained(self, prefix: int, tail: list[int], max_new: int, mode: str, port: int) -> None:
        """A request whose output ``GRAMMAR`` constrains: in PD prefill's first token (``read_ends``' token) may be
        one the grammar refuses, which ends the request with an abort finish, its output kept."""
        self.add_request(PREFIXES[prefix] + tail, max_new, mode, port, constrained=True)

    def add_request(self, prompt: list[int], max_new: int, mode: str, port: int, score_from: int | None = None,
                    constrained: bool = False) -> None:
        rid = f"r{self.count}"
        self.count += 1
        boot = None
        if mode != "colocated":
            self.peer.peers[rid] = mode
            boot = Bootstrap("127.0.0.1", port, self.count)
        params = SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True,
                                regex=GRAMMAR if constrained else None)
        self.sched.submit(GenerateInput(rid, prompt, params, bootstrap=boot, return_logprob=score_from is not None,
                                        logprob_start=score_from), compiled_grammar() if constrained else None)
        self.reqs[rid], self.events[rid], self.allowed[rid] = self.sched.requests[rid], [], set()

    @precondition(lambda self: not self.flooded)
    @rule(extra=st.integers(1, 4), tail=TAILS)
    def stalled_peer_floods_the_queue(self, extra: int, tail: list[int]) -> None:
        """More requests than one peer may look ahead for, all for a peer that does not answer (it may later
        answer or refuse, as any pending peer): requests for the other peers queued behind them must still
        start their handshakes. Once per run: each such request stays queued until its peer moves."""
        self.flooded = True
        for _ in range(PEER_LOOKAHEAD + extra):
            self.add_request(PREFIXES[2] + tail, 1, "pending", STALLED)

    @precondition(lambda self: self.peers_in("pending"))
    @rule(data=st.data(), ok=st.booleans())
    def peer_answers(self, data, ok: bool) -> None:
        """A pending peer answers late, or its handshake fails (504) and the request must fail without pages."""
        rid = data.draw(st.sampled_from(self.peers_in("pending")))
        HITS["peer answered late" if ok else "peer refused"] += 1
        self.peer.peers[rid] = "answered" if ok else "refused"
        if not ok:
            self.allowed[rid].add(504)
        self.on_loop(lambda: None)

    @precondition(lambda self: self.open_reads())
    @rule(data=st.data(), ok=st.booleans(), token=st.integers(0, 5))
    def read_ends(self, data, ok: bool, token: int) -> None:
        """A KV read lands with prefill's first token (for a constrained request 0 and 3 are ones its grammar
        refuses), or fails mid-way (502)."""
        rid = data.draw(st.sampled_from(self.open_reads()))
        HITS["read landed" if ok else "read failed"] += 1
        if ok:
            self.peer.reads[rid].set_result((token, -0.5))
        else:
            self.peer.reads[rid].set_exception(RequestError("KV transfer from prefill failed: peer_lost", 502,
                                                            "transfer_error"))
            self.allowed[rid].add(502)
        self.on_loop(lambda: None)

    @precondition(lambda self: self.sched.requests)
    @rule(data=st.data(), stage=st.sampled_from([S.RUNNING, S.TRANSFERRING, S.LOADING, S.RETRACTED, S.QUEUED]))
    def abort(self, data, stage: ReqState) -> None:
        """The client goes away: a request at ``stage`` if there is one (most requests are queued), else any."""
        live = [rid for rid in self.live() if self.sched.requests[rid].state is stage] or self.live()
        rid = data.draw(st.sampled_from(live))
        HITS[f"abort {self.sched.requests[rid].state.name}"] += 1
        self.allowed[rid].add(499)
        self.sched.abort(rid)
        self.on_loop(lambda: None)

    @rule(steps=st.integers(1, 6), copies=st.booleans())
    def step(self, steps: int, copies: bool) -> None:
        """``steps`` scheduler steps; with ``copies`` the L1<->L2 copies queued so far land first."""
        for _ in range(steps):
            if copies and self.engine is not None:
                self.engine.run()
            before = self.snapshot()
            self.on_loop(self.sched.step_sync)
            self.note_step(*before)
            self.each_peer_looks_ahead(before[-1])

    def snapshot(self) -> tuple:
        counters = self.sched.cache.counters
        return (self.sched.metrics.retractions._value.get(), counters.cached_host, counters.evicted_device,
                list(self.sched.queues.prealloc))

    def note_step(self, retractions: float, restored: int, evicted: int, queued: list[Req]) -> None:
        """Count what a step did, for ``test_scheduler_machine``'s check that the machine reaches it."""
        now = self.snapshot()
        for name, was, is_ in (("retraction", retractions, now[0]), ("restore from L2", restored, now[1]),
                               ("L1 eviction", evicted, now[2])):
            HITS[name] += is_ > was
        if any(r.grammar is not None and r.state is S.RETRACTED for r in self.sched.requests.values()):
            HITS["constrained request retracted"] += 1
        pending = [i for i, r in enumerate(queued) if self.peer.peers.get(r.rid) == "pending"]
        if pending and any(r.state not in (S.QUEUED, S.MATCHING) for r in queued[pending[0] + 1:]):
            HITS["admitted past an unanswered peer"] += 1

    @marks_failure
    def each_peer_looks_ahead(self, queued: list[Req]) -> None:
        """After a step, each peer's first ``PEER_LOOKAHEAD`` requests in the queue the step began with have their
        handshakes started, however many requests other peers have ahead of them."""
        seen: Counter[int] = Counter()
        for req in queued:
            if req.rid not in self.peer.peers or req.seq.output_ids or req.aborted is not None:
                continue  # an aborted request left the queue as the step began
            port = req.inp.bootstrap.port
            seen[port] += 1
            if seen[port] <= PEER_LOOKAHEAD:
                assert req.rid in self.peer.prepared, (
                    f"{req.rid}'s handshake (peer {port}, {seen[port]}th of its queued requests) was not started; "
                    f"queued per peer: {dict(seen)}")
                if port != STALLED and seen[STALLED] >= PEER_LOOKAHEAD:
                    HITS["a peer's handshake started behind a stalled peer"] += 1

    @precondition(lambda self: self.sched.requests and self.failed_steps < 2)
    @rule()
    def failing_step(self) -> None:
        """A forward that raises: the step fails every live request (500) and the scheduler goes on. Twice at
        most per run: each ends every live request, which would leave the other rules little to do."""
        runner, live = self.sched.runner, self.live()
        self.failed_steps += 1
        reading = any(r.transfer is not None and r.transfer.in_flight() for r in self.sched.requests.values())
        HITS["failing step, a read in flight" if reading else "failing step"] += 1
        HITS["failing step, a read running"] += bool(self.open_reads())

        def broken(*args, **kwargs):
            raise RuntimeError(INJECTED)

        runner.forward_sample = broken
        try:
            self.on_loop(self.sched.step_sync)
        except RuntimeError as e:
            if str(e) != INJECTED:
                raise
            for rid in live:
                self.allowed[rid].add(500)
        finally:
            del runner.forward_sample

    @precondition(lambda self: self.sched.requests)
    @rule(data=st.data())
    def poisoned_row(self, data) -> None:
        """A served step (``_step``, the event loop's) whose forward raises whenever one request is in the batch, as
        a bad row would: the batch is re-run in halves, that request fails with 500 and every other goes on."""
        rid = data.draw(st.sampled_from(self.live()))
        forward = self.sched._forward
        hit = []

        def poisoned(batch):
            if any(r.rid == rid for r in batch.reqs):
                hit.append(len(batch.reqs))
                raise RuntimeError(INJECTED)
            return forward(batch)

        self.allowed[rid].add(500)
        self.sched._forward = poisoned
        try:
            self.loop.run_until_complete(self.sched._step())
        finally:
            del self.sched._forward
            for _ in range(3):
                self.loop.run_until_complete(asyncio.sleep(0))
            self.collect()
        if hit:
            HITS["poisoned row, alone" if hit == [1] else "poisoned row, in a batch"] += 1
            assert rid not in self.sched.requests, f"{rid}'s step raised and it is still live"

    @precondition(lambda self: self.open_reads() and self.failed_steps < 2)
    @rule()
    def failing_step_while_a_read_runs(self) -> None:
        """A failing step while a KV read is running (started, not landed): its request fails, and its pages may
        be freed only once the read has unwound. Reads rarely run at a random failing step, hence this rule."""
        self.failing_step()

    # ---- invariants -------------------------------------------------------------------------------------------

    def owned_pages(self, req: Req) -> list[int]:
        """L1 pages ``req`` owns outside the tree: its delta before the load-back landed, then its own pages."""
        if req.handle is None:
            assert not req.seq.pages, f"{req.rid} ({req.state.name}) has pages but no cache handle"
            return []
        return req.handle.delta_pages.tolist() + req.seq.pages[req.prefix_pages:]

    @invariant()
    @marks_failure
    def pages_are_accounted_for(self) -> None:
        if self.sched is None:
            return
        cache = self.sched.cache
        owned = [p for req in self.sched.requests.values() for p in self.owned_pages(req)]
        assert len(set(owned)) == len(owned), f"an L1 page is owned twice by requests: {sorted(owned)}"
        check_invariants(cache, request_pages=len(owned))
        tree = {int(p) for n in cache.tree.nodes() if n.on_device for p in n.device_indices}
        assert not tree & set(owned), f"L1 pages owned by a request and by the tree: {sorted(tree & set(owned))}"
        free = [p for p in owned if not cache.device_alloc.in_use(p)]
        assert not free, f"L1 pages a request owns are free: {free}"
        assert not self.peer.stray_writes, f"KV reads wrote into pages their request no longer owned: " \
                                           f"{self.peer.stray_writes}"

    @invariant()
    @marks_failure
    def unanswered_peers_hold_nothing(self) -> None:
        if self.sched is None:
            return
        for rid in self.peers_in("pending"):
            req = self.sched.requests[rid]
            assert req.state in (S.QUEUED, S.MATCHING) and req.handle is None and not req.seq.pages, (
                f"{rid} waits for its peer but is {req.state.name} holding {req.handle and req.handle.delta_pages}")

    @invariant()
    @marks_failure
    def every_live_request_is_in_its_queue(self) -> None:
        if self.sched is None:
            return
        q = self.sched.queues
        queued = [*q.prealloc, *q.loading, *q.extend, *q.running, *q.retracted, *q.held.values()]
        assert sorted(r.rid for r in queued) == self.live(), "queues and live requests disagree"
        for req in queued:
            home = q._by_state[req.state]
            members = home.values() if isinstance(home, dict) else home
            assert sum(r is req for r in queued) == 1 and any(r is req for r in members), (
                f"{req.rid} ({req.state.name}) is not once in its state's queue")
        rows = self.sched.runner.rows
        for rid in list(rows._rows):
            req = self.sched.requests.get(rid)
            assert req is not None and req.state is S.RUNNING, (
                f"{rid} holds a page-table row while {req.state.name if req else 'ended'}")

    @invariant()
    @marks_failure
    def ended_requests_hold_nothing_and_were_answered(self) -> None:
        if self.sched is None:
            return
        for rid, req in self.reqs.items():
            tokens = sum(len(e.token_ids) for e in self.events[rid])
            assert tokens <= req.inp.params.max_new_tokens, f"{rid} got {tokens} tokens"
            if rid in self.sched.requests:
                assert rid not in self.closed, f"{rid} is live but its stream is closed"
                continue
            assert rid in self.closed, f"{rid} ended ({req.state.name}) but its client was never answered"
            assert req.state in (S.FINISHED, S.ABORTED), f"{rid} left the scheduler {req.state.name}"
            assert req.handle is None and not req.seq.pages, f"{rid} ended holding pages {req.seq.pages}"
            assert rid not in self.sched.runner.rows, f"{rid} ended holding a page-table row"
            last = self.events[rid][-1] if self.events[rid] else None
            if rid in self.peer.peers and rid not in self.peer.received:
                assert rid in self.peer.forgotten, f"{rid} ended before admission but its handshake was not stopped"
            self.check_scored(rid, req)
            if req.grammar is not None:
                self.check_constrained(rid, req)
            if req.state is S.FINISHED:
                assert last is not None and last.error is None and last.finish_reason is not None, rid
                if req.grammar is None:
                    assert tokens == req.inp.params.max_new_tokens, f"{rid} finished after {tokens} tokens"
            else:
                assert last is not None and last.error is not None, f"{rid} aborted without an error event"
                assert last.error.status in self.allowed[rid], (
                    f"{rid} failed with {last.error.status} ({last.error}); allowed: {self.allowed[rid]}")

    def check_scored(self, rid: str, req: Req) -> None:
        """An ended request that scored its prompt got its logprobs in one event (none if it ended before its
        extend), every one equal to a cache-free forward's; a request that did not score got none."""
        scored = [e.prompt_logprobs for e in self.events[rid] if e.prompt_logprobs is not None]
        start = req.inp.logprob_start
        if start is None or not scored:
            assert not scored, f"{rid} got prompt logprobs it did not ask for"
            assert start is None or req.state is not S.FINISHED, f"{rid} finished without its prompt logprobs"
            return
        assert len(scored) == 1, f"{rid} got its prompt logprobs {len(scored)} times"
        ids, got = req.seq.prompt_ids, scored[0]
        assert got.start == start and len(got.logprobs) == len(ids) - start, (
            f"{rid} scored {len(got.logprobs)} prompt logprobs from {got.start}, asked from {start} of {len(ids)}")
        ref = reference(self.model, tuple(ids)).logprobs
        for pos, lp in enumerate(got.logprobs, start):
            if pos == 0:
                assert lp is None, f"{rid} got a logprob for its first prompt token"
            else:
                assert abs(lp - ref[pos - 1, ids[pos]].item()) < SCORE_TOL, (
                    f"{rid}'s prompt logprob at {pos} is {lp}, a cache-free forward gives {ref[pos - 1, ids[pos]]}")
        HITS["scored prompt after a cache hit" if req.cached_tokens.get("device", 0) else "scored prompt"] += 1

    def check_constrained(self, rid: str, req: Req) -> None:
        """A constrained output reads as a prefix of a sentence of the grammar; it stops at the sentence's end, at
        its length, or at a dead end, which only prefill's first token can reach (decode masks its own picks)."""
        ids = [t for e in self.events[rid] for t in e.token_ids]
        reason = (self.events[rid][-1].finish_reason or {}) if self.events[rid] else {}
        if reason.get("type") == "abort":
            assert rid in self.peer.peers and len(ids) == 1 and ids[0] % 3 not in (1, 2), (
                f"{rid} hit a dead end at {ids} ({reason}): only a refused first token from prefill may")
            HITS["grammar dead end"] += 1
            return
        text = "".join(LETTERS[t % 3] for t in ids if t != STOP)
        assert GRAMMAR_PREFIX.fullmatch(text), f"{rid}'s output {text!r} ({ids}) breaks {GRAMMAR}"
        assert STOP not in ids[:-1], f"{rid} went on after its stop token: {ids}"
        if reason.get("type") == "stop":
            assert re.fullmatch(GRAMMAR, text) and ids[-1] == STOP, f"{rid} stopped at {text!r} ({ids})"
            HITS["grammar completed"] += 1

    def check_all(self) -> None:
        self.pages_are_accounted_for()
        self.unanswered_peers_hold_nothing()
        self.every_live_request_is_in_its_queue()
        self.ended_requests_hold_nothing_and_were_answered()

    # ---- teardown ---------------------------------------------------------------------------------------------

    def teardown(self) -> None:
        try:
            if self.sched is not None and not self.failed:
                self.drive_to_completion()
        finally:
            if self.sched is not None:
                self.sched._forward_thread.shutdown(wait=False)
            self.loop.run_until_complete(cancel_all(asyncio.all_tasks(self.loop)))
            self.loop.close()

    def drive_to_completion(self) -> None:
        """Every peer answers, every read lands (some with a first token a grammar refuses), copies run: all requests
        end, and every page comes back."""
        for _ in range(400):
            if not self.sched.requests:
                break
            for rid in self.peers_in("pending"):
                self.peer.peers[rid] = "answered"
            for rid in self.open_reads():  # token 3 is one a constrained request's grammar refuses
                self.peer.reads[rid].set_result((int(rid[1:]) % 4 + 1, -0.5))
            self.step(steps=1, copies=True)
            self.check_all()
        assert not self.sched.requests, f"requests never ended: {self.live()}"
        self.ended_requests_hold_nothing_and_were_answered()
        assert self.closed == set(self.reqs), "a request was lost"
        if self.engine is not None:
            self.engine.run()
        settle(self.sched)
        self.sched.cache.flush()
        alloc = self.sched.cache.device_alloc
        assert alloc.num_free == alloc.total, f"after a flush {alloc.total - alloc.num_free} L1 pages are in use"
        if self.sched.cache.host_alloc is not None:
            assert self.sched.cache.host_alloc.num_used == 0, "after a flush L2 pages are in use"


FAST = settings(max_examples=90, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def loaded(tiny_models):
    """The model, loaded once; one torch thread, since on a shared CPU the tiny forwards run ten times faster
    without intra-op threads waiting for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    SchedulerMachine.model = load_model(tiny_models["llama"], dtype=torch.float64, tokenizer=False)
    yield
    SchedulerMachine.model = None
    torch.set_num_threads(threads)


def test_scheduler_machine(loaded):
    """The default run, on a fixed seed so that it can also check that it reached every branch worth reaching: a
    change that makes one rare shows here rather than as a machine that silently stopped testing it. The slow
    run below explores."""
    HITS.clear()
    run_state_machine_as_test(SchedulerMachine, settings=settings(FAST, derandomize=True, database=None))
    missing = [name for name in BRANCHES if not HITS[name]]
    assert not missing, f"never reached: {missing}; reached: {dict(HITS)}"


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_scheduler_machine_long(loaded):
    run_state_machine_as_test(SchedulerMachine, settings=settings(FAST, max_examples=1000, stateful_step_count=60))


# ---- the machine catches planted bugs ---------------------------------------------------------------------------


def _admit_unanswered(self, computing):
    queue = self.queues.retracted or self.queues.prealloc
    return queue[0] if queue else None


def _finish_keeping_pages(self, req):
    self.queues.move(req, S.FINISHED)
    self._close(req, "ok")


def _close_keeping_row(self, req, outcome):
    self.requests.pop(req.rid, None)
    req.stream.queue.put_nowait(None)


def _retract_keeping_row(self, req):
    self.queues.move(req, S.RETRACTED)
    req.release(self.cache, self.page_size, backup=True)


def _fail_silently(self, req, error):
    fail(self, req, error)
    events = req.stream.queue._queue  # drop the error event the client would have got
    for event in [e for e in events if e is not None and e.error is not None]:
        events.remove(event)


def _fail_without_waiting(self, req, error):
    if req.transfer is not None and req.transfer.task is not None:
        req.transfer.task.cancel()
        req.transfer = None  # forgets that the read may still be writing into the request's pages
    fail(self, req, error)


def _grow_into_a_neighbours_page(self, req):
    others = [r.seq.pages[-1] for r in self.queues.running if r is not req and len(r.seq.pages) > r.prefix_pages]
    if others and len(req.seq.pages) < req.seq.pages_needed(self.page_size):
        req.seq.pages.append(others[0])
    return grow(self, req)


def _queued_twice(self, req):
    add(self, req)
    self.prealloc.append(req)


def _once_passed_over_never_admitted(self, req, computing):
    if req.rid in PASSED_OVER:
        return True
    if WAITS_FOR_SHARER(self, req, computing):
        PASSED_OVER.add(req.rid)
        return True
    return False


def _never_in_flight(self):
    return False


def _release_nothing(self, handle):
    pass


def _forget_nothing(self, req):
    pass


def _one_window_for_all_peers(queue):
    return itertools.islice(queue, PEER_LOOKAHEAD)


def _scored_prompts_match_the_whole_prompt(req):
    return None


def _no_token_mask(grammars, vocab_size):
    return None


def _dead_ends_go_on(self, seq):
    self.matcher.accept_token(seq.output_ids[-1])


fail, add, grow = Scheduler._fail, Queues.add, Scheduler._grow
WAITS_FOR_SHARER, PASSED_OVER = Admission._waits_for_sharer, set()
PLANTED = {
    "admits a request whose peer has not answered": (Admission, "_first_answered", _admit_unanswered,
                                                      "waits for its peer"),
    "a prompt passed over for a sharer never comes back": (Admission, "_waits_for_sharer",
                                                           _once_passed_over_never_admitted, "requests never ended"),
    "a finished request keeps its pages": (Scheduler, "_finish", _finish_keeping_pages,
                                           "ended holding pages|allocated != .* in tree"),
    "an ended request keeps its page-table row": (Scheduler, "_close", _close_keeping_row,
                                                  "holds a page-table row while ended|ended holding a page-table row"),
    "a retracted request keeps its page-table row": (Scheduler, "_retract", _retract_keeping_row,
                                                     "holds a page-table row while RETRACTED"),
    "a failed request gets no error event": (Scheduler, "_fail", _fail_silently, "without an error event"),
    "a read in flight is taken for done": (KVTransfer, "in_flight", _never_in_flight,
                                           "failed with 500|Exception is not set"),
    "a failed request's read is not waited for": (Scheduler, "_fail", _fail_without_waiting, "no longer owned"),
    "a page is handed to two requests": (Scheduler, "_grow", _grow_into_a_neighbours_page,
                                         "owned twice|allocated != .* in tree|pages allocated but the tree holds"),
    "a request's prefix lock is never dropped": (HierarchicalCache, "release", _release_nothing,
                                                 "lock refs left|requests never ended|allocated != .* in tree"),
    "a request leaving the queue keeps its handshake": (Admission, "forget", _forget_nothing,
                                                        "its handshake was not stopped"),
    "a new request is queued twice": (Queues, "add", _queued_twice, "queues and live requests disagree"),
    "one look-ahead window for all peers": (Admission, "_peer_windows", staticmethod(_one_window_for_all_peers),
                                            "was not started"),
    "a scored prompt takes cached KV past where it scores": (admission, "computed_before",
                                                             _scored_prompts_match_the_whole_prompt,
                                                             "prompt logprob|scored"),
    "the step's token mask is never applied": (scheduler_module, "fill_mask", _no_token_mask,
                                               "breaks|dead end"),
    "a token the grammar refuses does not end the request": (RowGrammar, "advance", _dead_ends_go_on,
                                                              "breaks|went on|GrammarMatcher has terminated"),
}


@pytest.mark.slow  # ~60 s for all of them: they prove the machine's checks can fail, the run above uses them
@pytest.mark.parametrize("bug", list(PLANTED))
def test_the_machine_catches_a_planted_bug(loaded, monkeypatch, bug):
    """Each check can fail: with one bug planted (a monkeypatched scheduler method), the machine finds a failing
    program, and the failure names the check that caught it (or the scheduler's own crash)."""
    owner, name, planted, message = PLANTED[bug]
    monkeypatch.setattr(owner, name, planted)
    with pytest.raises(Exception, match=message):
        run_state_machine_as_test(SchedulerMachine, settings=settings(
            FAST, max_examples=200, phases=[Phase.generate], database=None, derandomize=True))
