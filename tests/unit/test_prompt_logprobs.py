"""Prompt logprobs scored in the extend that computes the prompt: equal to a full forward's log-softmax, whatever
the cache held, the batch's other requests, or where scoring starts; ``max_new_tokens`` 0 scores and stops."""
from __future__ import annotations

import random

import pytest
import torch

from decode_worker.cache.pool import PageAllocator
from decode_worker.core.request import GenerateInput, TokenEvent
from decode_worker.core.sampling import SamplingParams
from decode_worker.engine.llm import LLM
from decode_worker.scheduler import scoring

TOL = 1e-5  # logits come back in float32; a wrong row is off by far more


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models["llama"]), max_total_tokens=4096, page_size=4, dtype=torch.float64,
               load_tokenizer=False)


def reference(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Log-softmax of every position's logits, from one cache-free forward."""
    runner = llm.runner
    alloc = PageAllocator(runner.num_pages, reserved=1)
    pages = alloc.alloc(-(-len(ids) // runner.page_size)).tolist()
    return torch.log_softmax(runner.forward(runner.build_batch([ids], [0], [pages], all_logits=True)).double(), -1)


def run(llm: LLM, inputs: list[GenerateInput]) -> list[list[TokenEvent]]:
    streams = [llm.scheduler.submit(inp) for inp in inputs]
    while not llm.scheduler.idle():
        llm.scheduler.step_sync()
    out = []
    for stream in streams:
        events = []
        while (event := stream.queue.get_nowait()) is not None:
            assert event.error is None, event.error
            events.append(event)
        out.append(events)
    return out


def prompt(seed: int, n: int) -> list[int]:
    return [random.Random(seed).randrange(320) for _ in range(n)]


def check(llm: LLM, ids: list[int], events: list[TokenEvent], start: int, k: int) -> None:
    ref = reference(llm, ids)
    scored = events[0].prompt_logprobs
    assert scored is not None and scored.start == start
    assert len(scored.logprobs) == len(ids) - start == len(scored.top)
    for j, (lp, top) in enumerate(zip(scored.logprobs, scored.top)):
        pos = start + j
        if pos == 0:
            assert lp is None and top == []
            continue
        assert abs(lp - ref[pos - 1, ids[pos]].item()) < TOL
        best = ref[pos - 1].topk(k)
        assert [t for t, _ in top] == best.indices.tolist()
        assert max(abs(a - b) for (_, a), b in zip(top, best.values.tolist())) < TOL if k else top == []
    assert all(e.prompt_logprobs is None for e in events[1:])


@pytest.mark.parametrize("start", [0, 1, 13, 38])
def test_prompt_logprobs_equal_a_full_forward_whatever_the_cache_holds(llm, start):
    """The same prompt runs first without scoring (its pages go into the cache), then scored from ``start``: the
    second must still compute the positions it scores instead of taking their KV from the cache."""
    ids = prompt(start, 39)
    greedy = SamplingParams(max_new_tokens=3, temperature=0, top_logprobs=4)
    run(llm, [GenerateInput("warm", ids, SamplingParams(max_new_tokens=1, temperature=0))])
    events = run(llm, [GenerateInput(f"scored-{start}", ids, greedy, True, logprob_start=start)])[0]
    check(llm, ids, events, start, 4)
    llm.cache.flush()


def test_a_batch_mixing_scored_and_plain_prompts_gets_each_its_rows(llm):
    prompts = [prompt(i, n) for i, n in enumerate([17, 30, 5, 22])]
    params = SamplingParams(max_new_tokens=2, temperature=0)
    starts = [None, 0, None, 9]
    inputs = [GenerateInput(f"mix-{i}", ids, params, True, logprob_start=s) for i, (ids, s) in
              enumerate(zip(prompts, starts))]
    alone = [run(llm, [GenerateInput(f"alone-{i}", ids, params)])[0] for i, ids in enumerate(prompts)]
    llm.cache.flush()
    together = run(llm, inputs)
    for ids, s, events, solo in zip(prompts, starts, together, alone):
        assert [t for e in events for t in e.token_ids] == [t for e in solo for t in e.token_ids]
        if s is None:
            assert all(e.prompt_logprobs is None for e in events)
        else:
            check(llm, ids, events, s, 0)
    llm.cache.flush()


def test_zero_new_tokens_scores_the_prompt_and_generates_nothing(llm):
    ids = prompt(7, 12)
    events = run(llm, [GenerateInput("score-only", ids, SamplingParams(max_new_tokens=0), True, logprob_start=0)])[0]
    assert len(events) == 1 and events[0].token_ids == []
    assert events[0].finish_reason == {"type": "length", "length": 0}
    check(llm, ids, events, 0, 0)
    llm.cache.flush()


def test_prompts_longer_than_a_scoring_slice_are_scored_whole(llm, monkeypatch):
    """Scoring turns ``SCORE_ROWS`` hidden rows into logits at a time: two batched prompts that cross several slices,
    at offsets that do not line up with them, get every position."""
    monkeypatch.setattr(scoring, "SCORE_ROWS", 16)
    prompts, starts = [prompt(21, 2 * 16 + 7), prompt(22, 16 + 3)], [0, 5]
    params = SamplingParams(max_new_tokens=1, temperature=0, top_logprobs=2)
    events = run(llm, [GenerateInput(f"long-{i}", ids, params, True, logprob_start=s)
                       for i, (ids, s) in enumerate(zip(prompts, starts))])
    for ids, s, got in zip(prompts, starts, events):
        check(llm, ids, got, s, 2)
    llm.cache.flush()
