"""Batched sampling and logprobs; one read-back a step."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

import torch

from decode_worker.core.request import PromptLogprobs
from decode_worker.core.sampling import SamplingParams
from decode_worker.model.native import native_kernels
from decode_worker_kernels import cpu_sampling

NUCLEUS_CANDIDATES = 256  # CPU top-p sorts only this many best tokens per row when they already pass top_p


@dataclass
class Shaping:
    """A row's penalties and early bans."""

    output_ids: list[int]  # frequency and presence penalties count these
    context_ids: list[int]  # the repetition penalty covers prompt and output
    banned: list[int]


class TokenMask(Protocol):
    """The tokens each constrained row may pick."""

    def apply(self, logits: torch.Tensor) -> None:
        """Set banned tokens to -inf, in place."""


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float]  # log-probability of each chosen token under the unmodified distribution
    top_logprobs: list[list[tuple[int, float]]]  # per row, its ``top_logprobs`` best (id, logprob); [] when none
    prompt: list[PromptLogprobs | None] = field(default_factory=list)  # per row, an extend's scored prompt, if any


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           shaping: list[Shaping | None] | None = None, mask: TokenMask | None = None) -> SampleResult:
    """One token per row of ``logits`` [B, vocab]."""
    logits = logits.float()
    stats = _row_stats(logits)  # (log-sum-exp, argmax) per row on the native path, else the whole log-softmax
    shaped = _shape(logits.clone(), params, shaping) if shaping and any(s is not None for s in shaping) else logits
    if mask is not None:
        shaped = shaped.clone() if shaped is logits else shaped
        mask.apply(shaped)
    chosen = torch.empty(len(params), dtype=torch.int64, device=logits.device)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy and stats is not None and shaped is logits:
        chosen[greedy] = _rows(stats[1], greedy)
    elif greedy:
        chosen[greedy] = _rows(shaped, greedy).argmax(dim=-1)
    if rows := [i for i, p in enumerate(params) if not p.greedy]:
        chosen[rows] = _sample_rows(_rows(shaped, rows), [params[i] for i in rows], [generators[i] for i in rows])
    k = max((p.top_logprobs for p in params), default=0)
    if stats is None:
        logprobs = torch.log_softmax(logits, dim=-1)
        parts = [chosen, logprobs.gather(1, chosen[:, None])[:, 0]]
        if k:
            best = logprobs.topk(k, dim=-1)
            parts += [best.indices.flatten(), best.values.flatten()]
    else:
        lse = stats[0]
        parts = [chosen, logits.gather(1, chosen[:, None])[:, 0].double() - lse]
        if k:
            best = logits.topk(k, dim=-1)
            parts += [best.indices.flatten(), (best.values.double() - lse[:, None]).flatten()]
    # One read-back for everything, so one wait for the device: ids are exact in float64, logprobs only widen.
    values, batch = torch.cat([t.double() for t in parts]).tolist(), len(params)
    ids, top = values[2 * batch: (2 + k) * batch], values[(2 + k) * batch:]
    tops = [[(int(ids[b * k + j]), top[b * k + j]) for j in range(p.top_logprobs)] for b, p in enumerate(params)]
    return SampleResult([int(t) for t in values[:batch]], values[batch: 2 * batch], tops)


def _row_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each row's log-sum-exp (float64) and argmax from the native CPU kernel; None on GPU or without it."""
    if logits.device.type != "cpu" or logits.stride(-1) != 1 or (lib := native_kernels()) is None:
        return None
    return cpu_sampling.row_stats_cpu(lib, logits)


def score(logits: torch.Tensor, targets: list[int], k: int) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Each target's log-probability and each row's ``k`` best."""
    target = torch.tensor(targets, dtype=torch.int64, device=logits.device)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    parts = [logprobs.gather(1, target[:, None])[:, 0].double()]
    if k:
        best = logprobs.topk(k, dim=-1)
        parts += [best.indices.flatten().double(), best.values.flatten().double()]
    values = torch.cat(parts).tolist()
    n = len(targets)
    ids, lps = values[n: n + n * k], values[n + n * k:]
    return values[:n], [[(int(ids[r * k + j]), lps[r * k + j]) for j in range(k)] for r in range(n)]


def _rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    return t if len(rows) == t.shape[0] else t[rows]


def _shape(logits: torch.Tensor, params: list[SamplingParams], shaping: list[Shaping | None]) -> torch.Tensor:
    """Penalties in place, in SGLang/OpenAI order."""
    repeat, count, ban = [], [], []  # (row, token, ...) per adjustment
    for i, (p, s) in enumerate(zip(params, shaping)):
        if s is None:
            continue
        if p.repetition_penalty != 1:
            repeat += [(i, t, p.repetition_penalty) for t in set(s.context_ids)]
        if p.frequency_penalty or p.presence_penalty:
            count += [(i, t, n, p.frequency_penalty, p.presence_penalty) for t, n in Counter(s.output_ids).items()]
        ban += [(i, t) for t in s.banned]
    if repeat:
        rows, tokens, penalty = _columns(repeat, logits.device)
        seen = logits[rows, tokens]
        logits[rows, tokens] = torch.where(seen > 0, seen / penalty, seen * penalty)
    if count:
        rows, tokens, times, per_time, once = _columns(count, logits.device)
        logits[rows, tokens] -= per_time * times + once
    if ban:
        rows, tokens = _columns(ban, logits.device)
        logits[rows, tokens] = float("-inf")
    return logits


def _columns(entries: list[tuple], device: torch.device) -> list[torch.Tensor]:
    columns = list(zip(*entries))
    return [torch.tensor(c, dtype=torch.int64 if j < 2 else torch.float32, device=device) for j, c in enumerate(columns)]


def _sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> torch.Tensor:
    """One pick per row: temperature, top-k, top-p."""
    dev = logits.device
    logits = logits / torch.tensor([p.temperature for p in params], device=dev)[:, None]
    top_k = [min(p.top_k, logits.shape[1]) for p in params]
    if any(k > 0 for k in top_k):  # keep what ranks within its k best, ties with the k-th included
        best = logits.topk(max(top_k), dim=-1).values
        kth = best.gather(1, torch.tensor([max(k, 1) - 1 for k in top_k], device=dev)[:, None])
        kth[torch.tensor([k <= 0 for k in top_k], device=dev)] = float("-inf")
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    nucleus = [i for i, p in enumerate(params) if p.top_p < 1]
    if nucleus:
        kept = _top_p(_rows(probs, nucleus), torch.tensor([params[i].top_p for i in nucleus], device=dev))
        probs = kept if len(nucleus) == len(params) else probs.index_put_((torch.tensor(nucleus, device=dev),), kept)
    return _draw(probs, generators)


def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero ``probs`` outside each row's nucleus."""
    if probs.is_cuda or probs.shape[1] <= NUCLEUS_CANDIDATES:
        values, order = probs.sort(dim=-1, descending=True)
        return _keep_prefix(values, order, top_p, probs.shape)
    values, order = probs.topk(NUCLEUS_CANDIDATES, dim=-1)
    covered = values.cumsum(-1)[:, -1] > top_p
    out = _keep_prefix(values, order, top_p, probs.shape)
    if not bool(covered.all()):
        rest = (~covered).nonzero()[:, 0]
        wide = probs[rest]
        values, order = wide.sort(dim=-1, descending=True)
        out[rest] = _keep_prefix(values, order, top_p[rest], wide.shape)
    return out


def _keep_prefix(values: torch.Tensor, order: torch.Tensor, top_p: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    outside = values.cumsum(-1) - values > top_p[:, None]  # mass strictly before a token already passes top_p
    return torch.zeros(shape, dtype=values.dtype, device=values.device).scatter_(1, order, values.masked_fill(outside, 0))


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row; seeded rows use ``multinomial``."""
    picks = torch.empty(probs.shape[0], dtype=torch.int64, device=probs.device)
    free = [i for i, g in enumerate(generators) if g is None]
    if free:  # the first token whose CDF reaches u in (0, total]: never one of probability 0
        cdf = _rows(probs, free).double().cumsum_(-1)
        u = (1 - torch.rand(len(free), 1, dtype=torch.float64, device=probs.device)) * cdf[:, -1:]
        picks[free] = torch.searchsorted(cdf, u)[:, 0]
    for i, g in enumerate(generators):
        if g is not None:
            picks[i] = torch.multinomial(probs[i], 1, generator=g)[0]
    return picks


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g
