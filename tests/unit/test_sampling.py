"""Sampling modes and stop conditions."""
from __future__ import annotations

import pytest
import torch

from decode_worker.core.sampling import SamplingParams
from decode_worker.core.sequence import Sequence, check_finish, trim_stop_string
from decode_worker.model.sampler import make_generator, sample


def test_greedy_takes_argmax_and_reports_its_logprob():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 0.0]])
    res = sample(logits, [SamplingParams(temperature=0)] * 2, [None, None])
    assert res.token_ids == [1, 0]
    assert res.logprobs[0] == pytest.approx(torch.log_softmax(logits[0], 0)[1].item())


def test_top_k_one_is_greedy_and_top_p_keeps_only_the_head():
    logits = torch.tensor([[0.0, 5.0, 4.9, -1.0]])
    g = make_generator(0, torch.device("cpu"))
    picks = {sample(logits, [SamplingParams(temperature=1.0, top_p=0.5)], [g]).token_ids[0] for _ in range(50)}
    assert picks == {1}  # token 1 alone already holds > 50% of the mass
    picks = {sample(logits, [SamplingParams(temperature=1.0, top_k=2)], [g]).token_ids[0] for _ in range(200)}
    assert picks == {1, 2}


def test_seed_makes_sampling_reproducible():
    logits = torch.randn(1, 100)
    runs = [
        [sample(logits, [SamplingParams(temperature=1.0)], [g]).token_ids[0] for _ in range(20)]
        for g in (make_generator(7, torch.device("cpu")), make_generator(7, torch.device("cpu")))
    ]
    assert runs[0] == runs[1]


@pytest.mark.parametrize(
    "field,value", [("max_new_tokens", 0), ("temperature", -1.0), ("top_p", 0.0), ("top_k", 0)]
)
def test_invalid_params_are_rejected_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).validate()


def _seq(params, outputs):
    s = Sequence("r", [1, 2, 3], params)
    s.output_ids = outputs
    return s


def test_finish_reasons():
    eos = (2,)
    s = _seq(SamplingParams(), [5, 2])
    check_finish(s, eos, 100, lambda ids: "")
    assert s.finish_reason == {"type": "stop", "matched": 2}
    s = _seq(SamplingParams(ignore_eos=True, max_new_tokens=2), [5, 2])
    check_finish(s, eos, 100, lambda ids: "")
    assert s.finish_reason == {"type": "length", "length": 2}
    s = _seq(SamplingParams(stop_token_ids=[9]), [9])
    check_finish(s, eos, 100, lambda ids: "")
    assert s.finish_reason["matched"] == 9
    s = _seq(SamplingParams(stop=["END"]), [7])
    check_finish(s, eos, 100, lambda ids: "hello END there")
    assert s.finish_reason == {"type": "stop", "matched": "END"}
    assert trim_stop_string("hello END there", s.finish_reason) == "hello "
    s = _seq(SamplingParams(), [7])
    check_finish(s, eos, 4, lambda ids: "")
    assert s.finish_reason["type"] == "length"


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -0.5])
def test_temperature_must_be_finite_and_not_negative(temperature):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=temperature).validate()


def test_a_temperature_next_to_zero_is_greedy():
    """Dividing logits by 1e-300 overflows them to inf and the sampler would fail the whole batch with NaN."""
    logits = torch.randn(2, 50)
    params = [SamplingParams(temperature=1e-300), SamplingParams(temperature=0)]
    result = sample(logits, params, [None, None])
    assert result.token_ids == logits.argmax(-1).tolist()
