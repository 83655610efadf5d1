"""What one client can send to a real worker, and what it must not cost anyone else (docs/security.md, "What a
client may cost"): each case was reproduced against a real worker before its fix."""
from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.faultkit import Faults, start_faulty
from tests.servers import Proc, start_worker
from tests.tiny_model import save_tiny_chat_model

LONG = {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def worker(tmp_path_factory) -> Iterator[Proc]:
    model = save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"), max_context=8192)
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


def test_a_refused_grammar_sent_again_and_again_holds_no_memory(worker):
    """The cache re-raised one exception per refused grammar, each raise adding a frame that kept that request's
    grammar text alive: a repeated 200 KB regex grew the worker by its size every time."""
    body = {"text": "0", "sampling_params": {"regex": "(" + "a" * 200_000, "max_new_tokens": 4}}
    with httpx.Client(base_url=worker.url, timeout=60) as client:
        for _ in range(5):  # the cache entry and allocator pools settle
            assert client.post("/generate", json=body).status_code == 400
        before = worker.memory_bytes()
        for _ in range(60):
            r = client.post("/generate", json=body)
            assert r.status_code == 400 and "cannot compile the regex" in r.json()["error"]["message"], r.text
    assert worker.memory_bytes() - before < 6 << 20, "60 refusals of a 200 KB regex held on to their texts"


def test_a_schema_nested_too_deep_is_refused_at_once_and_other_grammars_compile(worker):
    """Two schemas of arrays nested ~1000 deep held the one compile thread for minutes: every grammar request
    answered 503. Nesting is bounded before anything queues."""
    deep = '{"type": "array", "items": ' * 1000 + "{}" + "}" * 1000
    heavy = [in_background(lambda: httpx.post(worker.url + "/generate", timeout=60, json={
        "text": "0", "sampling_params": {"json_schema": deep, "max_new_tokens": 4}})) for _ in range(2)]
    ok = httpx.post(worker.url + "/generate", timeout=60,
                    json={"text": "0", "sampling_params": {"regex": "[0-9]{3}", "max_new_tokens": 8}})
    assert ok.status_code == 200 and len(ok.json()["text"]) == 3, ok.text
    for thread, out in heavy:
        thread.join()
        r = out["value"]
        assert r.status_code == 400 and "nests deeper than" in r.json()["error"]["message"], r.text


TOOLS = [{"type": "function", "function": {"name": "alarm", "parameters": {
    "type": "object", "properties": {"on": {"type": "string"}}, "required": ["on"]}}}]
MESSAGES = [{"role": "user", "content": "Alarm?"}]


def test_a_call_nested_past_the_json_parser_is_content_not_a_500(worker):
    body = {"messages": MESSAGES, "tools": TOOLS, "regex": r"<tool_call>\[{1200}", "max_tokens": 1300}
    r = httpx.post(worker.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["content"] == "<tool_call>" + "[" * 1200 and not message.get("tool_calls")


def streamed_chat(proc: Proc, body: dict) -> tuple[float, list[dict]]:
    import json
    import time

    deltas, start = [], time.monotonic()
    with httpx.stream("POST", proc.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                deltas += [c["delta"] for c in json.loads(line[6:])["choices"]]
    return time.monotonic() - start, deltas


@pytest.mark.slow  # two ~4,000-token streams (~40 s); test_tool_calls.py checks the reader's scaling in the default run
def test_a_long_streamed_call_is_read_in_time_linear_in_its_length(worker):
    """Each delta inside an open call re-read the whole body once per end tag inside its strings, on the event
    loop: a 4,000-token call took several times as long to stream as the same text without tools. Now the same."""
    regex = r'<tool_call>\{"name": "alarm", "arguments": \{"on": "(</tool_call>){330}"\}\}</tool_call>'
    body = {"messages": MESSAGES, "regex": regex, "max_tokens": 4100, "temperature": 0}
    plain_s, plain = streamed_chat(worker, body)
    tools_s, deltas = streamed_chat(worker, {**body, "tools": TOOLS})
    assert "".join(d.get("content") or "" for d in plain).count("</tool_call>") == 331
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    arguments = "".join(c["function"].get("arguments", "") for c in calls)
    assert calls[0]["function"]["name"] == "alarm" and arguments == '{"on": "' + "</tool_call>" * 330 + '"}'
    assert not any(d.get("content") for d in deltas)
    assert tools_s < 1.5 * plain_s + 1, (tools_s, plain_s)


def test_a_grammar_whose_work_grows_with_its_output_ends_and_the_neighbour_finishes(worker):
    """`((x|y)*)*z` grows xgrammar's work with every token (about 10 ms a token after 200, 80 ms after 400, on the
    step every request shares); past its budget the request ends with an abort that says why. The equivalent
    `[xy]*z` keeps working to its length."""
    ask = {"max_new_tokens": 1000, "temperature": 0}
    thread, neighbour = in_background(lambda: httpx.post(worker.url + "/generate", timeout=120, json={
        "text": "0", "sampling_params": {**LONG, "max_new_tokens": 600}}))
    nested = httpx.post(worker.url + "/generate", timeout=300,
                        json={"text": "xyxy", "sampling_params": {"regex": "((x|y)*)*z", **ask}})
    thread.join()
    assert nested.status_code == 200, nested.text
    reason = nested.json()["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "ms a token" in reason["message"] and "regex" in reason["message"], reason
    assert neighbour["value"].status_code == 200 and len(neighbour["value"].json()["output_ids"]) == 600
    flat = httpx.post(worker.url + "/generate", timeout=300,
                      json={"text": "xyxy", "sampling_params": {"regex": "[xy]*z", **ask}})
    assert flat.status_code == 200 and flat.json()["meta_info"]["finish_reason"]["type"] != "abort", flat.text


def test_scoring_a_long_prompt_holds_a_slice_of_its_logits_not_all(tmp_path):
    """A 4,000-token prompt scored from position 0 built every position's float32 logits at once: 4,000 x 65,536
    x 4 B = 1 GiB at peak here (1.1 GiB with SmolLM2's vocabulary). Now a slice at a time."""
    model = save_tiny_chat_model(tmp_path / "wide", max_context=8192, vocab_size=65536)
    (tmp_path / "logs").mkdir()
    proc = start_worker("scoring", tmp_path / "logs", "colocated", "--model-path", str(model))
    try:
        ids = [random.Random(4).randrange(256) for _ in range(4000)]
        body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 0}}
        short = {**body, "input_ids": ids[:300]}
        with httpx.Client(base_url=proc.url, timeout=120) as client:
            assert client.post("/generate", json=short).status_code == 200  # allocator pools settle
            before = proc.memory_bytes("VmHWM")
            r = client.post("/generate", json=body)
        assert r.status_code == 200, r.text
        scored = r.json()["meta_info"]["input_token_logprobs"]
        assert len(scored) == 4000 and scored[0][0] is None and all(lp <= 0 for lp, *_ in scored[1:])
        assert proc.memory_bytes("VmHWM") - before < 256 << 20, "scoring held the whole prompt's logits at once"
    finally:
        proc.stop()


def test_a_step_that_raises_for_one_row_fails_that_request_alone(tmp_path):
    """Defence in depth: a step that raises (a bad row no check caught, a kernel error) failed every request in
    the batch with 500. The batch is now re-run in halves: the request at fault fails alone, its neighbours in the
    same decode batch finish with the tokens they get alone."""
    model = save_tiny_chat_model(tmp_path / "model")
    (tmp_path / "logs").mkdir()
    proc = start_faulty("poisoned", tmp_path / "logs", "colocated", Faults(poison_rid="poison", poison_after=3),
                        "--model-path", str(model))
    try:
        params = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}  # they outlive the poisoned one
        texts = [f"neighbour {i}" for i in range(3)]
        alone = [httpx.post(proc.url + "/generate", json={"text": t, "sampling_params": params}, timeout=60)
                 .json()["output_ids"] for t in texts]
        runs = [in_background(lambda t=t: httpx.post(proc.url + "/generate", timeout=60, json={
            "text": t, "sampling_params": params})) for t in texts]
        give_up = time.monotonic() + 30
        while proc.metric("decode_worker_running_requests") < 3 and time.monotonic() < give_up:
            time.sleep(0.01)
        poisoned = httpx.post(proc.url + "/generate", timeout=60, json={
            "text": "poisoned", "sampling_params": params, "rid": "poison"})
        answers = []
        for thread, out in runs:
            thread.join()
            answers.append(out["value"])
        assert poisoned.status_code == 500 and "this request's step" in poisoned.json()["error"]["message"]
        assert [a.status_code for a in answers] == [200] * 3, [a.text for a in answers]
        assert [a.json()["output_ids"] for a in answers] == alone
        assert proc.metric("decode_worker_step_failures_total", kind="decode") >= 2, "the poisoned row ran alone"
    finally:
        proc.stop()
