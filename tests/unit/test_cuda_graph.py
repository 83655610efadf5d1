"""Decode graphs: replay equals the eager step, and every tensor a captured step reads is the graph runner's own.

On CPU the graphs are ``EagerGraph`` stand-ins (replay reruns the captured step on the captured tensors), which
exercises buckets, padding and buffer ownership; tests/gpu/test_cuda_graph_gpu.py runs the real CUDA graphs.
"""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from decode_worker.cache.pool import PageAllocator
from decode_worker.model.cuda_graph import DecodeGraphs
from decode_worker.model.forward_batch import ForwardBatch
from decode_worker.model.loader import LoadedModel, load_model
from decode_worker.model.runner import ModelRunner

def churn_allocator(device: str) -> None:
    """Allocate, fill and free many small index-sized tensors: the blocks a freed capture temporary would get."""
    for n in range(1, 65):
        junk = torch.full((n,), 10**6 + n, dtype=torch.int64, device=device)
        junk.add_(1)


def decode_step(runner: ModelRunner, prompts: list[list[int]], pages: list[list[int]], rows: bool) -> ForwardBatch:
    """The decode step after ``prompts``: a full build, or through the runner's persistent page-table rows."""
    if rows:
        return runner.build_decode([f"r{b}" for b in range(len(prompts))], [p[-1] for p in prompts],
                                   [len(p) for p in prompts], pages)
    return runner.build_batch([[p[-1]] for p in prompts], [len(p) for p in prompts], pages)


def replay_matches_eager(graphs: ModelRunner, eager: ModelRunner, sizes: tuple[int, ...], device: str,
                         rows: bool = False) -> None:
    rng = random.Random(0)
    for bs in sizes:  # exact buckets and padded ones
        prompts = [[rng.randrange(320) for _ in range(rng.randrange(1, 40))] for _ in range(bs)]
        outs = []
        for runner in (graphs, eager):
            alloc = PageAllocator(runner.num_pages, reserved=1)
            pages = [alloc.alloc(-(-(len(p) + 1) // 4)).tolist() for p in prompts]
            runner.forward(runner.build_batch(prompts, [0] * bs, pages))
            step = decode_step(runner, prompts, pages, rows)
            assert step.is_decode
            churn_allocator(device)
            outs.append(runner.forward(step).clone())
            for b in range(bs):
                runner.rows.release(f"r{b}")
        assert (outs[0] - outs[1]).abs().max().item() < 1e-4, bs


def cpu_runners(loaded: LoadedModel, max_bs: int = 16, tokens: int = 4096) -> tuple[ModelRunner, ModelRunner,
                                                                                     list[ForwardBatch]]:
    """A runner with CPU stand-in graphs, an eager one, and every batch the captured steps were called with."""
    graphs, eager = (ModelRunner(loaded, max_total_tokens=tokens, page_size=4) for _ in range(2))
    model, seen = graphs.model, []

    def spy(fb: ForwardBatch, pool) -> torch.Tensor:
        seen.append(fb)
        return model(fb, pool)

    graphs.model = spy
    graphs.graphs = DecodeGraphs(graphs, max_bs)
    graphs.model = model
    return graphs, eager, seen


def test_captured_steps_read_only_the_graph_runners_buffers(tiny_models):
    graphs, _, seen = cpu_runners(load_model(tiny_models["llama"], tokenizer=False))
    owned = {t.untyped_storage().data_ptr() for t in graphs.graphs.buffers()}
    assert {fb.batch_size for fb in seen} == set(graphs.graphs.buckets)
    for fb in seen:
        for field in dataclasses.fields(fb):
            value = getattr(fb, field.name)
            if isinstance(value, torch.Tensor):
                assert value.untyped_storage().data_ptr() in owned, f"bs {fb.batch_size}: {field.name} is a temporary"
    assert set(graphs.graphs.batches) == set(graphs.graphs.buckets)  # kept for the graphs' life


@pytest.mark.parametrize("rows", [False, True], ids=["full_build", "page_table_rows"])
def test_stand_in_replay_after_allocator_churn_matches_eager(tiny_models, rows: bool):
    graphs, eager, _ = cpu_runners(load_model(tiny_models["llama"], tokenizer=False))
    replay_matches_eager(graphs, eager, (1, 3, 8, 13), "cpu", rows)


def test_default_graphs_reach_batch_256_with_padded_sizes_between(tiny_models):
    """``--cuda-graph-max-bs`` defaults to 256 as SGLang's does: batches 65 and 256 replay from graphs (65 padded to
    the 80 bucket, its padding rows on the scratch page) and equal the eager step; no bucket pads more than 15 rows."""
    from decode_worker.config import ServerConfig

    max_bs = ServerConfig().cuda_graph_max_bs
    graphs, eager, _ = cpu_runners(load_model(tiny_models["llama"], tokenizer=False), max_bs, tokens=16384)
    buckets = graphs.graphs.buckets
    assert buckets[-1] == 256 and buckets[:4] == [1, 2, 4, 8]
    assert all(b - a <= 16 for a, b in zip(buckets, buckets[1:]))
    replay_matches_eager(graphs, eager, (65, 256), "cpu", rows=True)
