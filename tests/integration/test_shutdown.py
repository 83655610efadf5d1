"""Graceful shutdown: SIGTERM lets a running stream finish, then the worker exits cleanly; `decode-worker up`
stops every process it started however it is stopped (a signal to it alone, to its process group, a second
signal, or its own SIGKILL)."""
from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.servers import free_port, pd_generate, start_worker
from tests.tiny_model import save_tiny_chat_model


def test_sigterm_drains_a_running_stream(tmp_path, smollm2_path):
    proc = start_worker("drain", tmp_path, "colocated")
    body = {"text": "Tell me a long story.", "stream": True,
            "sampling_params": {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}}
    chunks = []
    try:
        with httpx.stream("POST", proc.url + "/generate", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                chunks.append(line[6:])
                if len(chunks) == 3:
                    proc.popen.send_signal(signal.SIGTERM)  # mid-stream
        assert chunks[-1] == "[DONE]"
        assert len(json.loads(chunks[-2])["output_ids"]) == 48
        # uvicorn re-raises the signal once its graceful shutdown is done, so a clean exit reads as -SIGTERM.
        assert proc.popen.wait(timeout=40) in (0, -signal.SIGTERM)
        assert "Application shutdown complete" in proc.tail(20)
    finally:
        proc.stop()


@pytest.mark.slow  # ~20 s; test_up_stops_everything_it_started stops a whole PD deployment in the default run
def test_sigterm_stops_a_pd_pair_cleanly(tmp_path, smollm2_path):
    """Both halves of PD stop on SIGTERM after a hand-off: prefill got the release (nothing left to wait for) and
    each closes its NIXL agent without hanging."""
    prefill = start_worker("drain-prefill", tmp_path, "prefill")
    decode = start_worker("drain-decode", tmp_path, "decode")
    try:
        body = {"text": "Tell me a story.", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        assert pd_generate(prefill, decode, body, room=4242).status_code == 200
        for proc in (decode, prefill):
            proc.popen.send_signal(signal.SIGTERM)
        for proc in (decode, prefill):
            assert proc.popen.wait(timeout=20) in (0, -signal.SIGTERM)
            assert "Application shutdown complete" in proc.tail(20), proc.tail(20)
    finally:
        decode.stop()
        prefill.stop()


# ---- `decode-worker up`: everything it started stops, however it is stopped ----------------------------------------


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (router, workers, whatever they started)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except OSError:
            continue
        found += kids
        todo += kids
    return found


def _alive(pid: int) -> bool:
    """Running (a zombie has exited: only its exit status is left for its parent to read)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_read(client: socket.socket, timeout_s: float = 30.0) -> None:
    """Until the server side of ``client``'s connection has read everything sent (its receive queue is empty, as
    ``ss`` shows it): then the worker has parsed the request's head."""
    local, peer = client.getsockname()[1], client.getpeername()[1]
    deadline = time.monotonic() + timeout_s
    while True:
        line = subprocess.run(["ss", "-tnH", "state", "established", f"( sport = :{peer} and dport = :{local} )"],
                              capture_output=True, text=True, check=True).stdout.split()
        if line and line[0] == "0":  # Recv-Q
            return
        assert time.monotonic() < deadline, f"the worker never read the request: {line}"
        time.sleep(0.05)


def _port_free(port: int) -> bool:
    """Nothing listens on ``port``: a new server could bind it now (as servers do, past TIME_WAIT)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


def _start_up(tmp_path: Path, model: Path, under_shell: bool) -> tuple[subprocess.Popen, int, list[int], list[int]]:
    """``up`` on the tiny model, in a process group of its own (under a shell, as ``make run`` runs it, when
    ``under_shell``): its process, its pid, its descendants and their ports once the router answers."""
    ports = [free_port() for _ in range(3)]
    up = [sys.executable, "-m", "decode_worker.cli", "up", "--model-path", str(model), "--port", str(ports[0]),
          "--prefill-port", str(ports[1]), "--decode-port", str(ports[2]), "--max-total-tokens", "4096",
          "--log-dir", str(tmp_path / "logs")]
    cmd = ["sh", "-c", shlex.join(up) + "; true"] if under_shell else up
    out = open(tmp_path / "up.log", "wb")
    popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert popen.poll() is None, (tmp_path / "up.log").read_text()
        try:
            if httpx.get(f"http://127.0.0.1:{ports[0]}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    up_pid = _children(popen.pid)[0] if under_shell else popen.pid
    kids = _children(up_pid)
    assert len(kids) >= 3, kids  # prefill, decode, router
    return popen, up_pid, kids, ports


def _assert_all_gone(kids: list[int], ports: list[int], within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and (any(map(_alive, kids)) or not all(map(_port_free, ports))):
        time.sleep(0.2)
    assert not [k for k in kids if _alive(k)], "children left running"
    assert all(map(_port_free, ports)), "ports still held"


@pytest.mark.parametrize("how", [pytest.param("sigint-to-up", marks=pytest.mark.slow), "sigterm-to-group",
                                 pytest.param("sigkill-up", marks=pytest.mark.slow),
                                 pytest.param("second-signal", marks=pytest.mark.slow)])
def test_up_stops_everything_it_started(tmp_path, tiny_chat_model, how):
    popen, up_pid, kids, ports = _start_up(tmp_path, tiny_chat_model, under_shell=how == "sigterm-to-group")
    try:
        if how == "sigint-to-up":
            os.kill(up_pid, signal.SIGINT)  # a supervisor's SIGINT to `up` alone, not a terminal's to its group
        elif how == "sigterm-to-group":
            os.killpg(popen.pid, signal.SIGTERM)  # `make run`'s whole group: the shell and `up`
        elif how == "sigkill-up":
            os.kill(up_pid, signal.SIGKILL)
        else:  # a request whose body never ends keeps the decode worker's graceful stop busy for ~15 s
            stalled = socket.create_connection(("127.0.0.1", ports[2]))
            stalled.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            _wait_read(stalled)  # a request the worker has not read yet is no request in flight: it is just closed
            os.kill(up_pid, signal.SIGTERM)
            time.sleep(1.0)
            assert _alive(up_pid) and any(map(_alive, kids))  # still stopping gracefully
            os.kill(up_pid, signal.SIGTERM)
        _assert_all_gone(kids, ports, within_s=5 if how in ("sigkill-up", "second-signal") else 30)
        popen.wait(timeout=30)
        log = (tmp_path / "up.log").read_text()
        if how == "second-signal":
            assert "SIGTERM again: killing what is left" in log, log
        elif how != "sigkill-up":
            assert "stopping the deployment" in log, log
    finally:
        for pid in [*kids, up_pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        popen.kill()
