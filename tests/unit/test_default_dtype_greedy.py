"""The default CPU dtype (bfloat16 with 4-bit layer weights where the CPU has native bf16) decodes SmolLM2 greedily
as the float32 reference does on the parity prompts. Where it departs, the float32 logits' top-2 margin at that
token is printed; a departure in the first half of the output is allowed only at a near-tie of float32 itself
(a margin under ``NEAR_TIE``, which bf16 rounding can flip), and on one prompt at most. Wrong weights or KV derail
outputs at clear margins from the first tokens."""
from __future__ import annotations

import pytest
import torch

from decode_worker.core.cpu_features import auto_dtype
from decode_worker.core.sampling import SamplingParams
from decode_worker.engine.llm import LLM
from decode_worker.model.loader import INT4_WIDE_FROM_ROWS
from tests.unit.test_smollm2 import CHAT_QUESTION, PROMPTS

NEW_TOKENS = 16
NEAR_TIE = 0.25  # float32 logits


def top2_margin(llm: LLM, ids: list[int]) -> float:
    """float32 logit gap between the best and second-best next token after ``ids``."""
    from decode_worker.cache.pool import PageAllocator

    runner = llm.runner
    alloc = PageAllocator(runner.num_pages, reserved=1)
    pages = alloc.alloc(-(-len(ids) // runner.page_size)).tolist()
    logits = runner.forward(runner.build_batch([ids], [0], [pages]))[0]
    top = logits.topk(2).values
    return (top[0] - top[1]).item()


@pytest.fixture(scope="module")
def default_dtype() -> torch.dtype:
    return getattr(torch, auto_dtype(torch.cuda.is_available())[0])


@pytest.fixture(scope="module")
def fast(smollm2_path, default_dtype) -> LLM:
    """What ``--dtype auto`` serves (float32 there keeps the GGUF's low-bit weights)."""
    return LLM(str(smollm2_path), max_total_tokens=4096, dtype=default_dtype, low_bit_float32=True)


@pytest.fixture(scope="module")
def reference(smollm2_path):
    llm = LLM(str(smollm2_path), max_total_tokens=2048, dtype=torch.float32)
    return llm, llm.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))


@pytest.mark.slow  # two SmolLM2 runners and 24 generations, ~60 s: make test-all runs it; the chat check below stays
@pytest.mark.parametrize("batched", [True, False], ids=["batch-of-8", "one-by-one"])
def test_default_dtype_greedy_matches_float32(fast, default_dtype, reference, batched):
    """Batched (every prompt twice: decode steps of 16 rows), the steps are wide enough for the dense bf16 copy
    (``loader.INT4_WIDE_FROM_ROWS``); one by one, every decode step runs the int4 kernel."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    if batched:
        assert 2 * len(PROMPTS) >= INT4_WIDE_FROM_ROWS[default_dtype]
        outs = fast.generate(PROMPTS * 2, params)[: len(PROMPTS)]
    else:
        outs = [fast.generate([p], params)[0] for p in PROMPTS]
    ref_llm, ref_outs = reference
    early = []
    for prompt, ref, out in zip(PROMPTS, ref_outs, outs):
        if out.output_ids == ref.output_ids:
            continue
        first = next(i for i, (a, b) in enumerate(zip(out.output_ids, ref.output_ids)) if a != b)
        margin = top2_margin(ref_llm, ref_llm.tokenizer.encode(prompt) + ref.output_ids[:first])
        print(f"{prompt!r}: {default_dtype} departs from float32 at token {first} (float32 top-2 margin {margin:.3f})")
        if first < NEW_TOKENS // 2:
            assert margin < NEAR_TIE, f"{prompt!r} departs at token {first} where float32's margin is {margin:.3f}"
            early.append(prompt)
    assert len(early) <= 1, f"departures in the first half on {early}"


def test_default_dtype_answers_the_chat_question(fast):
    """`make generate`'s question, in the default dtype: the answer names Paris."""
    out = fast.generate([[{"role": "user", "content": CHAT_QUESTION}]], SamplingParams(max_new_tokens=24, temperature=0))
    assert "Paris" in out[0].text
