"""The scheduler on a tiny random-weight model: batching, retraction, aborts and page accounting."""
from __future__ import annotations

import asyncio
import random

import pytest
import torch

from decode_worker.cache.hicache import HierarchicalCache
from decode_worker.cache.pool import KVPool
from decode_worker.engine.llm import LLM
from decode_worker.engine.request import GenerateInput, RequestError
from decode_worker.engine.sampling import SamplingParams
from decode_worker.engine.scheduler import Scheduler
from decode_worker.metrics import Metrics
from decode_worker.model.loader import load_model
from decode_worker.model.runner import ModelRunner

GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)


def make_scheduler(path, max_total_tokens: int, host_ratio: float = 0.0, write_policy: str = "write_through") -> Scheduler:
    loaded = load_model(path, dtype=torch.float64, tokenizer=False)
    runner = ModelRunner(loaded, max_total_tokens, page_size=4)
    host = KVPool(runner.layout, int((runner.num_pages - 1) * host_ratio)) if host_ratio else None
    cache = HierarchicalCache(runner.pool, host, write_policy=write_policy)
    return Scheduler(runner, cache, Metrics(), eos_token_ids=(), decode_text=lambda ids: "", radix=True,
                     max_running=32, max_prefill_tokens=512, load_back_timeout_s=10)


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
    cache = scheduler.cache
    cache.drain()
    cache.check_invariants(request_pages=0)
    stats = cache.stats()
    assert stats["device"]["locked"] == 0 and stats["device"]["used"] == 0


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(5)
    shared = [rng.randrange(320) for _ in range(24)]
    return [shared + [rng.randrange(320) for _ in range(rng.randrange(1, 30))] for _ in range(10)]


@pytest.fixture(scope="module")
def reference(tiny_models, prompts):
    llm = LLM(str(tiny_models["llama"]), max_total_tokens=4096, page_size=4, dtype=torch.float64, load_tokenizer=False)
    return [o.output_ids for o in llm.generate(prompts, GREEDY)]


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
    extend_step, used = scheduler._extend_step, []

    async def measured():
        await extend_step()
        used.append(scheduler.cache.device_alloc.num_used)

    scheduler._extend_step = measured
    assert asyncio.run(run_all(scheduler, prompts[:6])) == reference[:6]
    shared = 24 // scheduler.page_size
    assert used[0] == shared + sum(-(-len(p) // scheduler.page_size) - shared for p in prompts[:6])
    settle(scheduler)


@pytest.mark.parametrize("host_ratio,policy", [(0.0, "write_through"), (3.0, "write_through"), (3.0, "write_back")])
def test_retraction_resumes_with_identical_output(tiny_models, prompts, reference, host_ratio, policy):
    """An L1 too small for all ten at once retracts (to L2 when there is one) and resumes them; under
    write_back, evicted pages drain to L2 while requests wait for them."""
    scheduler = make_scheduler(tiny_models["llama"], 160, host_ratio, policy)
    assert asyncio.run(run_all(scheduler, prompts)) == reference
    assert scheduler.metrics.retractions._value.get() > 0
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
