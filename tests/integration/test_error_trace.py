"""Every failure leaves a trace: a request that fails after its stream has started (status 200 sent) reaches
the client as an error event before ``[DONE]``, and the worker logs one line naming the request, its PD room
and the reason. Here a decode worker's prefill peer is unreachable, over real processes."""
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


@pytest.mark.parametrize("path,body", [
    ("/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 4}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "model": "m"}),
])
def test_failed_stream_ends_with_an_error_event_and_one_log_line(decode, path, body):
    rid, room = f"trace-{path.strip('/').replace('/', '-')}", 424242 + len(path)
    closed = free_port()  # nothing listens here: the handshake cannot connect
    before = decode.metric("decode_worker_requests_total", outcome="error", default=0.0)
    full = {**body, "rid": rid, "stream": True, "bootstrap_host": "127.0.0.1", "bootstrap_port": closed,
            "bootstrap_room": room}
    with httpx.stream("POST", decode.url + path, json=full, timeout=30) as resp:
        assert resp.status_code == 200
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 502 and "prefill handshake" in error["message"], error
    assert decode.metric("decode_worker_requests_total", outcome="error") == before + 1
    lines = [line for line in decode.log.read_text().splitlines() if rid in line]
    assert len(lines) == 1, lines
    assert f"room {room}" in lines[0] and "502" in lines[0] and "prefill handshake" in lines[0], lines[0]
