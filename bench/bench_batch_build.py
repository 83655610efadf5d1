"""Host time to lay out one decode step (``ForwardBatch.build``) at batch 64 and 256, contexts 1K and 4K tokens.

Prints one JSON line: the best milliseconds of a build per case.
Usage: python bench/bench_batch_build.py [--batches 64 256] [--contexts 1024 4096] [--repeats 20]
"""
from __future__ import annotations

import argparse
import json
import random

import torch
from bench_sampling import best_ms  # a script: bench/ is on sys.path

from decode_worker.model.forward_batch import ForwardBatch

PAGE = 16


def decode_step(batch: int, context: int) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """Requests of about ``context`` tokens each on scattered pages, one new token each."""
    rng = random.Random(0)
    lens = [context - rng.randrange(PAGE * 4) for _ in range(batch)]
    free = list(range(1, batch * (context // PAGE + 1) + 1))
    rng.shuffle(free)
    pages = [[free.pop() for _ in range(-(-(n + 1) // PAGE))] for n in lens]
    return [[rng.randrange(49152)] for _ in lens], lens, pages


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    result = {"bench": "batch_build", "page_size": PAGE, "cases": {}}
    cpu = torch.device("cpu")
    for bs in args.batches:
        for ctx in args.contexts:
            tokens, prefix, pages = decode_step(bs, ctx)
            ms = best_ms(lambda: ForwardBatch.build(tokens, prefix, pages, PAGE, cpu), args.repeats)
            result["cases"][f"b{bs}_ctx{ctx}"] = {"build_ms": ms}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
