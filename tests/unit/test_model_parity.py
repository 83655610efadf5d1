"""Our paged-KV model against Hugging Face transformers on the same weights."""
from __future__ import annotations

import random

import pytest
import torch

from decode_worker.cache.pool import PageAllocator
from decode_worker.engine.llm import LLM
from decode_worker.core.sampling import SamplingParams
from decode_worker.model.loader import load_model
from decode_worker.model.runner import ModelRunner


def hf_model(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype).eval()


def our_logits(runner: ModelRunner, allocator: PageAllocator, ids: list[int]) -> torch.Tensor:
    pages = allocator.alloc(-(-len(ids) // runner.page_size)).tolist()
    try:
        return runner.forward(runner.build_batch([ids], [0], [pages], all_logits=True))
    finally:
        allocator.free(torch.tensor(pages))


@pytest.mark.parametrize("name", ["llama", "llama3", "qwen2", "mistral"])
def test_logits_match_transformers(tiny_models, name):
    loaded = load_model(tiny_models[name], tokenizer=False)
    runner = ModelRunner(loaded, max_total_tokens=1024, page_size=4)
    allocator = PageAllocator(runner.num_pages, reserved=1)
    ids = [random.Random(1).randrange(320) for _ in range(150)]  # past llama3's original 64-token context
    ours = our_logits(runner, allocator, ids)
    with torch.no_grad():
        ref = hf_model(tiny_models[name])(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-4


def test_extend_over_cached_prefix_equals_full_prefill(tiny_models):
    """KV of a prefix supplied as already-cached pages (in shuffled page order) gives the same logits."""
    loaded = load_model(tiny_models["llama"], tokenizer=False)
    runner = ModelRunner(loaded, max_total_tokens=1024, page_size=4)
    allocator = PageAllocator(runner.num_pages, reserved=1)
    ids = [random.Random(2).randrange(320) for _ in range(61)]
    full = our_logits(runner, allocator, ids)
    pages = allocator.alloc(16)[torch.randperm(16, generator=torch.Generator().manual_seed(0))].tolist()
    prefix = 36  # 9 whole pages; the suffix starts a fresh page
    runner.forward(runner.build_batch([ids[:prefix]], [0], [pages]))
    tail = runner.forward(runner.build_batch([ids[prefix:]], [prefix], [pages], all_logits=True))
    assert (tail - full[prefix:]).abs().max().item() < 1e-4
    # A prefix that ends mid-page: the extend must write into the partly filled page.
    runner.forward(runner.build_batch([ids[:30]], [0], [pages]))
    tail = runner.forward(runner.build_batch([ids[30:]], [30], [pages], all_logits=True))
    assert (tail - full[30:]).abs().max().item() < 1e-4


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_greedy_batch_of_mixed_lengths_matches_transformers(tiny_models, name):
    """8 prompts of different lengths decoded together (float64 so near-ties cannot flip)."""
    rng = random.Random(3)
    prompts = [[rng.randrange(320) for _ in range(n)] for n in (1, 5, 16, 17, 33, 64, 90, 128)]
    llm = LLM(str(tiny_models[name]), max_total_tokens=2048, page_size=4, dtype=torch.float64, load_tokenizer=False)
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True))
    ref = hf_model(tiny_models[name], torch.float64)
    for prompt, out in zip(prompts, outs):
        assert out.output_ids == hf_greedy(ref, prompt, 10)
    assert llm.allocator.num_used == 0


def test_preemption_when_pool_is_full_keeps_outputs(tiny_models):
    """A pool too small for all sequences at once preempts and recomputes; the tokens do not change."""
    rng = random.Random(4)
    prompts = [[rng.randrange(320) for _ in range(20)] for _ in range(6)]
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    roomy = LLM(str(tiny_models["llama"]), max_total_tokens=2048, page_size=4, dtype=torch.float64, load_tokenizer=False)
    tight = LLM(str(tiny_models["llama"]), max_total_tokens=64, page_size=4, dtype=torch.float64, load_tokenizer=False)
    assert [o.output_ids for o in tight.generate(prompts, params)] == [o.output_ids for o in roomy.generate(prompts, params)]
    assert tight.allocator.num_used == 0
