"""Sampler micro-benchmark: the batched sampler against the per-row sampler it replaced, same logits and params.

Prints one JSON line: the best milliseconds per step of both and their ratio (new / old) per batch size and mode.
Usage: python benchmarks/bench_sampling.py [--batches 64 256] [--vocab 49152] [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from decode_worker.core.sampling import SamplingParams
from decode_worker.model.sampler import SampleResult, sample

MODES = {
    "greedy": SamplingParams(temperature=0),
    "temperature": SamplingParams(temperature=0.8),
    "top_k_top_p": SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
    "top_p": SamplingParams(temperature=0.8, top_p=0.95),
}


def per_row_sample(logits: torch.Tensor, params: list[SamplingParams],
                   generators: list[torch.Generator | None]) -> SampleResult:
    """The sampler before batching (no shaping): a full-vocabulary sort and a host sync per top-p row. Kept as the
    baseline here and as the reference ``tests/unit/test_sampling_batched.py`` compares distributions against."""
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logits.argmax(dim=-1)
    for i, p in enumerate(params):
        if not p.greedy:
            chosen[i] = _per_row_pick(logits[i], p, generators[i])
    picked = logprobs.gather(1, chosen[:, None])[:, 0]
    return SampleResult(chosen.tolist(), picked.tolist(), [[] for _ in params])


def _per_row_pick(row: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    row = row / p.temperature
    if p.top_k > 0:
        kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        outside = sorted_probs.cumsum(0) - sorted_probs > p.top_p
        sorted_probs[outside] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def best_ms(fn, repeats: int) -> float:
    """The fastest of ``repeats`` runs after a warm-up: on a shared machine the others measure the neighbours."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(min(times) * 1e3, 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    result = {"bench": "sampling", "vocab": args.vocab, "threads": torch.get_num_threads(), "cases": {}}
    for bs in args.batches:
        logits = torch.randn(bs, args.vocab) * 4  # a peaked, model-like spread
        gens = [None] * bs
        for mode, p in MODES.items():
            params = [p] * bs
            new = best_ms(lambda: sample(logits, params, gens), args.repeats)
            old = best_ms(lambda: per_row_sample(logits, params, gens), args.repeats)
            result["cases"][f"b{bs}_{mode}"] = {"new_ms": new, "old_ms": old, "ratio": round(new / old, 3)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
