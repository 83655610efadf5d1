"""The logprobs a prefill's handshake answer carries are input like its other fields: each bad one is refused
naming it, and decode takes them only when they are the ones its request asked for."""
from __future__ import annotations

import pytest

from decode_worker.pd.handshake import Answer, BadAnswer
from tests.unit.test_handshake_answer import ASKED, good  # a 40-token prompt, vocabulary 1000

TOP = [[7, -0.1], [42, -0.25]]


def scored(start: int = 38, k: int = 2) -> dict:
    """A good answer scoring the prompt from ``start`` with ``k`` alternatives per token."""
    n = ASKED.prompt_len - start
    logprobs = [None if start + i == 0 else -1.5 for i in range(n)]
    top = [[] if start + i == 0 else [[3, -0.5], [4, -1.5]][:k] for i in range(n)]
    return {**good(), "top_logprobs": TOP[:k], "prompt_logprobs": {"start": start, "logprobs": logprobs, "top": top}}


def test_good_logprobs_round_trip_and_are_what_the_request_asked_for():
    for start in (0, 1, 38):
        a = Answer.from_json(scored(start), ASKED)
        again = Answer.from_json({**a.to_json(), "pool": good()["pool"]}, ASKED)
        assert again.prompt_logprobs == a.prompt_logprobs and again.top_logprobs == a.top_logprobs == [(7, -0.1),
                                                                                                      (42, -0.25)]
        first = a.prefilled(start, 2)
        assert first.token == 42 and first.prompt.start == start and len(first.prompt.logprobs) == 40 - start
    plain = Answer.from_json(good(), ASKED)  # an answer without them: nothing asked, nothing carried
    assert plain.prefilled(None, 0).prompt is None and plain.prefilled(None, 0).top == []


def edit(d: dict, path: str, value) -> dict:
    *outer, last = path.split(".")
    target = d
    for key in outer:
        target = target[key]
    target[last] = value
    return d


BAD = [
    ("top_logprobs", [[1000, -0.1]]), ("top_logprobs", [[7, 0.5]]), ("top_logprobs", [[7, float("nan")]]),
    ("top_logprobs", [[7]]), ("top_logprobs", [[7, -0.1]] * 21), ("top_logprobs", "7"),
    ("prompt_logprobs", [1, 2]), ("prompt_logprobs.start", 40), ("prompt_logprobs.start", -1),
    ("prompt_logprobs", {"start": 38, "logprobs": [-1.0], "top": [[]]}),  # one token short
    ("prompt_logprobs.logprobs", [-1.0, 0.1]), ("prompt_logprobs.logprobs", [None, -1.0]),
    ("prompt_logprobs.logprobs", [-1.0, float("-inf")]), ("prompt_logprobs.top", [[[3, -0.5]], [[1000, -0.5]]]),
]


@pytest.mark.parametrize(("field", "value"), BAD, ids=[f"{f}={v!r}"[:60] for f, v in BAD])
def test_each_bad_logprob_field_is_refused_by_name(field, value):
    with pytest.raises(BadAnswer) as e:
        Answer.from_json(edit(scored(), field, value), ASKED)
    assert e.value.field.startswith(field.split(".")[0])


def test_a_first_token_with_alternatives_is_refused():
    d = scored(0)
    d["prompt_logprobs"]["top"][0] = [[3, -0.5]]
    with pytest.raises(BadAnswer, match="first token"):
        Answer.from_json(d, ASKED)


@pytest.mark.parametrize(("start", "k", "field"), [(None, 2, "prompt_logprobs"), (37, 2, "prompt_logprobs"),
                                                   (38, 1, "top_logprobs"), (38, 3, "top_logprobs")])
def test_logprobs_other_than_the_request_asked_for_are_refused(start, k, field):
    """A prefill that scored another start or width answered another request (or is another version)."""
    with pytest.raises(BadAnswer) as e:
        Answer.from_json(scored(), ASKED).prefilled(start, k)
    assert e.value.field == field
    with pytest.raises(BadAnswer):
        Answer.from_json(good(), ASKED).prefilled(0, 0)  # asked for, not carried
