"""The PD token never leaves for a prefill worker the decode worker was not told about (``--prefill-hosts``).

A stand-in "prefill" that records every byte sent to it plays the client's own server: a request naming it in
``bootstrap_host`` (alone or as one prompt of a batch) is refused with a 400 naming the field, and the stand-in
never sees a connection, let alone the token. The listed prefill keeps working.
"""
from __future__ import annotations

import itertools
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest

from tests.integration.test_pd_auth_batch import pd_post, port_of
from tests.servers import Proc, free_port, start_workers
from tests.tiny_model import save_tiny_chat_model

GREEDY = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
rooms = itertools.count(9100)


class TokenCatcher:
    """A TCP listener on loopback that keeps whatever reaches it."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received: list[bytes] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.settimeout(2)
            try:
                self.received.append(conn.recv(65536))
            except OSError:
                self.received.append(b"")
            conn.close()


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Iterator[dict[str, Proc]]:
    logs = tmp_path_factory.mktemp("allow-list-logs")
    model = ("--model-path", str(save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))))
    prefill_port = free_port()
    decode = model + ("--handshake-timeout-s", "5", "--bootstrap-port", str(prefill_port))
    procs = start_workers({"prefill": ("prefill", model, {"DECODE_WORKER_PD_TOKEN": "T"}),
                           "decode": ("decode", decode, {"DECODE_WORKER_PD_TOKEN": "T",
                                                         "DECODE_WORKER_PREFILL_HOSTS": f"127.0.0.1:{prefill_port}"})},
                          logs, ports={"prefill": prefill_port})
    yield procs
    for proc in procs.values():
        proc.stop()


def test_listed_prefill_serves(pair):
    body = {"text": "Hello", "sampling_params": GREEDY, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": port_of(pair["prefill"]), "bootstrap_room": next(rooms)}
    p, d = pd_post(pair["prefill"], pair["decode"], "/generate", body)
    assert p.status_code == 200 and d.status_code == 200, d.text


@pytest.mark.parametrize("path,shape", [("/generate", "one"), ("/generate", "batch"),
                                        ("/v1/completions", "one"), ("/v1/chat/completions", "one")])
def test_unknown_prefill_is_refused_before_anything_is_sent(pair, path, shape):
    catcher = TokenCatcher()
    own = port_of(pair["prefill"])
    if shape == "batch":  # the second prompt names the catcher: the whole body is refused
        boot = {"bootstrap_host": ["127.0.0.1", "127.0.0.1"], "bootstrap_port": [own, catcher.port],
                "bootstrap_room": [next(rooms), next(rooms)]}
        prompt = {"text": ["Hello", "Hi"]}
    else:
        boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": catcher.port, "bootstrap_room": next(rooms)}
        prompt = {"/generate": {"text": "Hello"}, "/v1/completions": {"prompt": "Hello", "model": "m"},
                  "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "model": "m"}}[path]
    for stream in (False, True):
        resp = httpx.post(pair["decode"].url + path, json={**prompt, **boot, "stream": stream}, timeout=30)
        assert resp.status_code == 400, resp.text
        message = resp.json()["error"]["message"]
        assert "bootstrap_host '127.0.0.1'" in message and f"port {catcher.port}" in message, message
    assert catcher.received == []
