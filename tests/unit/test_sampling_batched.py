"""The batched sampler against the per-row sampler it replaced: the same picks where they are determined (greedy,
seeded rows), the same distribution where they are drawn, and one wait for the device per step."""
from __future__ import annotations

import pytest
import torch

from benchmarks.bench_sampling import per_row_sample
from decode_worker.core.sampling import SamplingParams
from decode_worker.model import sampler
from decode_worker.model.sampler import Shaping, make_generator, sample

CPU = torch.device("cpu")
MODES = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=5),
         SamplingParams(temperature=0.9, top_p=0.8), SamplingParams(temperature=1.1, top_k=40, top_p=0.6)]


def test_greedy_rows_pick_what_the_per_row_sampler_picked():
    torch.manual_seed(1)
    logits = torch.randn(16, 500)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=1)] * 8
    assert sample(logits, params, [None] * 16).token_ids == per_row_sample(logits, params, [None] * 16).token_ids


def test_seeded_rows_pick_what_they_picked_before_whatever_their_neighbours():
    torch.manual_seed(2)
    params = MODES + [SamplingParams(temperature=0.5)] * 4  # four unseeded neighbours share the batched path
    for step in range(6):
        logits = torch.randn(len(params), 3000) * 3
        if step == 0:
            new_gens = [make_generator(10 + i, CPU) for i in range(4)] + [None] * 4
            old_gens = [make_generator(10 + i, CPU) for i in range(4)] + [None] * 4
        new = sample(logits, params, new_gens).token_ids[:4]
        old = per_row_sample(logits, params, old_gens).token_ids[:4]
        assert new == old, f"step {step}"


def expected_distribution(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """What one row should be drawn from: temperature, then top-k (ties kept), then the top-p nucleus."""
    row = logits / p.temperature
    if p.top_k > 0:
        row = row.masked_fill(row < row.topk(p.top_k).values[-1], float("-inf"))
    probs = row.softmax(-1).double()
    values, order = probs.sort(descending=True)
    values[values.cumsum(0) - values > p.top_p] = 0
    kept = torch.zeros_like(probs).scatter_(0, order, values)
    return kept / kept.sum()


@pytest.mark.parametrize("p", MODES, ids=["temperature", "top_k", "top_p", "top_k_top_p"])
def test_unseeded_rows_draw_from_the_per_row_distribution(p: SamplingParams):
    """Chi-square of 40,000 batched draws against the exact distribution the per-row sampler drew from."""
    torch.manual_seed(3)
    logits = torch.linspace(2.0, -2.0, 60)[torch.randperm(60)]
    expected = expected_distribution(logits, p)
    counts = torch.zeros(60, dtype=torch.float64)
    for _ in range(20):
        picks = sample(logits.expand(2000, 60), [p] * 2000, [None] * 2000).token_ids
        counts += torch.bincount(torch.tensor(picks), minlength=60).double()
    assert counts[expected == 0].sum() == 0, "a token outside the top-k / nucleus was drawn"
    live = expected > 0
    n = counts.sum()
    chi2 = ((counts[live] - n * expected[live]) ** 2 / (n * expected[live])).sum()
    dof = int(live.sum()) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), chi2 / 2))
    assert p_value > 1e-4, f"chi2 {chi2:.1f} over {dof} degrees of freedom"


def test_cpu_top_p_over_the_candidates_equals_a_full_sort(monkeypatch: pytest.MonkeyPatch):
    """A peaked row's nucleus lies within the candidates; a flat row's does not and takes the full sort."""
    monkeypatch.setattr(sampler, "NUCLEUS_CANDIDATES", 16)
    torch.manual_seed(4)
    probs = torch.cat([(torch.randn(3, 400) * 6).softmax(-1), torch.randn(3, 400).mul(0.1).softmax(-1)])
    top_p = torch.tensor([0.5, 0.9, 0.99, 0.5, 0.9, 0.99])
    values, order = probs.sort(dim=-1, descending=True)
    full = sampler._keep_prefix(values, order, top_p, probs.shape)
    assert torch.equal(sampler._top_p(probs, top_p), full)
    kept = (full > 0).sum(-1)
    assert (kept < 16).any() and (kept > 16).any()  # both paths really ran


def test_the_inverse_cdf_never_draws_a_token_of_probability_zero():
    probs = torch.zeros(4000, 50)
    probs[:, [0, 7, 49]] = torch.tensor([1e-12, 0.5, 0.25])
    picks = sampler._draw(probs, [None] * 4000)
    assert set(picks.tolist()) <= {0, 7, 49} and (picks == 7).sum() > (picks == 49).sum()


def test_one_read_back_per_step(monkeypatch: pytest.MonkeyPatch):
    """Every ``.tolist()``, ``.item()``, ``int()`` or ``bool()`` of a tensor waits for the device on a GPU."""
    reads = []
    for name in ("tolist", "item", "__int__", "__bool__", "__float__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original, _n=name: reads.append(_n) or _o(self, *a))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=20, top_logprobs=3),
              SamplingParams(temperature=1.2), SamplingParams(temperature=0.8, top_k=5)] * 16
    result = sample(torch.randn(64, 1000), params, [None] * 64)
    assert reads == ["tolist"]
    assert len(result.top_logprobs[1]) == 3 and result.top_logprobs[0] == []


def test_shaping_in_one_batch_equals_each_row_alone():
    """Penalties and bans applied to all shaped rows at once touch each row only where its own request says."""
    torch.manual_seed(6)
    logits = torch.randn(4, 30)
    params = [SamplingParams(temperature=0, repetition_penalty=1.7), SamplingParams(temperature=0),
              SamplingParams(temperature=0, frequency_penalty=0.9, presence_penalty=0.4),
              SamplingParams(temperature=0, min_new_tokens=2, repetition_penalty=0.6, frequency_penalty=-0.5)]
    best = logits.argmax(-1).tolist()
    shaping = [Shaping([], context_ids=[best[0], 3, best[0]], banned=[]), None,
               Shaping(output_ids=[best[2]] * 3 + [best[0]], context_ids=[], banned=[]),
               Shaping(output_ids=[7, 7], context_ids=[7, best[3]], banned=[best[3], 1])]
    together = sample(logits, params, [None] * 4, shaping)
    alone = [sample(logits[i: i + 1], params[i: i + 1], [None], shaping[i: i + 1]) for i in range(4)]
    assert together.token_ids == [r.token_ids[0] for r in alone]
    assert together.token_ids[1] == best[1] and together.token_ids[0] != best[0] and together.token_ids[2] != best[2]
    assert together.logprobs == pytest.approx([r.logprobs[0] for r in alone])
