"""The batched sampler: penalties and masks, greedy, temperature, top-k, top-p, per-request seeds, and the most
likely alternatives of each pick. Logprobs are reported under the model's own distribution, before any of it."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from decode_worker.core.sampling import SamplingParams


@dataclass
class Shaping:
    """What a row's logits are adjusted by before it picks: penalties over the tokens seen so far, and tokens it may
    not pick yet (end-of-sequence and stop tokens before ``min_new_tokens``)."""

    output_ids: list[int]  # frequency and presence penalties count these
    context_ids: list[int]  # the repetition penalty covers prompt and output
    banned: list[int]


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float]  # log-probability of each chosen token under the unmodified distribution
    top_logprobs: list[list[tuple[int, float]]]  # per row, its ``top_logprobs`` best (id, logprob); [] when none


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           shaping: list[Shaping | None] | None = None) -> SampleResult:
    """Pick one token per row of ``logits`` [B, vocab]; greedy rows take the argmax of their shaped logits."""
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    if shaping and any(s is not None for s in shaping):
        logits = logits.clone()
        for i, s in enumerate(shaping):
            if s is not None:
                _shape_row(logits[i], params[i], s)
    chosen = logits.argmax(dim=-1)
    for i, p in enumerate(params):
        if not p.greedy:
            chosen[i] = _sample_row(logits[i], p, generators[i])
    picked = logprobs.gather(1, chosen[:, None])[:, 0]
    return SampleResult(chosen.tolist(), picked.tolist(), _top_logprobs(logprobs, params))


def _shape_row(row: torch.Tensor, p: SamplingParams, s: Shaping) -> None:
    """Penalties as SGLang and OpenAI define them, in place."""
    if p.repetition_penalty != 1 and s.context_ids:
        ids = torch.tensor(sorted(set(s.context_ids)), device=row.device)
        seen = row[ids]
        row[ids] = torch.where(seen > 0, seen / p.repetition_penalty, seen * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and s.output_ids:
        ids, counts = torch.unique(torch.tensor(s.output_ids, device=row.device), return_counts=True)
        row[ids] -= p.frequency_penalty * counts + p.presence_penalty
    if s.banned:
        row[torch.tensor(s.banned, device=row.device)] = float("-inf")


def _top_logprobs(logprobs: torch.Tensor, params: list[SamplingParams]) -> list[list[tuple[int, float]]]:
    k = max((p.top_logprobs for p in params), default=0)
    if k == 0:
        return [[] for _ in params]
    values, ids = logprobs.topk(k, dim=-1)
    rows = zip(ids.tolist(), values.tolist())
    return [list(zip(i[: p.top_logprobs], v[: p.top_logprobs])) for p, (i, v) in zip(params, rows)]


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
