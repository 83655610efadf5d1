"""CUDA-graph decode replay equals the eager step (runs only where a GPU is present)."""
from __future__ import annotations

import random

import pytest
import torch

from decode_worker.cache.pool import PageAllocator
from decode_worker.model.loader import load_model
from decode_worker.model.runner import ModelRunner

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_graph_replay_matches_eager_decode(tiny_models):
    loaded = load_model(tiny_models["llama"], device="cuda", tokenizer=False)
    graphs = ModelRunner(loaded, max_total_tokens=4096, page_size=4, cuda_graph_max_bs=16)
    eager = ModelRunner(loaded, max_total_tokens=4096, page_size=4)
    assert graphs.graphs is not None and eager.graphs is None
    rng = random.Random(0)
    for bs in (1, 3, 8, 13):  # exact buckets and padded ones
        prompts = [[rng.randrange(320) for _ in range(rng.randrange(1, 40))] for _ in range(bs)]
        outs = []
        for runner in (graphs, eager):
            alloc = PageAllocator(runner.num_pages, reserved=1)
            pages = [alloc.alloc(-(-(len(p) + 1) // 4)).tolist() for p in prompts]
            runner.forward(runner.build_batch(prompts, [0] * bs, pages))
            step = runner.build_batch([[p[-1]] for p in prompts], [len(p) for p in prompts], pages)
            assert step.is_decode
            outs.append(runner.forward(step).clone())
        assert (outs[0] - outs[1]).abs().max().item() < 1e-4, bs
