"""Our decode worker (``--pd-peer-protocol sglang``, run from the main venv) fed by SGLang 0.5.18's own prefill-side
sender (``sglang_prefill.py``) holding the real KV of a prompt, made by our model code (``reference_kv.py``): the
decode finds the sender through its bootstrap server, registers, asks for the pages it lacks and answers exactly
what a colocated worker answers. And what it refuses: a prefill of another page size, an aux slot written for
another room, a sender that dies mid-room; pages a late write could still reach stay fenced."""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

REPO = Path(__file__).parents[2]
HERE = Path(__file__).parent
MAIN_PYTHON = os.environ.get("DECODE_WORKER_PYTHON", str(REPO / ".venv/bin/python"))
PAGE, MAX_NEW = 4, 8
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43]  # 13 tokens: three full pages and one partial
MODEL = "tiny-interop"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main_python(*args: str) -> str:
    done = subprocess.run([MAIN_PYTHON, *args], capture_output=True, text=True, cwd=REPO, timeout=300,
                          env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'kernels'}"}, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("sglang-decode")
    model = root / "model"
    main_python("-c", f"from tests.tiny_model import save_tiny_chat_model; save_tiny_chat_model({str(model)!r})")
    answer = json.loads(main_python(str(HERE / "reference_kv.py"), str(model), str(root / "kv.pt"), str(PAGE),
                                    str(MAX_NEW), *map(str, PROMPT)).splitlines()[-1])
    return {**answer, "model": model, "kv": root / "kv.pt", "root": root}


class Sender:
    """SGLang's sender in its own process, serving the reference KV (its threads never end: killed at the end)."""

    def __init__(self, reference: dict, kv: Path | None = None):
        env = {**os.environ, "SGLANG_SENDER_KV": str(kv or reference["kv"]), "SGLANG_SENDER_MODEL": MODEL,
               "SGLANG_SENDER_FIRST_TOKEN": str(reference["first_token"]),
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen([sys.executable, str(HERE / "sglang_prefill.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        ready, _, _ = select.select([self.proc.stdout], [], [], 120)
        hello = self.proc.stdout.readline() if ready else ""
        if not hello:
            self.kill()
            raise AssertionError("SGLang's sender did not start within 120 s")
        self.boot_port, self.http_port = json.loads(hello)["boot_port"], json.loads(hello)["http_port"]
        self.pages = list(range(reference["pages"]))
        self.first_token = reference["first_token"]

    def send(self, room: int, **fields) -> dict:
        command = {"room": room, "pages": self.pages, "aux_slot": 1, "first_token": self.first_token, **fields}
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


class Decode:
    """Our decode worker, run from the main venv."""

    def __init__(self, name: str, reference: dict, boot_port: int, *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = reference["root"] / f"{name}.log"
        cmd = [MAIN_PYTHON, "-m", "decode_worker.cli", "serve", "--role", "decode", "--port", str(self.port),
               "--model-path", str(reference["model"]), "--served-model-name", MODEL, "--dtype", "float32",
               "--page-size", str(PAGE), "--max-total-tokens", "512", "--pd-peer-protocol", "sglang",
               "--prefill-hosts", f"127.0.0.1:{boot_port}", *flags]
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'kernels'}"}
        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "wb"), stderr=subprocess.STDOUT, env=env, cwd=REPO)
        give_up = time.monotonic() + 240
        while time.monotonic() < give_up:
            assert self.proc.poll() is None, self.tail()
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise AssertionError(f"{name} did not start:\n{self.tail()}")

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])

    def generate(self, room: int, boot_port: int, timeout_s: float = 60,
                 prompt: list[int] = PROMPT) -> requests.Response:
        body = {"input_ids": prompt, "bootstrap_host": "127.0.0.1", "bootstrap_port": boot_port,
                "bootstrap_room": room, "return_logprob": True,
                "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}}
        return requests.post(self.url + "/generate", json=body, timeout=timeout_s)

    def metric(self, name: str) -> float:
        lines = requests.get(self.url + "/metrics", timeout=10).text.splitlines()
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name)
                   and line[len(name)] in " {")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def assert_as_colocated(answer: requests.Response, reference: dict) -> None:
    """The same tokens, and the same logprobs after the first (prefill's): each depends on every byte of the KV."""
    assert answer.status_code == 200, answer.text
    assert answer.json()["output_ids"] == reference["output_ids"]
    logprobs = [entry[0] for entry in answer.json()["meta_info"]["output_token_logprobs"]]
    assert logprobs[1:] == pytest.approx(reference["logprobs"][1:], abs=1e-5)


def in_background(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}
    thread = threading.Thread(target=lambda: out.setdefault("value", fn()))
    thread.start()
    return thread, out


@pytest.fixture(scope="module")
def sender(reference) -> Iterator[Sender]:
    sender = Sender(reference)
    yield sender
    sender.kill()


@pytest.fixture(scope="module")
def decode(reference, sender) -> Iterator[Decode]:
    decode = Decode("decode", reference, sender.boot_port, "--disaggregation-decode-enable-radix-cache")
    yield decode
    decode.stop()


def test_a_prompt_from_sglangs_sender_decodes_as_a_colocated_worker_would(sender, decode, reference):
    thread, out = in_background(lambda: decode.generate(101, sender.boot_port))
    assert sender.send(101) == {"sent": sender.pages}
    thread.join()
    assert_as_colocated(out["value"], reference)
    assert decode.metric("decode_worker_kv_received_tokens_total") == len(PROMPT)


def test_a_prefix_decode_holds_is_not_sent_again(sender, decode, reference):
    """The first test left the prompt's three full pages in decode's cache: decode says so in
    ``decode_prefix_len``, and the sender sends only the partial last page."""
    before = decode.metric("decode_worker_kv_received_tokens_total")
    thread, out = in_background(lambda: decode.generate(102, sender.boot_port))
    assert sender.send(102) == {"sent": sender.pages[3:]}
    thread.join()
    assert_as_colocated(out["value"], reference)
    assert decode.metric("decode_worker_kv_received_tokens_total") - before == len(PROMPT) - 3 * PAGE


def test_a_prompt_decode_holds_whole_gets_only_its_first_token(sender, decode, reference):
    """The first three pages of the prompt are cached: a prompt of exactly those 12 tokens is a full hit. Decode
    asks for no page, the sender sends only the aux slot (``{room}_aux_nokv``), and decode goes on from there."""
    before = decode.metric("decode_worker_kv_received_tokens_total")
    thread, out = in_background(lambda: decode.generate(106, sender.boot_port, prompt=PROMPT[:12]))
    assert sender.send(106, pages=sender.pages[:3]) == {"sent": []}
    thread.join()
    assert out["value"].status_code == 200, out["value"].text
    assert out["value"].json()["output_ids"][0] == reference["first_token"]
    assert decode.metric("decode_worker_kv_received_tokens_total") == before


def test_a_request_that_leaves_before_prefill_sends_is_aborted_there(sender, decode):
    """The client gives up while SGLang's prefill has not sent: decode tells it ``ABORT`` for the room, and the
    prefill's transfer of that room then fails instead of writing pages decode no longer expects; they stay fenced
    all the same, as 0.5.18 does not acknowledge an abort."""
    fenced = decode.metric("decode_worker_pd_fenced_pages")
    thread, sent = in_background(lambda: sender.send(107, delay_s=5))
    with pytest.raises(requests.Timeout):
        decode.generate(107, sender.boot_port, timeout_s=2)
    thread.join()
    assert "error" in sent["value"], sent["value"]
    assert decode.metric("decode_worker_pd_fenced_pages") > fenced


def test_an_aux_slot_written_for_another_room_is_refused_and_its_pages_fenced(sender, decode):
    thread, out = in_background(lambda: decode.generate(103, sender.boot_port))
    sender.send(103, aux_room=999)
    thread.join()
    assert out["value"].status_code == 502 and "aux slot of room 999" in out["value"].text, out["value"].text
    assert decode.metric("decode_worker_pd_fenced_pages") >= 1


def test_a_prefill_of_another_page_size_is_refused_before_registering(sender, reference):
    other = Decode("decode-page8", reference, sender.boot_port, "--page-size", "8")
    try:
        answer = other.generate(104, sender.boot_port, timeout_s=30)
        assert answer.status_code == 502 and "page size 4, ours 8" in answer.text, answer.text
    finally:
        other.stop()


def test_a_prefill_of_another_kv_dtype_is_refused_before_registering(reference):
    """KV in bfloat16 against our float32 decode: refused by what the bootstrap server says, nothing registered."""
    import torch

    saved = torch.load(reference["kv"])
    bf16 = reference["root"] / "kv-bf16.pt"
    torch.save({**saved, "k": [t.bfloat16() for t in saved["k"]], "v": [t.bfloat16() for t in saved["v"]]}, bf16)
    sender = Sender(reference, kv=bf16)
    decode = Decode("decode-misfit", reference, sender.boot_port)
    try:
        answer = decode.generate(108, sender.boot_port, timeout_s=30)
        assert answer.status_code == 502, answer.text
        assert "KV dtype bfloat16, ours float32" in answer.text, answer.text
        assert decode.metric("decode_worker_kv_received_tokens_total") == 0
    finally:
        decode.stop()
        sender.kill()


def test_notifications_that_do_not_add_up_fail_the_room_not_the_worker(sender, decode, reference):
    """A prefill that says a chunk landed twice fails that room (its pages fenced); one that sends a notification
    of no known form is logged and ignored; the next room is served as ever."""
    thread, out = in_background(lambda: decode.generate(109, sender.boot_port))
    assert sender.send(109, notify=["zz_not_a_notification", "109_kv_0_0_0", "109_kv_0_0_0"]) \
        == {"notified": ["zz_not_a_notification", "109_kv_0_0_0", "109_kv_0_0_0"]}
    thread.join()
    assert out["value"].status_code == 502 and "chunk 0 arrived twice" in out["value"].text, out["value"].text
    thread, out = in_background(lambda: decode.generate(110, sender.boot_port))
    assert "sent" in sender.send(110)
    thread.join()
    assert_as_colocated(out["value"], reference)


def test_a_sender_that_dies_mid_room_fails_the_request_within_its_deadline(reference):
    sender = Sender(reference)
    decode = Decode("decode-deadline", reference, sender.boot_port, "--handshake-timeout-s", "2",
                    "--transfer-timeout-s", "2")
    try:
        started = time.monotonic()
        thread, out = in_background(lambda: decode.generate(105, sender.boot_port))
        time.sleep(1)
        sender.kill()
        thread.join()
        assert out["value"].status_code == 504, out["value"].text
        assert time.monotonic() - started < 15
        assert decode.metric("decode_worker_pd_fenced_pages") == -(-len(PROMPT) // PAGE)
        assert requests.get(decode.url + "/health", timeout=5).status_code == 200
    finally:
        decode.stop()
        sender.kill()


def test_sglangs_router_in_front_of_sglangs_sender_and_our_decode_answers_a_generate(sender, decode, reference):
    """The deployment an SGLang user runs, with our decode in it: the router posts the body to both, adding the
    bootstrap fields; the sender (SGLang's transfer code behind an HTTP front that serves the reference prompt)
    pushes the KV; our decode answers what a colocated worker answers, and its hit rates show on /metrics."""
    port, metrics_port = free_port(), free_port()
    log = reference["root"] / "router.log"
    router = subprocess.Popen([MAIN_PYTHON, "-m", "smg.launch_router", "--pd-disaggregation",
                               "--prefill", f"http://127.0.0.1:{sender.http_port}", str(sender.boot_port),
                               "--decode", decode.url, "--host", "127.0.0.1", "--port", str(port),
                               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)],
                              stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        give_up = time.monotonic() + 60
        while True:
            assert router.poll() is None and time.monotonic() < give_up, log.read_text(errors="replace")[-3000:]
            try:
                if requests.get(url + "/readiness", timeout=2).status_code == 200:  # /health answers before workers
                    break
            except requests.RequestException:
                pass
            time.sleep(0.5)
        hits = decode.metric("decode_worker_cached_tokens_total")
        answer = requests.post(url + "/generate", timeout=60, json={
            "input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}})
        assert_as_colocated(answer, reference)
        assert decode.metric("decode_worker_cached_tokens_total") - hits == 3 * PAGE  # the earlier tests' pages
    finally:
        router.terminate()
        router.wait(20)
