"""A prefill's handshake answer is input: every field is checked before decode uses any of it (issue 26).

Each bad field is refused with ``BadAnswer`` naming it; the good answer it was made from parses.
"""
from __future__ import annotations

import base64

import pytest

from decode_worker.pd.handshake import MAX_POOL_PAGES, Answer, Asked, BadAnswer

ASKED = Asked(room=77, prompt_len=40, page_size=16, page_bytes=4096, vocab_size=1000, round_trip_s=0.5)


def good() -> dict:
    return {"status": "ready", "room": 77, "lease": 3, "pages": [5, 9, 2], "first_token": 42, "logprob": -0.25,
            "pool": {"agent": "prefill-abc", "base": 1 << 20, "num_pages": 64, "page_bytes": 4096, "device": 0,
                     "mem": "DRAM"},
            "metadata": base64.b64encode(b"agent metadata").decode(), "hold_s": 30.0, "waited_s": 0.1}


def with_field(path: str, value) -> dict:
    d = good()
    *outer, last = path.split(".")
    target = d
    for key in outer:
        target = target[key]
    if value is KeyError:
        del target[last]
    else:
        target[last] = value
    return d


def test_a_good_answer_parses():
    a = Answer.from_json(good(), ASKED)
    assert (a.room, a.lease, a.pages, a.first_token, a.logprob) == (77, 3, [5, 9, 2], 42, -0.25)
    assert a.pool.num_pages == 64 and a.metadata == b"agent metadata"


BAD = [
    ("first_token", 1000), ("first_token", -1), ("first_token", 3.0), ("first_token", True), ("first_token", "7"),
    ("first_token", KeyError),
    ("logprob", 0.5), ("logprob", float("nan")), ("logprob", float("-inf")), ("logprob", "x"),
    ("pages", [5, 9]), ("pages", [5, 9, 2, 3]), ("pages", [5, 9, 64]), ("pages", [5, -1, 2]), ("pages", [5, 5, 2]),
    ("pages", [5, 9, 2.0]), ("pages", "5,9,2"),
    ("pool.page_bytes", 8192), ("pool.num_pages", 0), ("pool.num_pages", MAX_POOL_PAGES + 1),
    ("pool.base", -4096), ("pool.base", 1 << 64), ("pool.mem", "DISK"), ("pool.agent", ""), ("pool.device", -1),
    ("pool", [1, 2]),
    ("room", 78), ("room", -1), ("lease", -1), ("lease", None),
    ("hold_s", 0), ("hold_s", float("inf")), ("hold_s", -1.0),
    ("waited_s", 0.6), ("waited_s", -0.1),  # prefill cannot have waited longer than decode's round trip
    ("metadata", "not base64!"), ("metadata", 5), ("status", "busy"),
]


@pytest.mark.parametrize(("field", "value"), BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_each_bad_field_is_refused_by_name(field, value):
    with pytest.raises(BadAnswer) as e:
        Answer.from_json(with_field(field, value), ASKED)
    assert e.value.field == field
    assert str(e.value).startswith(field)


def test_pages_cover_a_prompt_that_ends_on_a_page_boundary():
    asked = Asked(room=77, prompt_len=48, page_size=16, page_bytes=4096, vocab_size=1000, round_trip_s=0.5)
    with pytest.raises(BadAnswer, match="3 pages"):
        Answer.from_json(with_field("pages", [1, 2, 3, 4]), asked)
    assert Answer.from_json(good(), asked).pages == [5, 9, 2]


def test_not_an_object():
    with pytest.raises(BadAnswer, match="answer"):
        Answer.from_json([1, 2, 3], ASKED)
