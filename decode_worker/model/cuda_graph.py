"""CUDA graphs of the decode step, one per padded batch size."""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from decode_worker.cache.pool import KVPool
from decode_worker.model.config import ModelConfig
from decode_worker.model.forward_batch import ForwardBatch

Step = Callable[[], torch.Tensor]


class StepOwner(Protocol):
    """What the graphs need of the runner."""

    model: Callable[[ForwardBatch, KVPool], torch.Tensor]
    pool: KVPool
    config: ModelConfig
    page_size: int
    device: torch.device


class Graph(Protocol):
    output: torch.Tensor

    def replay(self) -> None: ...


class CudaGraph:
    """One captured step; each replay rewrites ``output``."""

    def __init__(self, step: Step, pool: tuple[int, int]):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up allocator and kernels outside capture
                step()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = step()

    def replay(self) -> None:
        self.graph.replay()


class EagerGraph:
    """CPU stand-in for ``CudaGraph``."""

    def __init__(self, step: Step):
        self.step = step
        self.output = step()

    @torch.inference_mode()
    def replay(self) -> None:
        self.output.copy_(self.step())


def _buckets(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_bs + 1, 16))
    return sorted({s for s in sizes if s <= max_bs} | {max_bs})


class DecodeGraphs:
    def __init__(self, runner: StepOwner, max_bs: int):
        self.runner = runner
        self.max_pages = runner.config.max_context // runner.page_size + 1
        dev = runner.device
        self.buckets = _buckets(max_bs)
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.out_slots = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.page_table = torch.zeros(max_bs, self.max_pages, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int64, device=dev)
        self.logits_indices = torch.arange(max_bs, dtype=torch.int64, device=dev)  # never written: row b is b
        self.batches: dict[int, ForwardBatch] = {}  # what each graph was captured with, all views of the above
        self.graphs: dict[int, Graph] = {}
        self.pool_handle = torch.cuda.graph_pool_handle() if dev.type == "cuda" else None
        for bs in reversed(self.buckets):  # largest first so smaller graphs reuse its memory pool
            self._capture(bs)

    def buffers(self) -> list[torch.Tensor]:
        return [self.input_ids, self.positions, self.out_slots, self.page_table, self.seq_lens, self.logits_indices]

    def _static_batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(
            is_decode=True,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_slots=self.out_slots[:bs],
            page_table=self.page_table[:bs],
            seq_lens=self.seq_lens[:bs],
            prefix_lens=[0] * bs,
            logits_indices=self.logits_indices[:bs],
        )

    def _capture(self, bs: int) -> None:
        fb = self.batches[bs] = self._static_batch(bs)
        model, pool = self.runner.model, self.runner.pool

        def step() -> torch.Tensor:
            return model(fb, pool)

        self.graphs[bs] = EagerGraph(step) if self.pool_handle is None else CudaGraph(step, self.pool_handle)

    def fits(self, fb: ForwardBatch) -> bool:
        return fb.batch_size <= self.buckets[-1] and fb.page_table.shape[1] <= self.max_pages

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits of ``fb``, valid until the next replay."""
        bs = fb.batch_size
        bucket = next(b for b in self.buckets if b >= bs)
        self.input_ids[:bs].copy_(fb.input_ids)
        self.positions[:bs].copy_(fb.positions)
        self.out_slots[:bs].copy_(fb.out_slots)
        self.seq_lens[:bs].copy_(fb.seq_lens)
        self.page_table[:bs].zero_()
        self.page_table[:bs, : fb.page_table.shape[1]].copy_(fb.page_table)
        # Padding rows: scratch slot 0, one token of context, token 0 at position 0.
        self.input_ids[bs:bucket].zero_()
        self.positions[bs:bucket].zero_()
        self.out_slots[bs:bucket].zero_()
        self.seq_lens[bs:bucket].fill_(1)
        self.page_table[bs:bucket].zero_()
        graph = self.graphs[bucket]
        graph.replay()
        return graph.output[:bs]
