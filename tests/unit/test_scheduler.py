"""The scheduler on a tiny random-weight model: batching, retraction, aborts and page accounting."""
from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from concurrent.futures import Future

import pytest
import numpy as np
import torch

from decode_worker.cache.copy_engine import CopyEngine
from decode_worker.cache.hicache import HierarchicalCache
from decode_worker.cache.pool import KVPool
from decode_worker.core.lifecycle import ReqState
from decode_worker.core.request import GenerateInput, RequestError
from decode_worker.core.sampling import SamplingParams
from decode_worker.engine.llm import LLM
from decode_worker.metrics import Metrics
from decode_worker.model.loader import load_model
from decode_worker.model.runner import ModelRunner
from decode_worker.scheduler.batch import Batch, BatchKind
from decode_worker.scheduler.req import Req
from decode_worker.scheduler.roles import Colocated, PeerPrompt, PendingReceive
from decode_worker.scheduler.scheduler import Scheduler
from tests.cache_invariants import check_invariants

GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)


class StepEngine(CopyEngine):
    """Copies run only when the test calls ``run`` (``step_copies``: at the start of each scheduler step), in the
    real engine's order, so a copy queued during a step is still in flight for the rest of that step, as a slow copy
    would be, however busy the machine is."""

    def _submit(self, job) -> Future:
        self.pending.push(job)
        return job.future

    def run(self) -> None:
        while (job := self.pending.pop()) is not None:
            self.run_job(job)
            job.future.result()  # a copy that raised fails the test here


def step_copies(scheduler: Scheduler) -> StepEngine:
    """Run ``scheduler``'s ``StepEngine`` copies at the start of each of its steps."""
    engine, step = scheduler.cache.engine, scheduler._step

    async def stepping() -> bool:
        engine.run()
        return await step()

    scheduler._step = stepping
    return engine


KVSource = Callable[[PendingReceive, np.ndarray], Awaitable[tuple[int, float]]]


class PeerKV(Colocated):
    """A decode role's prompt source around a test's ``kv_source(pending, pages)``: fresh prompts arrive from it."""

    def __init__(self, kv_source: KVSource):
        self.kv_source = kv_source

    def receives(self, prompt: PeerPrompt) -> bool:
        return True

    def receive(self, pending: PendingReceive):
        return self.kv_source(pending, pending.pages)


def make_scheduler(path, max_total_tokens: int, host_ratio: float = 0.0, write_policy: str = "write_through", *,
                   engine: type[CopyEngine] = CopyEngine, kv_source: KVSource | None = None, max_running: int = 32,
                   peer: type[PeerKV] = PeerKV) -> Scheduler:
    """A float64 scheduler with 4-token pages; ``engine`` lets a test hold copies, ``kv_source`` makes it PD decode
    (through ``peer``)."""
    loaded = load_model(path, dtype=torch.float64, tokenizer=False)
    runner = ModelRunner(loaded, max_total_tokens, page_size=4)
    host = KVPool(runner.layout, int((runner.num_pages - 1) * host_ratio)) if host_ratio else None
    copies = engine(runner.pool.buffer, host.buffer) if host is not None else None
    cache = HierarchicalCache(runner.pool, host, write_policy=write_policy, engine=copies)
    roles = {"source": peer(kv_source)} if kv_source is not None else {}
    return Scheduler(runner, cache, Metrics(), eos_token_ids=(), decode_text=lambda ids: "",
                     max_running=max_running, max_prefill_tokens=512, load_back_timeout_s=10, **roles)


async def run_all(scheduler: Scheduler, prompts, params=GREEDY, abort_after: dict | None = None, first_alone=False,
                  first_ahead=False):
    """Submit all prompts at once and collect their tokens. ``first_alone`` runs the first one to completion before
    the rest; ``first_ahead`` submits the rest as soon as the first streamed a token, while it is still generating."""
    scheduler.start()
    first_token = asyncio.Event()
    try:
        async def drain(i, stream):
            ids = []
            async for event in stream:
                if event.error is not None:
                    return event.error
                ids += event.token_ids
                first_token.set()
                if abort_after and abort_after.get(i) == len(ids):
                    scheduler.abort(stream.rid)
            return ids

        def submit(i):
            return scheduler.submit(GenerateInput(f"r{i}", prompts[i], params))

        if first_ahead:
            head = asyncio.ensure_future(drain(0, submit(0)))
            await first_token.wait()
            rest = await asyncio.gather(*(drain(i, submit(i)) for i in range(1, len(prompts))))
            return [await head, *rest]
        head = [await drain(0, submit(0))] if first_alone else []
        rest = range(len(head), len(prompts))
        return head + list(await asyncio.gather(*(drain(i, submit(i)) for i in rest)))
    finally:
        await scheduler.stop(grace_s=0)


def settle(scheduler: Scheduler) -> None:
    """With no request live and no copy in flight, every page and lock the requests took is back."""
    cache = scheduler.cache
    cache.drain()
    check_invariants(cache, request_pages=0)
    locked = [n for n in cache.tree.nodes() if n.lock_ref]
    assert not locked, f"lock refs left: {locked}"
    stats = cache.stats()
    assert stats.device.locked == 0 and stats.device.used == 0
    for tier, pages in stats.tiers().items():
        assert pages.free + pages.used + pages.evictable + pages.locked == pages.total, (tier, pages)
    rows = scheduler.runner.rows
    assert len(rows) == 0 and not rows.table.any(), "page-table rows left taken or showing pages"


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(5)
    shared = [rng.randrange(320) for _ in range(24)]
    return [shared + [rng.randrange(320) for _ in range(rng.randrange(1, 30))] for _ in range(10)]


@pytest.fixture(scope="module")
def offline(tiny_models) -> LLM:
    """The cache-free reference engine (float64, so greedy picks do not flip on rounding)."""
    return LLM(str(tiny_models["llama"]), max_total_tokens=4096, page_size=4, dtype=torch.float64, load_tokenizer=False,
               prefix_cache=False)


@pytest.fixture(scope="module")
def reference(offline, prompts):
    return [o.output_ids for o in offline.generate(prompts, GREEDY)]


def test_continuous_batching_matches_offline_generation(tiny_models, prompts, reference):
    scheduler = make_scheduler(tiny_models["llama"], 4096)
    assert asyncio.run(run_all(scheduler, prompts, first_alone=True)) == reference
    # Nine requests reuse the first one's 24-token (6-page) prefix.
    assert scheduler.metrics.cached_tokens.labels("device")._value.get() >= 9 * 24
    settle(scheduler)


def test_requests_arriving_while_a_prefix_is_generated_hit_it(tiny_models, prompts, reference):
    """The first request's prompt pages are in the tree as soon as its prefill ran, not when it finishes: the five
    that arrive while it still generates hit its 24-token (6-page) prefix."""
    scheduler = make_scheduler(tiny_models["llama"], 4096)
    assert asyncio.run(run_all(scheduler, prompts[:6], first_ahead=True)) == reference[:6]
    assert scheduler.metrics.cached_tokens.labels("device")._value.get() >= 5 * 24
    settle(scheduler)


def test_requests_sharing_a_prefix_at_once_keep_one_copy(tiny_models, prompts, reference):
    """Six requests admitted together all miss, but right after their prefill only one copy of the prefix is on L1."""
    scheduler = make_scheduler(tiny_models["llama"], 4096)
    postprocess, used = scheduler.postprocess, []

    def measured(batch: Batch, logits: torch.Tensor) -> None:
        postprocess(batch, logits)
        if batch.kind is BatchKind.EXTEND:
            used.append(scheduler.cache.device_alloc.num_used)

    scheduler.postprocess = measured
    assert asyncio.run(run_all(scheduler, prompts[:6])) == reference[:6]
    shared = 24 // scheduler.page_size
    assert used[0] == shared + sum(-(-len(p) // scheduler.page_size) - shared for p in prompts[:6])
    settle(scheduler)


def extends_of(scheduler: Scheduler) -> list[tuple[int, int]]:
    """Records each extend batch as it is applied: (requests, tokens computed)."""
    postprocess, seen = scheduler.postprocess, []

    def recorded(batch: Batch, result) -> None:
        if batch.kind is BatchKind.EXTEND:
            seen.append((len(batch.reqs), batch.forward.input_ids.numel()))
        postprocess(batch, result)

    scheduler.postprocess = recorded
    return seen


@pytest.mark.parametrize("share_min_tokens,deferred", [(32, True), (48, False)], ids=["shares", "below-threshold"])
def test_a_burst_sharing_a_prompt_head_computes_it_once(tiny_models, share_min_tokens, deferred):
    """Five requests arrive at once with a 40-token (10-page) head in common: the first is computed alone, the other
    four wait for its extend and then compute only their tails, reading the head from the cache; their answers are
    the cache-free ones. Where the head is shorter than the threshold, all five are computed together."""
    rng = random.Random(8)
    head = [rng.randrange(320) for _ in range(40)]
    burst = [head + [rng.randrange(320) for _ in range(n)] for n in (3, 6, 1, 9, 4)]
    offline = LLM(str(tiny_models["llama"]), max_total_tokens=4096, page_size=4, dtype=torch.float64,
                  load_tokenizer=False, prefix_cache=False)
    expected = [o.output_ids for o in offline.generate(burst, GREEDY)]
    scheduler = make_scheduler(tiny_models["llama"], 4096)
    scheduler.admission.share_min_tokens = share_min_tokens
    extends = extends_of(scheduler)
    assert asyncio.run(run_all(scheduler, burst)) == expected
    cached = scheduler.metrics.cached_tokens.labels("device")._value.get()
    if deferred:
        assert extends == [(1, len(burst[0])), (4, sum(len(p) - len(head) for p in burst[1:]))]
        assert cached == 4 * len(head)
    else:
        assert extends == [(5, sum(map(len, burst)))] and cached == 0
    settle(scheduler)


async def answer(scheduler: Scheduler, rid: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    """One greedy request's tokens and logprobs; raises the error it failed with."""
    ids, logprobs = [], []
    async for event in scheduler.submit(GenerateInput(rid, prompt, GREEDY)):
        if event.error is not None:
            raise event.error
        ids += event.token_ids
        logprobs += event.logprobs
    return ids, logprobs


@pytest.mark.parametrize("prompt_len", [19, 20, 21])
def test_conversation_continuation_matches_a_cache_free_run(tiny_models, offline, prompt_len):
    """A follow-up turn (earlier prompt + its answer + more text) reuses the earlier request's pages. With 12
    output tokens the earlier turn ends one token before, exactly on, or one token after a page boundary; on
    the boundary the last page holds the last sampled token, whose KV was never computed: caching that page
    would hand the follow-up a garbage slot. Logprobs are compared too (float64: a cached prefix changes them
    by rounding only), since one bad slot among thirty does not always flip a greedy pick."""
    rng = random.Random(prompt_len)
    earlier = [rng.randrange(320) for _ in range(prompt_len)]
    more = [rng.randrange(320) for _ in range(5)]
    scheduler, fresh = make_scheduler(tiny_models["llama"], 4096), make_scheduler(tiny_models["llama"], 4096)

    async def converse() -> tuple[list[int], tuple, tuple]:
        scheduler.start()
        fresh.start()
        try:
            first, _ = await answer(scheduler, "turn-1", earlier)
            prompt = earlier + first + more
            return first, await answer(scheduler, "turn-2", prompt), await answer(fresh, "alone", prompt)
        finally:
            await scheduler.stop(grace_s=0)
            await fresh.stop(grace_s=0)

    first, (follow_up, logprobs), (_, fresh_logprobs) = asyncio.run(converse())
    assert first == offline.generate([earlier], GREEDY)[0].output_ids
    assert follow_up == offline.generate([earlier + first + more], GREEDY)[0].output_ids
    assert logprobs == pytest.approx(fresh_logprobs, abs=1e-6)
    computed = prompt_len + len(first) - 1  # the last answer token was sampled, never run through the model
    assert scheduler.metrics.cached_tokens.labels("device")._value.get() >= computed // 4 * 4  # the pages were reused
    settle(scheduler)


def watch_resumptions(scheduler: Scheduler) -> list[tuple[int, int, int]]:
    """Per resumption of a retracted request: (tokens in full pages computed when it was retracted, prefix tokens
    it found cached on resuming, of which restored from L2). Filled in as the scheduler runs."""
    retracted: dict[str, list[int]] = {}
    seen: list[tuple[int, int, int]] = []
    retract, try_alloc, ps = scheduler._retract, scheduler.admission.try_alloc, scheduler.page_size

    def watched_retract(req: Req) -> None:
        retracted.setdefault(req.rid, []).append(req.seq.num_computed // ps * ps)
        retract(req)
        assert req.rid not in scheduler.runner.rows, "a retracted request kept its page-table row"

    def watched_try_alloc(req: Req) -> bool:
        ok = try_alloc(req)
        if ok and retracted.get(req.rid):
            seen.append((retracted[req.rid].pop(0), req.prefix_pages * ps, req.handle.restored_tokens))
        return ok

    scheduler._retract, scheduler.admission.try_alloc = watched_retract, watched_try_alloc
    return seen


@pytest.mark.parametrize("host_ratio,policy", [(0.0, "write_through"), (3.0, "write_through"), (3.0, "write_back")])
def test_retraction_resumes_with_identical_output(tiny_models, prompts, reference, host_ratio, policy):
    """An L1 too small for all ten at once retracts (to L2 when there is one) and resumes them; under
    write_back, evicted pages drain to L2 while requests wait for them. With L2 a resumed request gets back
    the KV it had computed (restored from L2, not recomputed). Copies run at each step's start, so whether a
    resumed request's pages had left L1 does not depend on how busy the machine is."""
    scheduler = make_scheduler(tiny_models["llama"], 160, host_ratio, policy, engine=StepEngine)
    if host_ratio:
        step_copies(scheduler)
    resumptions = watch_resumptions(scheduler)
    assert asyncio.run(run_all(scheduler, prompts)) == reference
    assert scheduler.metrics.retractions._value.get() > 0
    assert resumptions, "no retracted request resumed"
    if host_ratio:
        recomputed = [(had, found) for had, found, _ in resumptions if found < had]
        assert not recomputed, f"resumed requests recomputed KV they had (tokens had, found): {recomputed}"
        restored = sum(r for _, _, r in resumptions)
        assert restored > 0 and scheduler.cache.counters.loaded_back >= restored
        timed = scheduler.metrics.registry.get_sample_value("decode_worker_load_back_seconds_count")
        assert timed >= sum(1 for _, _, r in resumptions if r), "a restore from L2 went untimed"
    for kind in ("extend", "decode"):
        assert scheduler.metrics.registry.get_sample_value("decode_worker_forward_seconds_count", {"kind": kind}) > 0
    settle(scheduler)


def test_abort_at_every_stage_frees_everything(tiny_models, prompts):
    scheduler = make_scheduler(tiny_models["llama"], 160, 3.0)
    results = asyncio.run(run_all(scheduler, prompts, abort_after={0: 1, 3: 5, 7: 11}))
    for i, r in enumerate(results):
        if i in (0, 3, 7):
            assert isinstance(r, RequestError) and r.status == 499
        else:
            assert len(r) == 12
    settle(scheduler)


def test_never_fitting_request_is_rejected_at_once(tiny_models):
    scheduler = make_scheduler(tiny_models["llama"], 64)
    with pytest.raises(RequestError, match="KV pool"):
        scheduler.submit(GenerateInput("big", [1] * 40, SamplingParams(max_new_tokens=40)))
    assert not scheduler.requests


class R0NotAnswered(PeerKV):
    """Prefill has answered every request but r0 (its peer stalls)."""

    def answered(self, prompt: PeerPrompt) -> bool:
        return prompt.rid != "r0"


def test_a_request_whose_peer_has_not_answered_holds_no_pages_and_no_one_up(tiny_models, prompts):
    """r0's prefill never answers; r1's has. r1 is admitted and served while r0 waits in the queue without L1
    pages, rather than r0 taking pages (and, on a small L1, the queue's turn) until its handshake times out."""
    async def kv_source(pending: PendingReceive, pages) -> tuple[int, float]:
        assert pending.prompt.rid != "r0", "r0 was admitted before its peer answered"
        return 7, 0.0

    async def scenario():
        scheduler = make_scheduler(tiny_models["llama"], 4096, kv_source=kv_source, peer=R0NotAnswered)
        scheduler.start()
        try:
            head = scheduler.submit(GenerateInput("r0", prompts[0], GREEDY))
            events = await asyncio.wait_for(collect(scheduler.submit(GenerateInput("r1", prompts[1], GREEDY))), 30)
            r0 = scheduler.requests["r0"]
            assert r0.state is ReqState.QUEUED and r0.handle is None
            scheduler.abort("r0")
            await asyncio.wait_for(collect(head), 30)
            return events, scheduler
        finally:
            await scheduler.stop(grace_s=0)

    events, scheduler = asyncio.run(scenario())
    assert not any(e.error for e in events) and sum(len(e.token_ids) for e in events) == GREEDY.max_new_tokens
    settle(scheduler)


async def collect(stream) -> list:
    return [event async for event in stream]
