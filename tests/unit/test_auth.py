"""The two credential checks, alone: the API key's bearer header and the PD pair's token header."""
from __future__ import annotations

import pytest

from decode_worker.server.guard import bearer_matches
from decode_worker.core.request import RequestError
from decode_worker.pd.prefill import check_pd_token


@pytest.mark.parametrize("header,ok", [
    ("Bearer k3y", True), ("bearer k3y", True), ("BEARER  k3y ", True),
    (None, False), ("", False), ("k3y", False), ("Basic k3y", False), ("Bearer k3", False), ("Bearer k3yy", False),
    ("Bearer", False), ("Bearer ", False),
])
def test_bearer(header, ok):
    assert bearer_matches(header, "k3y") is ok


@pytest.mark.parametrize("expected,given,fragment", [
    ("T", None, "missing X-PD-Token"),
    ("T", "", "missing X-PD-Token"),
    ("T", "U", "does not match"),
    ("T", "TT", "does not match"),
    ("", "T", "has no --pd-token"),
])
def test_pd_token_refusals(expected, given, fragment):
    with pytest.raises(RequestError, match=fragment) as caught:
        check_pd_token(expected, given)
    assert caught.value.status == 401


@pytest.mark.parametrize("expected,given", [("T", "T"), ("", None), ("", "")])
def test_pd_token_accepted(expected, given):
    check_pd_token(expected, given)
