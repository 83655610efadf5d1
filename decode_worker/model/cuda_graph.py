"""CUDA graphs of the decode step, one per padded batch-size bucket: a thin layer over the eager step.

Static buffers hold the step's inputs; padded rows write their K/V to scratch page 0 and attend over one
token, so they never touch a live request's pages.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from decode_worker.model.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from decode_worker.model.runner import ModelRunner


def _buckets(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_bs + 1, 16))
    return sorted({s for s in sizes if s <= max_bs} | {max_bs})


class DecodeGraphs:
    def __init__(self, runner: "ModelRunner", max_bs: int):
        self.runner = runner
        self.max_pages = runner.config.max_context // runner.page_size + 1
        dev = runner.device
        self.buckets = _buckets(max_bs)
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.out_slots = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.page_table = torch.zeros(max_bs, self.max_pages, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int64, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool_handle = torch.cuda.graph_pool_handle()
        for bs in reversed(self.buckets):  # largest first so smaller graphs reuse its memory pool
            self._capture(bs)

    def _static_batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(
            is_decode=True,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_slots=self.out_slots[:bs],
            page_table=self.page_table[:bs],
            seq_lens=self.seq_lens[:bs],
            prefix_lens=[0] * bs,
            logits_indices=torch.arange(bs, device=self.input_ids.device),
        )

    def _capture(self, bs: int) -> None:
        fb = self._static_batch(bs)
        model, pool = self.runner.model, self.runner.pool
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up allocator and kernels outside capture
                model(fb, pool)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool_handle):
            self.outputs[bs] = model(fb, pool)
        self.graphs[bs] = graph

    def fits(self, fb: ForwardBatch) -> bool:
        return fb.batch_size <= self.buckets[-1] and fb.page_table.shape[1] <= self.max_pages

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
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
        self.graphs[bucket].replay()
        return self.outputs[bucket][:bs]
