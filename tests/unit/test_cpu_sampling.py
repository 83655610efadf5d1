"""The native per-row logit statistics: the argmax is torch's (the first of equal maxima, wherever they fall in the
vector lanes or the tail), the log-sum-exp is the float64 one within float32's precision of a term, over -inf
entries, vocabularies that are not a multiple of 16, and rows a stride apart; the sampler's logprobs through them equal
the log-softmax's."""
from __future__ import annotations

import pytest
import torch
from decode_worker_kernels.cpu_sampling import row_stats_cpu

from decode_worker.core.sampling import SamplingParams
from decode_worker.model import sampler


@pytest.mark.parametrize("vocab", [5, 16, 49152, 1000])
def test_argmax_and_logsumexp_match_torch(native_lib, vocab):
    g = torch.Generator().manual_seed(vocab)
    wide = torch.randn(6, vocab + 7, generator=g) * 5
    logits = wide[:, :vocab]  # rows vocab + 7 apart
    logits[1, :: max(1, vocab // 3)] = float("-inf")
    logits[2] = logits[2].round()  # ties everywhere: the first maximum wins
    top = logits[3].max()
    logits[3, vocab - 1] = logits[3, min(3, vocab - 1)] = top + 1  # a tie between a vector lane and the tail
    lse, argmax = row_stats_cpu(native_lib, logits)
    assert torch.equal(argmax, logits.argmax(dim=-1))
    torch.testing.assert_close(lse, torch.logsumexp(logits.double(), dim=-1), rtol=0, atol=3e-7)


def test_the_sampler_reports_log_softmax_logprobs_through_them(native_lib):
    logits = torch.randn(3, 49152, generator=torch.Generator().manual_seed(1)) * 4
    params = [SamplingParams(temperature=0, top_logprobs=3), SamplingParams(temperature=0), SamplingParams(temperature=0)]
    result = sampler.sample(logits, params, [None] * 3)
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    assert result.token_ids == logits.argmax(dim=-1).tolist()
    assert result.logprobs == pytest.approx(logprobs.max(dim=-1).values.tolist(), abs=3e-7)
    best = logprobs[0].topk(3)
    assert [t for t, _ in result.top_logprobs[0]] == best.indices.tolist()
    assert [v for _, v in result.top_logprobs[0]] == pytest.approx(best.values.tolist(), abs=3e-7)
