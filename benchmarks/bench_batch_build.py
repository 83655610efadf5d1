"""Host time to lay out one decode step: the full rebuild (``ForwardBatch.build``, every page of every request
packed and sent each step) against persistent page-table rows (``PageTableRows.decode_batch``: only the pages
added since the last step go over, then the batch's rows are gathered), at batch 64 and 256, 4K context.

Both run on the same steady decode: every request gains a token a step and a page every ``PAGE`` tokens, in
place, as the scheduler grows them. Per case: median ms of each over ``--steps`` steps, their ratio, the rows'
first step (every row filled whole, once per request) and the gather alone (what the rows add per step).
Prints one JSON line.
Usage: python benchmarks/bench_batch_build.py [--batches 64 256] [--contexts 4096] [--steps 64] [--device cpu]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable

import torch

from decode_worker.model.forward_batch import ForwardBatch
from decode_worker.model.page_table import PageTableRows

PAGE = 16


def decode_requests(batch: int, context: int) -> tuple[list[int], list[list[int]], list[int]]:
    """Requests of about ``context`` tokens each on scattered pages (one spare page each for the growth)."""
    rng = random.Random(0)
    lens = [context - rng.randrange(PAGE * 4) for _ in range(batch)]
    free = list(range(1, batch * (context // PAGE + 8) + 1))
    rng.shuffle(free)
    pages = [[free.pop() for _ in range(-(-(n + 1) // PAGE))] for n in lens]
    return lens, pages, free


def ms(fn: Callable[[], object], device: torch.device) -> float:
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def case(batch: int, context: int, steps: int, device: torch.device) -> dict:
    lens, pages, free = decode_requests(batch, context)
    keys = [f"r{b}" for b in range(batch)]
    tokens = [1] * batch
    width = context // PAGE + steps // PAGE + 2
    PageTableRows(width, device, capacity=batch).decode_batch(keys, tokens, lens, pages, PAGE)  # warm-up
    rows = PageTableRows(width, device, capacity=batch)
    first = ms(lambda: rows.decode_batch(keys, tokens, lens, pages, PAGE), device)
    full, delta, gather = [], [], []
    for _ in range(steps):
        lens = [n + 1 for n in lens]
        for plist, n in zip(pages, lens):
            if len(plist) * PAGE < n + 1:
                plist.append(free.pop())  # in place, as the scheduler grows a running request
        full.append(ms(lambda: ForwardBatch.build([[t] for t in tokens], lens, pages, PAGE, device), device))
        delta.append(ms(lambda: rows.decode_batch(keys, tokens, lens, pages, PAGE), device))
        index = torch.arange(batch, device=device)
        width = -(-(max(lens) + 1) // PAGE)
        gather.append(ms(lambda: rows.table[:, :width].index_select(0, index), device))
    old, new = statistics.median(full), statistics.median(delta)
    return {"full_rebuild_ms": round(old, 3), "delta_rows_ms": round(new, 3), "ratio": round(new / old, 3),
            "rows_first_step_ms": round(first, 3), "gather_ms": round(statistics.median(gather), 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    result = {"bench": "batch_build", "device": device.type, "page_size": PAGE, "steps": args.steps, "cases": {}}
    for bs in args.batches:
        for ctx in args.contexts:
            result["cases"][f"b{bs}_ctx{ctx}"] = case(bs, ctx, args.steps, device)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
