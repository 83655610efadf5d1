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

from tests.servers import free_port, pd_generate, start_worker
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


class TokenCatcher(http.server.BaseHTTPRequestHandler):
    """Another user's listener on a loopback port: records every secret header that reaches it."""

    caught: list[str] = []

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        TokenCatcher.caught += [v for k, v in self.headers.items() if k.lower() in ("x-pd-token", "authorization")]
        self.send_response(404)
        self.send_header("content-length", "0")
        self.end_headers()


def test_the_pd_token_goes_only_to_a_listed_host_and_port(tmp_path):
    """With ``--prefill-hosts`` unset, a request could name any loopback port as its bootstrap_port: the listener
    there (another user's) got the PD token and the API key. A decode worker holding a secret now starts only with
    its prefill workers listed by host and port, and a request naming another port is refused before any call."""
    catcher = http.server.ThreadingHTTPServer(("127.0.0.1", 0), TokenCatcher)
    threading.Thread(target=catcher.serve_forever, daemon=True).start()
    model = save_tiny_chat_model(tmp_path / "model")
    (tmp_path / "logs").mkdir()
    secrets = {"DECODE_WORKER_PD_TOKEN": "pd-secret", "DECODE_WORKER_API_KEY": "api-secret"}
    flags = ("--model-path", str(model))
    with pytest.raises(RuntimeError, match=r"--pd-token and --api-key go only to prefill workers listed in "
                                           r"--prefill-hosts as host:port \(it is unset"):
        start_worker("decode-unlisted", tmp_path / "logs", "decode", *flags, env=secrets).stop()  # stop if it ran
    listed = {**secrets, "DECODE_WORKER_PREFILL_HOSTS": f"127.0.0.1:{free_port()}"}
    decode = start_worker("decode-listed", tmp_path / "logs", "decode", *flags, env=listed)
    try:
        body = {"text": "hi", "sampling_params": {"max_new_tokens": 4}, "bootstrap_host": "127.0.0.1",
                "bootstrap_port": catcher.server_address[1], "bootstrap_room": 7}
        r = httpx.post(decode.url + "/generate", json=body, timeout=60,
                       headers={"Authorization": "Bearer api-secret"})
        assert r.status_code == 400 and "--prefill-hosts" in r.json()["error"]["message"], r.text
        assert TokenCatcher.caught == []
    finally:
        decode.stop()
        catcher.shutdown()


FLOOD = r'''
import select, socket, sys, time
name, held, connects = b"\0" + sys.argv[1].encode(), [], 0
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    while len(held) < 64:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(0.05)
        try:
            s.connect(name)
        except OSError:
            s.close()
            break
        held.append(s)
        connects += 1
    for s in select.select(held, [], [], 0.01)[0]:  # hung up on: connect again
        held.remove(s)
        s.close()
print(connects, flush=True)
'''


def pool_socket(pid: int) -> str:
    """The abstract name of a worker's pool socket, as any user reads it from ``/proc/net/unix``."""
    for line in open("/proc/net/unix").read().splitlines():
        name = line.split()[-1]
        if name.startswith(f"@decode-worker-kv-{pid}-"):
            return name[1:]
    raise LookupError(f"process {pid} serves no pool socket")


@pytest.mark.skipif(os.getuid() != 0 or not os.path.exists("/usr/bin/python3"),
                    reason="needs root (to run a process as another user) and /usr/bin/python3")
def test_another_users_connection_flood_does_not_keep_decode_off_the_shared_pool(tmp_path):
    """Sixteen idle connections from anyone held every slot of a prefill's pool socket: decode's one ask failed and
    it read that prefill over NIXL (about 3x slower) until a restart. Another uid's connections are now refused at
    accept, so decode maps the pool at its first ask while the flood goes on."""
    model = save_tiny_chat_model(tmp_path / "model")
    logs = tmp_path / "logs"
    logs.mkdir()
    prefill = start_worker("prefill-flooded", logs, "prefill", "--model-path", str(model))
    flood = subprocess.Popen(["/usr/bin/python3", "-c", FLOOD, pool_socket(prefill.popen.pid), "20"], user=NOBODY,
                             stdout=subprocess.PIPE, text=True)
    decode = None
    try:
        time.sleep(1.0)  # the flood holds what it can
        decode = start_worker("decode-beside-flood", logs, "decode", "--model-path", str(model))
        r = pd_generate(prefill, decode, {"text": "hi", "sampling_params": {"max_new_tokens": 4}}, room=11)
        assert r.status_code == 200, r.text
        assert "its KV pages are copied from its shared pool" in decode.log.read_text(), decode.tail()
        assert "uid 65534 is not ours" in prefill.log.read_text()
    finally:
        flood.kill()
        for proc in (decode, prefill):
            if proc is not None:
                proc.stop()
