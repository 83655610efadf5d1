"""The batched sampler: greedy, temperature, top-k, top-p, per-request seeds."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from decode_worker.core.sampling import SamplingParams


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float]  # log-probability of each chosen token under the unmodified distribution


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> SampleResult:
    """Pick one token per row of ``logits`` [B, vocab]; greedy rows take the argmax."""
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logits.argmax(dim=-1)
    for i, p in enumerate(params):
        if not p.greedy:
            chosen[i] = _sample_row(logits[i], p, generators[i])
    picked = logprobs.gather(1, chosen[:, None])[:, 0]
    return SampleResult(chosen.tolist(), picked.tolist())


def _sample_row(row: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    row = row / p.temperature
    if p.top_k > 0:
        kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        outside = sorted_probs.cumsum(0) - sorted_probs > p.top_p  # keep the smallest prefix reaching top_p
        sorted_probs[outside] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g
