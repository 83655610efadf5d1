"""``n`` choices in a PD pair: each its own room, whether the router sent one room per prompt or one per choice."""
from __future__ import annotations

import re

import pytest

from decode_worker.config import ServerConfig
from decode_worker.core.request import Bootstrap, GenerateInput, RequestError
from decode_worker.core.sampling import SamplingParams
from decode_worker.server.inputs import bootstrap_per_choice, choice_inputs, choice_room
from decode_worker.server.schemas import ChatCompletionRequest, CompletionRequest

CFG = ServerConfig(role="decode", bootstrap_port=9000)
MESSAGES = [{"role": "user", "content": "hi"}]


def test_a_room_per_prompt_gives_each_choice_its_own_derived_room_alike_on_both_sides():
    body = CompletionRequest(prompt="hi", n=3, bootstrap_host="10.0.0.1", bootstrap_room=42)
    assert bootstrap_per_choice(body, 1, 3) is False
    inp = GenerateInput("r", [1, 2], SamplingParams(seed=5), bootstrap=Bootstrap("10.0.0.1", 9000, 42))
    out = choice_inputs(inp, 3, body, None, CFG)
    rooms = [c.bootstrap.room for c in out]
    assert rooms[0] == 42 and len(set(rooms)) == 3 and all(0 <= r < 2**64 for r in rooms)
    assert rooms == [choice_room(42, j) for j in range(3)]  # what the prefill worker, given the same body, derives
    assert [c.rid for c in out] == ["r-0", "r-1", "r-2"] and [c.params.seed for c in out] == [5, 6, 7]


def test_a_room_per_choice_is_used_as_sent():
    body = ChatCompletionRequest(messages=MESSAGES, n=2, bootstrap_host=["h1", "h2"], bootstrap_port=[1, 2],
                                 bootstrap_room=[7, 8])
    assert bootstrap_per_choice(body, 1, 2) is True
    out = choice_inputs(GenerateInput("c", [1], SamplingParams()), 2, body, 0, CFG)
    assert [c.bootstrap for c in out] == [Bootstrap("h1", 1, 7), Bootstrap("h2", 2, 8)]
    batch = CompletionRequest(prompt=["a", "b"], n=2, bootstrap_host="h", bootstrap_room=[1, 2, 3, 4])
    assert bootstrap_per_choice(batch, 2, 4) is True
    second = choice_inputs(GenerateInput("p1", [1], SamplingParams()), 2, batch, 2, CFG)
    assert [c.bootstrap.room for c in second] == [3, 4]


def test_without_bootstrap_choices_are_plain_samples():
    body = CompletionRequest(prompt="hi", n=2)
    assert bootstrap_per_choice(body, 1, 2) is False
    out = choice_inputs(GenerateInput("x", [1], SamplingParams()), 2, body, None, CFG)
    assert [c.bootstrap for c in out] == [None] * 2


@pytest.mark.parametrize("fields,fragment", [
    ({"bootstrap_room": [1, 2]}, "bootstrap_room has 2 entries: give 1 (one per prompt) or 3 (one per choice)"),
    ({"bootstrap_room": [1, 2, 3], "bootstrap_host": ["a"]}, "as many entries each"),
])
def test_other_list_lengths_are_refused_by_name(fields, fragment):
    body = CompletionRequest(prompt="hi", n=3, **{"bootstrap_host": "h", **fields})
    with pytest.raises(RequestError, match=re.escape(fragment)):
        bootstrap_per_choice(body, 1, 3)
