"""PD between real processes: the pair's token in the X-PD-Token header, and the batched bodies smg sends.

A token problem (wrong, or set on one side only) must fail the decode request at once with a message that says
which, never hang until a deadline or pass silently. A batched body pairs prompt i with room i, host i and port i,
and a null port means the decode worker's --bootstrap-port.
"""
from __future__ import annotations

import concurrent.futures
import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.servers import Proc, free_port, start_workers, wait_pages_free
from tests.tiny_model import save_tiny_chat_model

GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
HANDSHAKE_DEADLINE_S = 5
rooms = itertools.count(7000)


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def workers(tmp_path_factory, tiny_chat_model) -> Iterator[dict[str, Proc]]:
    """Prefills with token T, token U and none; decodes with token T (bootstrap default: the T prefill) and none."""
    logs = tmp_path_factory.mktemp("pd-auth-logs")
    model = ("--model-path", str(tiny_chat_model))
    prefill = model + ("--kv-lease-s", "3")
    prefill_t = free_port()
    decode = model + ("--handshake-timeout-s", str(HANDSHAKE_DEADLINE_S), "--transfer-timeout-s", "5",
                      "--bootstrap-port", str(prefill_t))
    procs = start_workers({"prefill-t": ("prefill", prefill, {"DECODE_WORKER_PD_TOKEN": "T"}),
                           "prefill-u": ("prefill", prefill, {"DECODE_WORKER_PD_TOKEN": "U"}),
                           "prefill-open": ("prefill", prefill, {"DECODE_WORKER_PD_TOKEN": ""}),
                           "decode-t": ("decode", decode, {"DECODE_WORKER_PD_TOKEN": "T"}),
                           "decode-open": ("decode", decode, {"DECODE_WORKER_PD_TOKEN": ""})}, logs,
                          ports={"prefill-t": prefill_t})
    yield procs
    for proc in procs.values():
        proc.stop()


def port_of(proc: Proc) -> int:
    return int(proc.url.rsplit(":", 1)[1])


def pd_post(prefill: Proc, decode: Proc, path: str, body: dict, timeout: float = 60) -> tuple[httpx.Response, httpx.Response]:
    """What a PD router does: the same body to prefill and decode at once."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        p = pool.submit(httpx.post, prefill.url + path, json=body, timeout=timeout)
        d = pool.submit(httpx.post, decode.url + path, json=body, timeout=timeout)
        return p.result(), d.result()


def boot(prefill: Proc, room: int | None = None, port: int | None | str = "own") -> dict:
    return {"bootstrap_host": "127.0.0.1", "bootstrap_port": port_of(prefill) if port == "own" else port,
            "bootstrap_room": next(rooms) if room is None else room}


# ---- the PD token -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefill,decode", [("prefill-t", "decode-t"), ("prefill-open", "decode-open")])
def test_matching_tokens_pass(workers, prefill, decode):
    p, d = pd_post(workers[prefill], workers[decode], "/generate",
                   {"text": "Hello", "sampling_params": GREEDY, **boot(workers[prefill])})
    assert p.status_code == 200 and d.status_code == 200, d.text
    assert len(d.json()["output_ids"]) == 6


@pytest.mark.parametrize("prefill,decode,fragment", [
    ("prefill-u", "decode-t", "X-PD-Token does not match"),
    ("prefill-open", "decode-t", "this prefill worker has no --pd-token"),
    ("prefill-t", "decode-open", "missing X-PD-Token header"),
])
def test_token_problems_fail_the_decode_request_at_once(workers, prefill, decode, fragment):
    dec = workers[decode]
    before = dec.metric("decode_worker_transfer_failures_total", reason="unauthorized", default=0.0)
    started = time.monotonic()
    _, d = pd_post(workers[prefill], dec, "/generate", {"text": "Hello", "sampling_params": GREEDY, **boot(workers[prefill])})
    elapsed = time.monotonic() - started
    assert d.status_code == 502, d.text
    message = d.json()["error"]["message"]
    assert "rejected the handshake (401)" in message and fragment in message, message
    assert elapsed < HANDSHAKE_DEADLINE_S, f"took {elapsed:.1f}s"
    assert dec.metric("decode_worker_transfer_failures_total", reason="unauthorized") == before + 1
    wait_pages_free(dec)


def handshake_body(room: int, layout: dict | None = None) -> dict:
    return {"room": room, "prompt_len": 4, "prompt_digest": "0" * 32, "nixl_agent": "decode-test",
            "layout": layout or {}}


@pytest.mark.parametrize("headers,fragment", [({}, "missing X-PD-Token header"),
                                              ({"X-PD-Token": "t"}, "does not match")])
def test_handshake_without_the_right_header_is_401(workers, headers, fragment):
    room = next(rooms)
    resp = httpx.post(workers["prefill-t"].url + "/v1/pd/handshake", json=handshake_body(room),
                      headers=headers, timeout=10)
    assert resp.status_code == 401 and fragment in resp.json()["error"]["message"], resp.text
    assert_refusal_logged(workers["prefill-t"], f"room {room})", "401", fragment)


def assert_refusal_logged(prefill: Proc, *fragments: str) -> None:
    """Prefill logged the refused handshake: one line naming the peer, the room and the reason."""
    lines = [line for line in prefill.log.read_text().splitlines()
             if "handshake from 127.0.0.1:" in line and all(f in line for f in fragments)]
    assert len(lines) == 1 and "refused" in lines[0], lines


def test_token_in_the_body_is_refused_naming_the_field(workers):
    body = {**handshake_body(next(rooms)), "token": "T"}
    resp = httpx.post(workers["prefill-t"].url + "/v1/pd/handshake", json=body, headers={"X-PD-Token": "T"}, timeout=10)
    assert resp.status_code == 400, resp.text
    assert "'token'" in resp.json()["error"]["message"] and "X-PD-Token" in resp.json()["error"]["message"]
    assert_refusal_logged(workers["prefill-t"], "(body refused)", "400", "'token'")


def test_right_header_reaches_the_room_lookup(workers):
    prefill = workers["prefill-t"]
    layout = httpx.get(prefill.url + "/server_info", timeout=10).json()["kv_layout"]
    room = next(rooms)
    resp = httpx.post(prefill.url + "/v1/pd/handshake", json=handshake_body(room, layout),
                      headers={"X-PD-Token": "T"}, timeout=10)
    assert resp.status_code == 404 and "unknown room" in resp.json()["error"]["message"], resp.text
    assert_refusal_logged(prefill, f"room {room})", "404", "unknown room")


# ---- batched bodies -----------------------------------------------------------------------------------------------


def batch_boot(prefill: Proc, ports: list[int | None]) -> dict:
    return {"bootstrap_host": ["127.0.0.1"] * len(ports), "bootstrap_port": ports,
            "bootstrap_room": [next(rooms) for _ in ports]}


@pytest.mark.parametrize("ports", ["own", "null", "mixed"])
def test_batched_generate_pairs_each_prompt_with_its_room(workers, ports):
    prefill, decode = workers["prefill-t"], workers["decode-t"]
    own = port_of(prefill)
    port_list = {"own": [own, own], "null": [None, None], "mixed": [None, own]}[ports]
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [30, 31, 32]]
    received = decode.metric("decode_worker_kv_received_tokens_total")
    p, d = pd_post(prefill, decode, "/generate",
                   {"input_ids": prompts, "sampling_params": GREEDY, **batch_boot(prefill, port_list)})
    assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
    first_tokens = [item["output_ids"][0] for item in p.json()]
    outputs = d.json()
    assert [len(o["output_ids"]) for o in outputs] == [6, 6]
    # Rooms crossed between prompts would fail prefill's digest check; here each took its own prompt's KV.
    assert [o["output_ids"][0] for o in outputs] == first_tokens
    assert decode.metric("decode_worker_kv_received_tokens_total") - received == sum(map(len, prompts))
    wait_pages_free(decode)


def test_batched_completions(workers):
    prefill, decode = workers["prefill-t"], workers["decode-t"]
    p, d = pd_post(prefill, decode, "/v1/completions",
                   {"prompt": ["Hello", "Goodbye"], "max_tokens": 4, "temperature": 0,
                    **batch_boot(prefill, [None, None])})
    assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
    assert [c["index"] for c in d.json()["choices"]] == [0, 1]
    assert d.json()["usage"]["completion_tokens"] == 8


def test_single_request_with_a_null_port_uses_the_default(workers):
    prefill, decode = workers["prefill-t"], workers["decode-t"]
    p, d = pd_post(prefill, decode, "/generate", {"text": "Hello", "sampling_params": GREEDY, **boot(prefill, port=None)})
    assert d.status_code == 200, d.text


@pytest.mark.parametrize("field", ["bootstrap_room", "bootstrap_host", "bootstrap_port"])
def test_array_of_the_wrong_length_is_a_400_naming_it(workers, field):
    prefill, decode = workers["prefill-t"], workers["decode-t"]
    body = {"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": GREEDY, **batch_boot(prefill, [None, None])}
    body[field] = body[field][:1]
    for proc in (prefill, decode):
        resp = httpx.post(proc.url + "/generate", json=body, timeout=10)
        assert resp.status_code == 400 and f"{field} has 1 entries for 2 prompts" in resp.json()["error"]["message"]
