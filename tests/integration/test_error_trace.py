"""Every failure leaves a trace: a request that fails after its stream has started (status 200 sent) ends each
of its choices with a last chunk whose finish reason is an abort (SGLang's ``{"type": "abort", ...}`` on
``/generate``, ``content_filter`` on the OpenAI routes), then an error event before ``[DONE]``, and the worker
logs one line naming the request, its PD room and the reason. Here a decode worker's prefill peer is unreachable,
and a colocated worker's request is aborted while its tokens stream, over real processes."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.servers import free_port, start_worker
from tests.tiny_model import save_tiny_chat_model


@pytest.fixture(scope="module")
def decode(tmp_path_factory):
    model = save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))
    proc = start_worker("decode", tmp_path_factory.mktemp("trace-logs"), "decode", "--model-path", str(model),
                        "--handshake-timeout-s", "5")
    yield proc
    proc.stop()


def _events(url: str, body: dict) -> list[str]:
    with httpx.stream("POST", url, json=body, timeout=30) as resp:
        assert resp.status_code == 200
        return [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]


def _finish_reasons(path: str, chunks: list[dict]) -> dict[int, object]:
    """Each choice's finish reason, from the chunks that carry one."""
    if path == "/generate":
        return {c.get("index", 0): c["meta_info"]["finish_reason"] for c in chunks if c["meta_info"]["finish_reason"]}
    return {ch["index"]: ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]}


@pytest.mark.parametrize("path,body", [
    ("/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 4}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "model": "m"}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "model": "m", "n": 2}),
])
def test_failed_stream_ends_with_an_error_event_and_one_log_line(decode, path, body):
    rid, room = f"trace-{path.strip('/').replace('/', '-')}", 424242 + len(path)
    closed = free_port()  # nothing listens here: the handshake cannot connect
    before = decode.metric("decode_worker_requests_total", outcome="error", default=0.0)
    full = {**body, "rid": rid, "stream": True, "bootstrap_host": "127.0.0.1", "bootstrap_port": closed,
            "bootstrap_room": room}
    events = _events(decode.url + path, full)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 502 and "prefill handshake" in error["message"], error
    choices = body.get("n", 1)
    chunks = [json.loads(e) for e in events[:-2]]
    reasons = _finish_reasons(path, chunks)
    assert sorted(reasons) == list(range(choices)), events  # every choice ends, once
    if path == "/generate":
        assert reasons[0] == {"type": "abort", "message": error["message"], "status_code": 502}
    else:
        assert set(reasons.values()) == {"content_filter"}, reasons
        last = chunks[-choices:]  # the finish chunks are the last choice chunks, right before the error
        assert all(c["choices"][0]["finish_reason"] for c in last), last
    assert decode.metric("decode_worker_requests_total", outcome="error") == before + choices
    lines = [line for line in decode.log.read_text().splitlines() if rid in line]
    assert len(lines) == choices, lines
    assert all("room" in line and "502" in line and "prefill handshake" in line for line in lines), lines

