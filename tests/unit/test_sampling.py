"""Sampling modes and stop conditions."""
from __future__ import annotations

import pytest
import torch

from decode_worker.core.sampling import MAX_TEMPERATURE, SamplingParams
from decode_worker.core.sequence import Sequence, check_finish, trim_stop_string
from decode_worker.model.sampler import Shaping, make_generator, sample


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
    "field,value", [("max_new_tokens", -1), ("temperature", -1.0), ("top_p", 0.0), ("top_k", 0),
                    ("frequency_penalty", 2.5), ("presence_penalty", -3), ("repetition_penalty", 0.0),
                    ("repetition_penalty", 5e-324), ("temperature", float("nan")),
                    ("min_new_tokens", 500), ("top_logprobs", 21)]
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


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -0.5, 1.3e308])
def test_temperature_must_be_finite_and_not_negative(temperature):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=temperature).validate()


def test_the_hottest_temperature_allowed_keeps_masked_tokens_out_of_a_seeded_draw():
    """1.3e308 (finite in float64) was inf in float32: a mask's -inf logits became NaN and the seeded draw raised.
    At the bound the allowed tokens are as good as uniform and the masked ones never drawn."""
    logits = torch.randn(1, 50)
    logits[0, 10:] = float("-inf")
    params = SamplingParams(temperature=MAX_TEMPERATURE, seed=1)
    params.validate()
    picks = {sample(logits, [params], [make_generator(i, torch.device("cpu"))]).token_ids[0] for i in range(40)}
    assert picks <= set(range(10)) and len(picks) > 5


def test_a_temperature_next_to_zero_is_greedy():
    """Dividing logits by 1e-300 overflows them to inf and the sampler would fail the whole batch with NaN."""
    logits = torch.randn(2, 50)
    params = [SamplingParams(temperature=1e-300), SamplingParams(temperature=0)]
    result = sample(logits, params, [None, None])
    assert result.token_ids == logits.argmax(-1).tolist()


GREEDY = dict(temperature=0)


def pick(logits: list[float], shaping: Shaping, **params) -> tuple[int, float]:
    row = torch.tensor([logits])
    res = sample(row, [SamplingParams(**GREEDY, **params)], [None], [shaping])
    return res.token_ids[0], res.logprobs[0]


def test_frequency_and_presence_penalties_count_the_output_and_logprobs_stay_unmodified():
    logits = [2.0, 1.6, 0.0]
    seen_twice = Shaping(output_ids=[0, 0], context_ids=[], banned=[])
    assert pick(logits, seen_twice)[0] == 0  # no penalty asked: the shaping changes nothing
    assert pick(logits, seen_twice, frequency_penalty=0.1)[0] == 0  # 2.0 - 2 * 0.1 = 1.8 > 1.6
    assert pick(logits, seen_twice, frequency_penalty=0.3)[0] == 1  # 2.0 - 0.6 = 1.4 < 1.6
    assert pick(logits, seen_twice, presence_penalty=0.3)[0] == 0  # once, whatever the count: 1.7 > 1.6
    token, logprob = pick(logits, seen_twice, presence_penalty=0.5)
    assert token == 1 and logprob == pytest.approx(torch.log_softmax(torch.tensor(logits), 0)[1].item())


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_the_context():
    assert pick([2.0, 1.5], Shaping([], context_ids=[0], banned=[]), repetition_penalty=1.5)[0] == 1  # 2 / 1.5 < 1.5
    assert pick([-1.0, -1.2], Shaping([], context_ids=[0], banned=[]), repetition_penalty=1.5)[0] == 1  # -1.5 < -1.2
    assert pick([2.0, 1.5], Shaping([], context_ids=[1], banned=[]), repetition_penalty=1.5)[0] == 0


def test_banned_tokens_are_never_picked_even_when_sampling():
    row = torch.tensor([[5.0, 0.0, 0.0]])
    g = make_generator(1, torch.device("cpu"))
    picks = {sample(row, [SamplingParams(temperature=2.0, min_new_tokens=1)], [g], [Shaping([], [], [0])]).token_ids[0]
             for _ in range(50)}
    assert 0 not in picks


def test_top_logprobs_are_each_rows_best_alternatives_under_the_model():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [1.0, 0.0, 0.0, 0.0]])
    res = sample(logits, [SamplingParams(**GREEDY, top_logprobs=3), SamplingParams(**GREEDY)], [None, None])
    expected = torch.log_softmax(logits[0], 0)
    assert [t for t, _ in res.top_logprobs[0]] == [1, 3, 2]
    assert [lp for _, lp in res.top_logprobs[0]] == pytest.approx([expected[i].item() for i in (1, 3, 2)])
    assert res.top_logprobs[1] == []


def test_no_stop_before_min_new_tokens():
    params = SamplingParams(max_new_tokens=10, min_new_tokens=3, stop=["b"], stop_token_ids=[9])
    seq = Sequence("r", [1], params)
    for token in (9, 9):
        seq.output_ids.append(token)
        check_finish(seq, (2,), 100, lambda ids: "b" * len(ids))
        assert seq.finish_reason is None
    seq.output_ids.append(9)
    check_finish(seq, (2,), 100, lambda ids: "")
    assert seq.finish_reason == {"type": "stop", "matched": 9}
