"""What one client can send to a real worker, and what it must not cost anyone else (docs/security.md, "What a
client may cost"): each case was reproduced against a real worker before its fix."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.servers import Proc, start_worker
from tests.tiny_model import save_tiny_chat_model

LONG = {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def worker(tmp_path_factory) -> Iterator[Proc]:
    model = save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))
    proc = start_worker("hostile", tmp_path_factory.mktemp("hostile-logs"), "colocated", "--model-path", str(model))
    yield proc
    proc.stop()


def in_background(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}
    thread = threading.Thread(target=lambda: out.setdefault("value", fn()))
    thread.start()
    return thread, out


def test_a_number_that_breaks_the_step_is_refused_and_costs_the_neighbour_nothing(worker):
    """A denormal repetition penalty once passed `> 0` and made the shared decode step raise: every live request
    got 500. Now it is refused by name, and the request decoding beside it finishes untouched."""
    thread, long = in_background(lambda: httpx.post(worker.url + "/generate", timeout=120,
                                                    json={"text": "0", "sampling_params": LONG}))
    bad = httpx.post(worker.url + "/generate", timeout=60,
                     json={"text": "0", "sampling_params": {"repetition_penalty": 5e-324, "max_new_tokens": 8}})
    thread.join()
    assert bad.status_code == 400 and "repetition_penalty" in bad.json()["error"]["message"], bad.text
    assert long["value"].status_code == 200, long["value"].text
    assert len(long["value"].json()["output_ids"]) == LONG["max_new_tokens"]
