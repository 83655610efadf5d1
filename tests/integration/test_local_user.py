"""What another user on the worker's host, or a peer at the PD edge, can do, over real worker processes
(docs/security.md, "Local users" and "The PD edge"): plant a library where the worker looks for its compiled kernels,
or answer a handshake with more than any prefill would."""
from __future__ import annotations

import http.server
import os
import shutil
import subprocess
import threading
import time

import httpx
import pytest
from decode_worker_kernels import cpu_native

from tests.servers import start_worker
from tests.tiny_model import save_tiny_chat_model

NOBODY = 65534
PLANTED = r'''
#include <stdio.h>
__attribute__((constructor)) static void planted(void) { FILE *f = fopen("%s", "w"); if (f) fclose(f); }
int native_abi(void) { return %d; }
'''


@pytest.mark.skipif(os.getuid() != 0 or shutil.which("cc") is None, reason="needs root (to make a folder another "
                    "user owns) and a C compiler")
def test_a_kernel_folder_another_user_made_is_not_loaded_from(tmp_path):
    """Another user made the worker's kernel folder first, writable by all, and put a library under the very name
    the worker would build: the worker builds its own in a private folder and the planted constructor never runs."""
    cache, ran = tmp_path / "cache", tmp_path / "planted-constructor-ran"
    kernels = cache / "kernels"
    kernels.mkdir(parents=True)
    target = cpu_native.library_path(kernels)
    source = tmp_path / "planted.c"
    source.write_text(PLANTED % (ran, cpu_native.ABI))
    subprocess.run(["cc", "-shared", "-fPIC", str(source), "-o", str(target)], check=True)
    for path in (kernels, target):
        os.chown(path, NOBODY, NOBODY)
    kernels.chmod(0o777)
    model = save_tiny_chat_model(tmp_path / "model")
    (tmp_path / "logs").mkdir()
    worker = start_worker("kernel-cache", tmp_path / "logs", "colocated", "--model-path", str(model),
                          env={"DECODE_WORKER_CACHE": str(cache)})
    try:
        r = httpx.post(worker.url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 4}},
                       timeout=60)
        assert r.status_code == 200, r.text
    finally:
        worker.stop()
    assert not ran.exists(), "the planted library's constructor ran inside the worker"
    assert "native CPU kernels unavailable" not in worker.log.read_text()  # it built its own, privately


class HugeAnswer(http.server.BaseHTTPRequestHandler):
    """A 'prefill' whose handshake answer is 160 MB of JSON."""

    SIZE = 160 << 20

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(self.SIZE))
        self.end_headers()
        head, tail, chunk = b'{"pad": "', b'"}', b" " * (1 << 20)
        try:
            self.wfile.write(head)
            for _ in range(self.SIZE // len(chunk) - 1):
                self.wfile.write(chunk)
            self.wfile.write(b" " * (len(chunk) - len(head) - len(tail)) + tail)
        except (BrokenPipeError, ConnectionResetError):
            pass  # decode stopped reading: what it should do

    def log_message(self, *args):
        pass


def test_a_huge_handshake_answer_fails_its_request_without_stalling_the_worker(tmp_path):
    """A 160 MB answer was read whole and parsed on the event loop (933 MiB more, a 4.7 s stall). Now the read
    stops at its bound, the request fails naming it, and the worker answers probes throughout."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), HugeAnswer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    model = save_tiny_chat_model(tmp_path / "model")
    (tmp_path / "logs").mkdir()
    decode = start_worker("decode-huge-answer", tmp_path / "logs", "decode", "--model-path", str(model),
                          "--disaggregation-decode-enable-radix-cache")
    try:
        body = {"text": "hi", "sampling_params": {"max_new_tokens": 4}, "bootstrap_host": "127.0.0.1",
                "bootstrap_port": server.server_address[1], "bootstrap_room": 7}
        thread_out: dict = {}
        thread = threading.Thread(target=lambda: thread_out.setdefault(
            "r", httpx.post(decode.url + "/generate", json=body, timeout=120)))
        thread.start()
        slowest = 0.0
        while thread.is_alive():
            start = time.monotonic()
            assert httpx.get(decode.url + "/health", timeout=10).status_code == 200
            slowest = max(slowest, time.monotonic() - start)
            time.sleep(0.05)
        r = thread_out["r"]
        assert r.status_code == 502 and "answered more than" in r.json()["error"]["message"], r.text
        assert slowest < 1.0, f"a probe waited {slowest:.1f} s"
        assert decode.metric("decode_worker_transfer_failures_total", reason="bad_answer") >= 1
    finally:
        decode.stop()
        server.shutdown()
