"""What a worker refuses before a route runs, over a real process: the API key, the body size cap and deadline,
and the cap on generation requests in flight. Every refusal is the project's JSON error, never a hang or a 500;
a client that stalls holds no slot."""
from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.servers import Proc, start_worker
from tests.tiny_model import save_tiny_chat_model

KEY = "test-key-0123"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_CAP = 4096
OPEN = {"/health", "/health_generate", "/metrics"}
LONG = {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}
BODY_TIMEOUT_S = 3


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def guarded(tmp_path_factory, tiny_chat_model) -> Iterator[Proc]:
    proc = start_worker("guarded", tmp_path_factory.mktemp("guard-logs"), "colocated", "--model-path",
                        str(tiny_chat_model), "--max-request-body-bytes", str(BODY_CAP),
                        "--max-concurrent-requests", "2", "--request-body-timeout-s", str(BODY_TIMEOUT_S),
                        env={"DECODE_WORKER_API_KEY": KEY, "DECODE_WORKER_PD_TOKEN": "pd-secret"})
    yield proc
    proc.stop()


def assert_error(resp: httpx.Response, status: int, fragment: str) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["code"] == status and err["type"] and fragment in err["message"], err
    return err


def routes(proc: Proc) -> list[tuple[str, str]]:
    schema = httpx.get(proc.url + "/openapi.json", headers=AUTH, timeout=10).json()
    return [(method.upper(), path) for path, ops in schema["paths"].items() for method in ops]


# ---- API key ------------------------------------------------------------------------------------------------------


def test_every_route_but_the_probes_needs_the_key(guarded):
    found = routes(guarded)
    assert len(found) >= 14
    for method, path in found:
        body = {} if method == "POST" else None
        resp = httpx.request(method, guarded.url + path, json=body, timeout=30)
        if path in OPEN:
            assert resp.status_code == 200, (path, resp.text)
            continue
        assert_error(resp, 401, "missing API key")
        assert resp.headers["www-authenticate"] == "Bearer"
        wrong = httpx.request(method, guarded.url + path, json=body, timeout=30,
                              headers={"Authorization": "Bearer " + KEY[:-1]})
        assert_error(wrong, 401, "invalid API key")
        ok = httpx.request(method, guarded.url + path, json=body, timeout=30, headers=AUTH)
        assert ok.status_code != 401, (path, ok.text)
    assert_error(httpx.get(guarded.url + "/openapi.json", timeout=10), 401, "API key")


def test_key_scheme_and_form(guarded):
    for header in (f"bearer {KEY}", f"Bearer  {KEY}"):
        assert httpx.get(guarded.url + "/get_load", headers={"Authorization": header}).status_code == 200, header
    for header in (KEY, f"Basic {KEY}", f"Bearer {KEY}x", "Bearer"):
        assert_error(httpx.get(guarded.url + "/get_load", headers={"Authorization": header}), 401, "invalid API key")


def test_server_info_shows_no_secret(guarded):
    text = httpx.get(guarded.url + "/server_info", headers=AUTH, timeout=10).text
    assert KEY not in text and "pd-secret" not in text and "api_key" not in text


def test_official_openai_client_with_the_key(guarded):
    from openai import AuthenticationError, OpenAI

    client = OpenAI(base_url=guarded.url + "/v1", api_key=KEY)
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0)
    assert chat.usage.completion_tokens == 4
    streamed = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=4, temperature=0, stream=True))
    assert streamed[-1].choices[0].finish_reason == "length"
    comp = client.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0)
    assert comp.usage.completion_tokens == 3
    assert len(list(client.completions.create(model=model, prompt="Hello", max_tokens=3, stream=True))) == 3
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=guarded.url + "/v1", api_key="wrong", max_retries=0).completions.create(
            model=model, prompt="Hello", max_tokens=3)


# ---- body size ----------------------------------------------------------------------------------------------------


def test_body_over_the_cap_is_refused_with_413(guarded):
    small = {"text": "x" * 100, "sampling_params": {"max_new_tokens": 2}}
    assert httpx.post(guarded.url + "/generate", json=small, headers=AUTH, timeout=30).status_code == 200
    big = {"text": "x" * BODY_CAP, "sampling_params": {"max_new_tokens": 2}}
    assert_error(httpx.post(guarded.url + "/generate", json=big, headers=AUTH, timeout=30), 413,
                 "--max-request-body-bytes")

    def chunks():  # no Content-Length: the cap must hold while the body streams in
        for _ in range(4):
            yield b" " * (BODY_CAP // 2)

    resp = httpx.post(guarded.url + "/v1/completions", content=chunks(), timeout=30,
                      headers={**AUTH, "content-type": "application/json"})
    assert "content-length" not in resp.request.headers
    assert_error(resp, 413, "--max-request-body-bytes")
    assert httpx.get(guarded.url + "/health").status_code == 200


def test_unauthenticated_big_body_gets_401_first(guarded):
    resp = httpx.post(guarded.url + "/generate", content=b"x" * (BODY_CAP * 4), timeout=30)
    assert_error(resp, 401, "missing API key")


# ---- concurrency --------------------------------------------------------------------------------------------------


def test_past_the_concurrency_cap_generation_answers_503_with_retry_after(guarded):
    opened: list[tuple[httpx.Response, Iterator[str]]] = []
    client = httpx.Client(timeout=60, headers=AUTH)
    try:
        for i in range(2):  # fill both slots with streams that are surely still running
            resp = client.send(client.build_request("POST", guarded.url + "/generate", json={
                "text": f"stream {i}", "stream": True, "sampling_params": LONG}), stream=True)
            assert resp.status_code == 200
            lines = resp.iter_lines()  # kept: a dropped line iterator closes its response
            next(lines)
            opened.append((resp, lines))
        for path, body in (("/generate", {"text": "one more", "sampling_params": {"max_new_tokens": 2}}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})):
            refused = client.post(guarded.url + path, json=body)
            assert_error(refused, 503, "--max-concurrent-requests 2")
            assert refused.headers["retry-after"] == "1"
        assert client.get(guarded.url + "/get_load").json()["num_reqs"] == 2  # other routes are not capped
    finally:
        for resp, _ in opened:
            resp.close()  # the client leaves: the server aborts the stream and frees its slot
    deadline = time.monotonic() + 15
    while True:
        resp = client.post(guarded.url + "/generate", json={"text": "again", "sampling_params": {"max_new_tokens": 2}})
        if resp.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert resp.status_code == 200, resp.text
    client.close()


def test_every_sequence_of_a_batch_or_of_n_takes_a_slot(guarded):
    """A batch of prompts, or n samples, once ran any number of sequences on one slot."""
    with httpx.Client(timeout=60, headers=AUTH) as client:
        for path, body in (("/generate", {"text": ["a", "b", "c"], "sampling_params": {"max_new_tokens": 2}}),
                           ("/v1/completions", {"prompt": "a", "n": 3, "max_tokens": 2})):
            assert_error(client.post(guarded.url + path, json=body), 400, "fans out to 3 sequences")
        pair = {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 2}}
        assert client.post(guarded.url + "/generate", json=pair).status_code == 200
        resp = client.send(client.build_request("POST", guarded.url + "/generate", json={
            "text": "busy", "stream": True, "sampling_params": LONG}), stream=True)
        try:
            lines = resp.iter_lines()
            next(lines)  # one slot taken until the stream ends
            refused = client.post(guarded.url + "/generate", json=pair)
            assert_error(refused, 503, "sequence slots taken")
            assert refused.headers["retry-after"] == "1"
        finally:
            resp.close()


def test_many_clients_at_once_get_200_or_503_never_a_hang(guarded):
    statuses: list[int] = []

    def one(i: int) -> None:
        r = httpx.post(guarded.url + "/generate", headers=AUTH, timeout=60,
                       json={"text": f"client {i}", "sampling_params": {"max_new_tokens": 64, "ignore_eos": True}})
        statuses.append(r.status_code)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert len(statuses) == 12 and set(statuses) <= {200, 503} and 200 in statuses, statuses


# ---- stalled clients ----------------------------------------------------------------------------------------------


def raw_post(proc: Proc, path: str, body: bytes, sent: int) -> socket.socket:
    """A POST whose headers announce ``body`` but of which only the first ``sent`` bytes go out."""
    host, port = proc.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    sock.sendall(head.encode() + body[:sent])
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def test_stalled_uploads_hold_no_slot_and_get_408(guarded):
    """Two slow uploads (one trickling a byte at a time), a client that half-closes mid-body, one that vanishes
    mid-body and 50 idle keep-alive sockets, on a worker with 2 generation slots: /generate still answers 200,
    and the stalled uploads get 408 once the deadline passes, their connections closed."""
    body = json.dumps({"text": "stalled", "sampling_params": {"max_new_tokens": 2}}).encode()
    slow = [raw_post(guarded, "/generate", body, 10) for _ in range(2)]
    vanished = raw_post(guarded, "/v1/completions", body, 5)
    half_closed = raw_post(guarded, "/generate", body, 5)
    half_closed.shutdown(socket.SHUT_WR)
    idle = []
    for _ in range(50):
        sock = socket.create_connection(guarded.url.removeprefix("http://").split(":"), timeout=30)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # keep-alive: the socket stays open
        idle.append(sock)
    started = time.monotonic()
    stop = threading.Event()

    def trickle():  # a byte every 0.2 s: each arrives well within any per-read timeout, never the whole body
        sent = 10
        while not stop.is_set() and sent < len(body) - 1:
            try:
                slow[0].sendall(body[sent:sent + 1])
            except OSError:
                return
            sent += 1
            time.sleep(0.2)

    threading.Thread(target=trickle, daemon=True).start()
    try:
        with httpx.Client(timeout=30, headers=AUTH) as client:
            for i in range(3):
                resp = client.post(guarded.url + "/generate", json={"text": f"ok {i}", "sampling_params": {"max_new_tokens": 2}})
                assert resp.status_code == 200, resp.text
        assert time.monotonic() - started < BODY_TIMEOUT_S  # served while every stalled client was still stalled
        for sock in slow + [vanished]:
            status, headers, payload = read_response(sock)
            assert status == 408 and headers.get("connection") == "close", (status, headers, payload)
            assert "--request-body-timeout-s" in json.loads(payload)["error"]["message"]
        assert time.monotonic() - started < BODY_TIMEOUT_S + 5
        half_closed.settimeout(BODY_TIMEOUT_S + 5)
        assert half_closed.recv(65536) == b""  # a client that left gets nothing, and its socket is closed
    finally:
        stop.set()
        for sock in slow + [vanished, half_closed] + idle:
            sock.close()
    assert httpx.get(guarded.url + "/get_load", headers=AUTH, timeout=10).json()["num_reqs"] == 0


def test_health_generate_costs_at_most_one_request_a_second(guarded):
    """/health_generate is open and uncounted: 40 callers at once share one probe's outcome."""
    before = guarded.metric("decode_worker_requests_total", outcome="ok", default=0.0)
    statuses: list[int] = []

    def probe() -> None:
        statuses.append(httpx.get(guarded.url + "/health_generate", timeout=60).status_code)

    threads = [threading.Thread(target=probe) for _ in range(40)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    elapsed = time.monotonic() - started
    assert statuses == [200] * 40
    probes = guarded.metric("decode_worker_requests_total", outcome="ok") - before
    assert 1 <= probes <= 1 + elapsed // 1.0, (probes, elapsed)
