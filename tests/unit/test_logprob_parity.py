"""Logprobs on the embedded SmolLM2 against transformers on the same GGUF weights (float32): the prompt's own
and greedy output tokens' agree within 1e-3, as do their alternatives."""
from __future__ import annotations

import pytest
import torch

from decode_worker.core.request import GenerateInput
from decode_worker.core.sampling import SamplingParams
from decode_worker.engine.llm import LLM

TOL = 1e-3
PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(str(smollm2_path), max_total_tokens=4096, page_size=16, dtype=torch.float32)


def test_prompt_and_greedy_logprobs_match_transformers(llm, hf_smollm2):
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True, top_logprobs=3)
    inputs = [GenerateInput(f"p{i}", llm.tokenizer.encode(p), params, True, logprob_start=0)
              for i, p in enumerate(PROMPTS)]
    streams = [llm.scheduler.submit(inp) for inp in inputs]
    while not llm.scheduler.idle():
        llm.scheduler.step_sync()
    for inp, stream in zip(inputs, streams):
        events = []
        while (event := stream.queue.get_nowait()) is not None:
            events.append(event)
        out = [t for e in events for t in e.token_ids]
        out_lp = [lp for e in events for lp in e.logprobs]
        out_top = [row for e in events for row in e.top_logprobs]
        ids = inp.prompt_ids + out
        with torch.no_grad():
            ref = torch.log_softmax(hf_smollm2(torch.tensor([ids])).logits[0].double(), -1)
        n = len(inp.prompt_ids)
        assert out == ref[n - 1: -1].argmax(-1).tolist()  # greedy: each output token is the reference's best
        scored = events[0].prompt_logprobs
        assert scored.logprobs[0] is None and len(scored.logprobs) == n
        want = [ref[p - 1, ids[p]].item() for p in range(1, len(ids))]
        got = scored.logprobs[1:] + out_lp
        assert max(abs(a - b) for a, b in zip(got, want)) < TOL
        for p, row in enumerate(scored.top[1:] + out_top, start=1):
            best = ref[p - 1].topk(3)
            assert [t for t, _ in row] == best.indices.tolist()
            assert max(abs(lp - r) for (_, lp), r in zip(row, best.values.tolist())) < TOL
