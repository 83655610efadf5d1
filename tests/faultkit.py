"""Fault injection over real processes: stub peers, a delaying TCP proxy, router-like PD traffic with client
aborts, and the checks every fault must pass (health, no locked pages once idle, page accounting, greedy parity).

``python -m tests.faultkit die-at-transfer N serve ...`` runs a prefill worker that SIGKILLs itself as soon as
its Nth handshake answer is out, while its decode peer reads the pages the answer named: the near-deterministic
form of "prefill died mid-transfer", which a kill from outside hits only by luck because a read lasts milliseconds.

``python -m tests.faultkit serve ...`` runs a worker with the in-process faults ``FAULTKIT_FAULTS`` (JSON) names
(``Faults``): a decode whose KV copy thread stalls and whose reads end late, a prefill that overwrites the pages
of a hand-off as soon as its hold ends (as a reuse would), and a probe of the event loop's longest stall.
"""
from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import random
import signal
import socket
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from tests.servers import Proc, free_port, start

REPO = Path(__file__).resolve().parents[1]

# A chat prompt is a system message (the shared prefix: whole KV pages every radix tree shares) and a question.
# Each (system, question) pair below has a clear top-1 over top-2 logit gap (>= 0.1) along its first 16 greedy
# tokens (``test_faults.py::test_prompt_set_has_clear_margins``), so batch-shape noise cannot flip a token.
SYSTEMS = (
    "You are a helpful assistant for a public library. Answer briefly and accurately, in one sentence, and never "
    "invent facts you do not know.",
    "You are a friendly geography teacher. Give short, correct answers that a ten year old can follow, and keep "
    "every reply under twenty words.",
    "You are a precise math tutor. Reply with the result first, then stop. Do not explain unless the student asks "
    "for an explanation.",
)
QUESTIONS = (
    "What is the capital of France?", "What is two plus two?", "What color is the sky on a clear day?",
    "How many days are in a week?", "What is the largest ocean on Earth?", "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?", "Name the first month of the year.",
)
PROMPT_SET = ((0, 0), (0, 2), (0, 3), (0, 4), (0, 6), (0, 7), (1, 0), (1, 1), (1, 2), (1, 3), (1, 4), (1, 5),
              (1, 6), (1, 7), (2, 3), (2, 7))
MAX_NEW_TOKENS = 16


def chatml(system: int, question: int) -> str:
    """The prompt as SmolLM2's chat template renders it (ChatML), sent as text: the worker's tokenizer keeps the
    special tokens whole, so every prompt with one system message shares its pages."""
    return (f"<|im_start|>system\n{SYSTEMS[system]}<|im_end|>\n<|im_start|>user\n{QUESTIONS[question]}<|im_end|>\n"
            "<|im_start|>assistant\n")


# ---- the no-cache reference --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Reference:
    """Greedy outputs (temperature 0, ignore_eos, ``MAX_NEW_TOKENS``) of every prompt, computed without any
    cached prefix; a shorter request's output must be a prefix of its reference."""

    prompts: list[str]
    outputs: list[list[int]]

    def matches(self, prompt: int, output: list[int]) -> bool:
        return bool(output) and output == self.outputs[prompt][: len(output)]


def reference_from(worker: Proc) -> Reference:
    """The prompt set through a worker that serves plain requests to the end (colocated, or prefill): one prompt
    at a time, each after a cache flush, so every prompt is computed from scratch with no prefix reused (a batch
    would share the prompts' common chat-template head in one extend: in-batch prefix sharing)."""
    prompts = [chatml(*sq) for sq in PROMPT_SET]
    params = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    outputs = []
    with httpx.Client(base_url=worker.url, timeout=120) as client:
        for prompt in prompts:
            assert client.post("/flush_cache").status_code == 200
            r = client.post("/generate", json={"text": prompt, "sampling_params": params})
            assert r.status_code == 200, r.text
            assert r.json()["meta_info"]["cached_tokens"] == 0
            outputs.append(r.json()["output_ids"])
    return Reference(prompts, outputs)


def prompt_margins(model_path: Path) -> list[float]:
    """In-process, without any cache: the smallest top-1 minus top-2 logit gap along each prompt's greedy output."""
    import torch

    from decode_worker.core.sampling import SamplingParams
    from decode_worker.engine.llm import LLM

    llm = LLM(str(model_path), max_total_tokens=4096)
    prompts = [llm.tokenizer.encode(chatml(*sq)) for sq in PROMPT_SET]
    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0, ignore_eos=True)
    outputs = [o.output_ids for o in llm.generate(prompts, params)]
    margins, ps = [], llm.runner.page_size
    with torch.no_grad():
        for prompt, out in zip(prompts, outputs):  # one pass over prompt + output: logits at every output position
            seq = prompt + out[:-1]
            pages = llm.allocator.alloc(-(-len(seq) // ps))
            logits = llm.runner.forward(llm.runner.build_batch([seq], [0], [pages.tolist()], all_logits=True))
            llm.allocator.free(pages)
            top2 = logits[len(prompt) - 1:].topk(2, dim=-1)
            same = top2.indices[:, 0].tolist() == out
            margins.append(float((top2.values[:, 0] - top2.values[:, 1]).min()) if same else 0.0)
    return margins


# ---- peers and proxies written for the tests ---------------------------------------------------------------------

def serve_http(handler: type[BaseHTTPRequestHandler], port: int = 0) -> tuple[ThreadingHTTPServer, int, str]:
    """A threaded HTTP server on loopback ``port`` (0: a free one), serving from a daemon thread: (server, port,
    url)."""
    server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    server.daemon_threads = True
    port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, port, f"http://127.0.0.1:{port}"


def reply(handler: BaseHTTPRequestHandler, status: int, data: bytes) -> None:
    """A JSON answer (``data``: its bytes, which may be cut short on purpose)."""
    handler.send_response(status)
    handler.send_header("content-type", "application/json")
    handler.send_header("content-length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


class StubPrefill:
    """A prefill peer that has no KV to give: ``/generate`` answers at once, and the PD handshake is either
    answered like prefill answers it but naming an agent no one can reach (``accept``) or held open without an
    answer (``hang``). Records when each handshake arrived, by room."""

    def __init__(self, mode: str):
        assert mode in ("accept", "hang")
        self.mode, self.name = mode, f"stub-{mode}"
        self.handshakes: dict[int, float] = {}
        self._release = threading.Event()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self._reply(200, {})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
                if self.path == "/v1/pd/handshake":
                    stub.handshakes[body["room"]] = time.monotonic()
                    if stub.mode == "hang":
                        stub._release.wait(600)
                        return
                    pool = {"agent": stub.name, "base": 4096, "num_pages": 64, "page_bytes": 737280,
                            "device": 0, "mem": "DRAM"}
                    self._reply(200, {"status": "ready", "room": body["room"], "lease": 1, "pages": [1] * 13,
                                      "first_token": 1, "logprob": 0.0, "pool": pool,
                                      "metadata": base64.b64encode(b"no agent here").decode(),
                                      "hold_s": 30.0, "waited_s": 0.0})
                else:  # what a router's prefill POST gets: prefill "finished" and holds nothing
                    self._reply(200, {"text": "", "output_ids": [], "meta_info": {}})

            def _reply(self, status: int, obj: dict) -> None:
                reply(self, status, json.dumps(obj).encode())

        self._server, self.port, self.url = serve_http(Handler)

    def close(self) -> None:
        self._release.set()
        self._server.shutdown()
        self._server.server_close()


class CorruptingPrefill:
    """An HTTP front of a real prefill worker whose handshake answers come back with one field changed: the
    answer is otherwise real (real agent, real pages, held by the real prefill), so a decode worker that used the
    bad field would get as far as reading real KV and running a step. ``corrupt`` maps prefill's answer (a dict)
    to what is sent instead: a dict, or raw bytes (a truncated body). Other POSTs are passed through."""

    def __init__(self, upstream: str, corrupt: Callable[[dict], dict | bytes] = lambda d: d, port: int = 0):
        self.upstream, self.corrupt, self.name = upstream, corrupt, "corrupting-prefill"
        self.answered = 0
        front = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                headers = {k: v for k, v in self.headers.items() if k.lower() in ("x-pd-token", "authorization",
                                                                                  "content-type")}
                r = httpx.post(front.upstream + self.path, content=body, headers=headers, timeout=120)
                handshake = self.path == "/v1/pd/handshake" and r.status_code == 200
                out = front.corrupt(r.json()) if handshake else r.json()
                data = out if isinstance(out, bytes) else json.dumps(out).encode()
                front.answered += 1
                reply(self, r.status_code, data)

        self._server, self.port, self.url = serve_http(Handler, port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


BAD_ANSWERS: dict[str, Callable[[dict], dict | bytes]] = {
    "first_token": lambda d: {**d, "first_token": 49152},  # SmolLM2's vocabulary size: one past its last token
    "first_token ": lambda d: {**d, "first_token": -1},
    "logprob": lambda d: {**d, "logprob": float("nan")},
    "pages": lambda d: {**d, "pages": [*d["pages"][:-1], d["pool"]["num_pages"]]},  # the last one past the pool
    "pages ": lambda d: {**d, "pages": [d["pages"][0]] * len(d["pages"])},  # one page named for all
    "pages  ": lambda d: {**d, "pages": d["pages"][:-1]},  # a page short
    "pool.page_bytes": lambda d: {**d, "pool": {**d["pool"], "page_bytes": d["pool"]["page_bytes"] * 2}},
    "pool.num_pages": lambda d: {**d, "pool": {**d["pool"], "num_pages": 1 << 40}},
    "room": lambda d: {**d, "room": d["room"] + 1},
    "waited_s": lambda d: {**d, "waited_s": 3600.0},  # it claims to have waited longer than decode's round trip
    "answer": lambda d: json.dumps(d).encode()[:40],  # truncated: not JSON
}
"""Corrupted handshake answers, by the field decode must name when it refuses them (padded to keep keys apart)."""


class DelayProxy:
    """TCP proxy to a loopback port that can hold every chunk it forwards for ``delay_s``: a store slower than
    its deadline, without touching the store or the worker. An unreachable upstream closes the client side.
    ``held`` counts the chunks on their way to the store that were held: the store calls a slow window saw."""

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.delay_s = 0.0
        self.held = 0
        self._count = threading.Lock()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._open: set[socket.socket] = set()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=2)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            self._open |= {client, upstream}
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(src, dst, dst is upstream), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, to_store: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if self.delay_s:
                    if to_store:
                        with self._count:
                            self.held += 1
                    time.sleep(self.delay_s)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                self._open.discard(s)
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def close(self) -> None:
        self._closed = True
        self._sock.close()
        for s in list(self._open):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class IdleCloser:
    """An HTTP server that, like uvicorn when its keep-alive timer fires, drops a connection idle for
    ``idle_s``, here at the moment the next request arrives on it: the race a client loses when it reuses a
    connection exactly as the server gives up on it, made deterministic. Answers any other request with 200 {}."""

    def __init__(self, idle_s: float = 5.0):
        self.idle_s = idle_s
        self.dropped = 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as f:
            idle_since = time.monotonic()
            while f.readline():  # a request line
                length = 0
                while (line := f.readline()) not in (b"\r\n", b""):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                f.read(length)
                if time.monotonic() - idle_since >= self.idle_s:
                    self.dropped += 1
                    return  # closed without an answer, after the request went out
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
                idle_since = time.monotonic()

    def close(self) -> None:
        self._sock.close()


FAULTS_ENV = "FAULTKIT_FAULTS"


@dataclass
class Faults:
    """In-process faults for ``python -m tests.faultkit serve`` (all off by default).

    Decode: with probability ``stall_p`` a KV copy on the copy thread first stalls for up to ``stall_s`` (what
    is queued behind it waits too), and with ``late_p`` it ends up to ``late_s`` after its last byte landed;
    ``inline_bytes`` moves the size above which reads go to the copy thread (0: all of them). Prefill:
    ``reuse_after_hold`` overwrites a hand-off's pages with random bytes the moment prefill may reuse them: on
    decode's release, or when its hold ends unreleased (lease expiry runs every ``expire_every_s``, so at a
    random point up to that long after the hold); its prompts share no cached prefix, so the pages are the
    hand-off's alone; ``hold_delay_s`` makes a computed prompt's KV reach the hand-off that much later, as a long
    queue would. ``loop_probe``: log every stall of the event loop over ``LOOP_LOG_MS`` (``loop_stalls``
    reads them back). ``poison_rid``: any step whose batch holds a request with that rid and at least
    ``poison_after`` output tokens raises, as a kernel error on one row would."""

    stall_p: float = 0.0
    stall_s: float = 0.0
    late_p: float = 0.0
    late_s: float = 0.0
    inline_bytes: int | None = None
    reuse_after_hold: bool = False
    expire_every_s: float = 1.0
    hold_delay_s: float = 0.0
    loop_probe: bool = False
    poison_rid: str = ""
    poison_after: int = 0
    seed: int = 0

    def env(self) -> dict[str, str]:
        return {FAULTS_ENV: json.dumps(self.__dict__)}


def start_faulty(name: str, log_dir: Path, role: str, faults: Faults, *flags: str,
                 env: dict[str, str] | None = None, port: int = 0) -> Proc:
    """A real worker of ``role`` with ``faults`` installed in its process; ``port`` 0: a free one."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "tests.faultkit", "serve", "--role", role, "--port", str(port),
           "--max-total-tokens", "8192", *flags]
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return start(name, cmd, f"http://127.0.0.1:{port}", log_dir, {**(env or {}), **faults.env(), "PYTHONPATH": path})


@dataclass(frozen=True)
class LoopStall:
    """One delay of a ``loop_probe`` tick: how long past its time it ran (``ms``), and how the event loop's thread
    spent it, from the kernel's accounting of that thread (``/proc/thread-self/schedstat``): running (``cpu_ms``:
    code on the loop) and waiting for a core while runnable (``runqueue_ms``: other processes and threads had
    the machine's cores). The rest it slept: blocked in a system call or waiting for the GIL. A GIL held by a
    thread that itself waits for a core is the machine's contention too: ``others_runqueue_ms`` is the longest
    any other Python thread of the worker waited for a core in a window around the stall (up to 50 ms wider), and
    ``others_cpu_ms`` the longest any ran (a thread holding the GIL through a long call shows there). That
    excuse holds only while the loop was not seen waiting of its own accord: ``seen_at`` is where the watchdog
    saw the loop's thread in a lock, a thread's start or a socket during the stall (``BLOCKING_FRAMES``).
    ``steal_ms``: the most time the hypervisor took from one of this virtual machine's cores meanwhile
    (``/proc/stat``): a sleeping loop wakes up late when its core is not running at all. ``at``: wall time."""

    ms: float
    cpu_ms: float
    runqueue_ms: float
    at: float
    others_cpu_ms: float = 0.0
    others_runqueue_ms: float = 0.0
    steal_ms: float = 0.0
    seen_at: str = ""
    seen_idle: bool = False

    @property
    def blocked_ms(self) -> float:
        """What the loop itself lost: running code on it, or blocked, not counting the waits for a free core (its
        own, and that of the thread it may have waited on) nor the time the machine itself was not running. A
        loop the watchdog saw asleep in the kernel's poll (``seen_idle``) had nothing to run while its tick was
        overdue: the kernel woke it late, so of that stall only the code it ran counts."""
        if self.seen_idle:
            return self.cpu_ms
        excused = 0.0 if self.seen_at else self.others_runqueue_ms
        return max(0.0, self.ms - self.runqueue_ms - excused - self.steal_ms)


# Where the watchdog may see the loop's thread wait of its own accord (a lock, a thread's start, a socket); seen
# anywhere else it was most likely waiting for the GIL at a switch point.
BLOCKING_FRAMES = ("threading.py:", "socket.py:", "selectors.py:", "subprocess.py:", "queue.py:")
# The loop between callbacks (no Python frame of ours on its thread) asleep in the kernel's poll: idle.
IDLE_FRAME, IDLE_KERNEL = "runners.py:", "kernel: S do_epoll_wait"


def loop_stalls(proc: Proc, since: float = 0.0) -> list[LoopStall]:
    """The stalls over ``LOOP_LOG_MS`` a ``loop_probe`` worker logged, from wall time ``since`` on."""
    stalls, seen, idle = [], [], []
    for line in proc.log.read_text(errors="replace").splitlines():
        if line.startswith("faultkit: loop stall"):
            kv = dict(part.split("=") for part in line.split()[3:])
            stalls.append(LoopStall(float(kv["ms"]), float(kv["cpu_ms"]), float(kv["runqueue_ms"]), float(kv["at"]),
                                    float(kv.get("others_cpu_ms", 0)), float(kv.get("others_runqueue_ms", 0)),
                                    float(kv.get("steal_ms", 0))))
        elif line.startswith("faultkit: loop stuck"):
            at, _, where = line.removeprefix("faultkit: loop stuck at=").partition(" loop: ")
            stack, _, rest = where.partition(" | ")
            if where.startswith(BLOCKING_FRAMES):
                seen.append((float(at), stack))
            elif where.startswith(IDLE_FRAME) and rest.startswith(IDLE_KERNEL):
                idle.append(float(at))
    for i, s in enumerate(stalls):
        during = lambda at: s.at - s.ms / 1000 <= at <= s.at  # noqa: E731
        blocking = [where for at, where in seen if during(at)]
        if blocking:
            stalls[i] = replace(s, seen_at=blocking[0])
        elif any(map(during, idle)):
            stalls[i] = replace(s, seen_idle=True)
    return [s for s in stalls if s.at >= since]


def loop_lag_ms(proc: Proc, since: float = 0.0) -> float:
    """The longest event-loop stall a ``loop_probe`` worker logged since ``since`` (0 when none passed
    ``LOOP_LOG_MS``)."""
    return max((s.ms for s in loop_stalls(proc, since)), default=0.0)


def reused_pages(proc: Proc) -> int:
    """Pages a ``reuse_after_hold`` prefill overwrote after their hold."""
    return sum(int(line.split("pages=")[1].split()[0]) for line in proc.log.read_text(errors="replace").splitlines()
               if line.startswith("faultkit: reused"))


def _install(faults: Faults) -> None:
    """Patch this process's worker code with ``faults`` before it starts."""
    rng = random.Random(faults.seed or None)
    if faults.stall_p or faults.late_p:
        from decode_worker.transfer import agent

        def on_copy_thread(method):
            def faulty(self, *args):
                if not threading.current_thread().name.startswith("kv-read"):
                    return method(self, *args)
                if rng.random() < faults.stall_p:
                    time.sleep(rng.uniform(0, faults.stall_s))
                result = method(self, *args)
                if rng.random() < faults.late_p:
                    time.sleep(rng.uniform(0, faults.late_s))
                return result
            return faulty

        agent.KVAgent._copy_mapped = on_copy_thread(agent.KVAgent._copy_mapped)
        agent.KVAgent._post = on_copy_thread(agent.KVAgent._post)
    if faults.inline_bytes is not None:
        from decode_worker.transfer import agent

        agent.INLINE_BYTES = faults.inline_bytes
    if faults.reuse_after_hold:
        _reuse_after_hold(faults.expire_every_s)
    if faults.hold_delay_s:
        _delay_holds(faults.hold_delay_s)
    if faults.loop_probe:
        _probe_loop()
    if faults.poison_rid:
        _poison(faults.poison_rid, faults.poison_after)


def _poison(rid: str, after: int) -> None:
    """Every forward of a batch holding request ``rid`` past ``after`` output tokens raises."""
    from decode_worker.scheduler.scheduler import Scheduler

    forward = Scheduler._forward

    def poisoned(self, batch):
        if any(r.rid == rid and len(r.seq.output_ids) >= after for r in batch.reqs):
            raise RuntimeError(f"faultkit: poisoned row {rid}")
        return forward(self, batch)

    Scheduler._forward = poisoned


def _delay_holds(delay_s: float) -> None:
    """Prefill: each PD prompt's computed KV reaches the hand-off ``delay_s`` late (its handshake waits meanwhile)."""
    import asyncio

    from decode_worker.pd.prefill import KVHandoff

    hold = KVHandoff.hold

    def late_hold(self, held) -> bool:
        if held.prompt.bootstrap is None:
            return False
        asyncio.get_running_loop().call_later(delay_s, hold, self, held)
        return True

    KVHandoff.hold = late_hold


def _reuse_after_hold(every_s: float) -> None:
    """Prefill: no shared prefixes; expire leases every ``every_s``; overwrite an expired hand-off's pages."""
    import torch

    from decode_worker.config import ServerConfig
    from decode_worker.engine.engine import Engine
    from decode_worker.pd import prefill

    ServerConfig.radix_cache = property(lambda self: False)
    expire, release = prefill.KVHandoff.expire, prefill.KVHandoff._release

    def overwrite(self, lease) -> None:
        """Another prompt's KV, as a reuse would leave: finite values (random bytes would make NaNs, which poison
        attention even in the slots past a prompt's end that reuse leaves stale and attention weighs by 0)."""
        pages = lease.held.prompt_pages()
        self.pool.buffer[pages] = torch.randn(self.pool.buffer[pages].shape).to(self.pool.buffer.dtype)
        print(f"faultkit: reused pages={len(pages)} room={lease.room}", file=sys.stderr, flush=True)

    def expire_and_reuse(self) -> None:
        now = time.monotonic()
        for lease in [lease for lease in self.handed.values() if lease.expires < now]:
            overwrite(self, lease)
        expire(self)

    def release_and_reuse(self, room: int, lease_id: int) -> None:
        lease = self.handed.get(lease_id)
        if lease is not None and lease.room == room:  # decode is done with it: prefill may reuse it at once
            overwrite(self, lease)
        release(self, room, lease_id)

    async def expire_often(self) -> None:
        while True:
            await asyncio.sleep(every_s)
            self.handoff.expire()

    prefill.KVHandoff.expire = expire_and_reuse
    prefill.KVHandoff._release = release_and_reuse
    Engine._expire_leases = expire_often


LOOP_LOG_MS = 20.0


def _log_line(line: str) -> None:
    """One write per line to stderr, so lines from two threads never interleave."""
    os.write(2, (line + "\n").encode())


def _stack(frame, depth: int) -> list:
    """``frame`` and its callers, innermost first, at most ``depth``."""
    out = []
    while frame is not None and len(out) < depth:
        out.append(frame)
        frame = frame.f_back
    return out


def _probe_loop() -> None:
    """Tick every 5 ms on the worker's event loop; log each tick that ran over ``LOOP_LOG_MS`` late, with how the
    loop's thread spent it (``LoopStall``)."""
    from decode_worker.engine.engine import Engine

    start = Engine.start

    def schedstat() -> tuple[float, float]:
        """(running, waiting for a core) of this thread so far, in seconds."""
        with open("/proc/thread-self/schedstat") as f:
            run_ns, wait_ns = f.read().split()[:2]
        return int(run_ns) / 1e9, int(wait_ns) / 1e9

    def threads_schedstat() -> dict[str, tuple[float, float]]:
        """(running, waiting for a core) of every thread of this process so far, by thread id, in seconds."""
        out = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    run_ns, wait_ns = f.read().split()[:2]
            except OSError:
                continue  # a thread that just ended
            out[tid] = (int(run_ns) / 1e9, int(wait_ns) / 1e9)
        return out

    def steal() -> list[float]:
        """Time the hypervisor ran something else on each of this machine's cores so far, in seconds."""
        with open("/proc/stat") as f:
            cores = [line.split() for line in f if line.startswith("cpu") and not line.startswith("cpu ")]
        return [int(fields[8]) / os.sysconf("SC_CLK_TCK") for fields in cores]

    ticked = [time.monotonic()]  # the probe's last tick, read by the watchdog

    async def probe() -> None:
        me, threads, ticks = str(threading.get_native_id()), threads_schedstat(), 0
        threading.Thread(target=watchdog, args=(threading.get_ident(), me), daemon=True, name="loop-watchdog").start()
        while True:
            t0, (run0, wait0), stolen0 = time.monotonic(), schedstat(), steal()
            ticked[0] = t0
            await asyncio.sleep(0.005)
            lag, (run1, wait1) = time.monotonic() - t0 - 0.005, schedstat()
            ticks += 1
            if lag * 1000 > LOOP_LOG_MS:
                now = threads_schedstat()
                python = {str(t.native_id) for t in threading.enumerate()} - {me}  # only these can hold the GIL
                deltas = [(now[t][0] - was[0], now[t][1] - was[1]) for t, was in threads.items() if t in now and t in python]
                stolen = max((b - a for a, b in zip(stolen0, steal())), default=0.0)
                _log_line(f"faultkit: loop stall ms={lag * 1000:.1f} cpu_ms={(run1 - run0) * 1000:.1f} "
                          f"runqueue_ms={(wait1 - wait0) * 1000:.1f} at={time.time():.3f} "
                          f"others_cpu_ms={max((r for r, _ in deltas), default=0) * 1000:.1f} "
                          f"others_runqueue_ms={max((w for _, w in deltas), default=0) * 1000:.1f} "
                          f"steal_ms={stolen * 1000:.1f}")
            if lag * 1000 > LOOP_LOG_MS or ticks % 10 == 0:  # the window of the next stall starts here
                threads = threads_schedstat()

    def kernel_state(native_id: str) -> str:
        """A thread's scheduler state and the kernel function it sleeps in (``S futex_wait``: the GIL or a lock,
        ``D``: disk or memory reclaim), for the log: a thread that holds the GIL while it sleeps in the kernel
        shows here as the one not waiting on a futex."""
        try:
            with open(f"/proc/self/task/{native_id}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
            with open(f"/proc/self/task/{native_id}/wchan") as f:
                return f"{state} {f.read() or '-'}"
        except OSError:
            return "?"

    def watchdog(loop_thread: int, loop_native_id: str) -> None:
        """Where the loop's thread is while a tick is over ``LOOP_LOG_MS`` late, once per stall: the line a blocking
        call shows in. (A stall with no such line had the GIL held by another thread for all of it.)"""
        reported = 0.0
        while True:
            time.sleep(0.02)
            last = ticked[0]
            if time.monotonic() - last > LOOP_LOG_MS / 1000 and last != reported:
                reported = last
                frames = sys._current_frames()
                where = " <- ".join(f"{f.f_code.co_filename.rsplit('/', 2)[-1]}:{f.f_lineno} {f.f_code.co_name}"
                                    for f in _stack(frames.get(loop_thread), 6))
                others = "; ".join(f"{t.name}: {frames[t.ident].f_code.co_name} [{kernel_state(str(t.native_id))}]"
                                   for t in threading.enumerate() if t.ident in frames and t.ident != loop_thread)
                _log_line(f"faultkit: loop stuck at={time.time():.3f} loop: {where} | kernel: "
                          f"{kernel_state(loop_native_id)} | others: {others}")

    async def start_with_probe(self) -> None:
        await start(self)
        self._loop_probe = asyncio.get_running_loop().create_task(probe())

    Engine.start = start_with_probe


def start_victim_prefill(name: str, log_dir: Path, die_at: int, *flags: str, env: dict[str, str] | None = None,
                         port: int = 0) -> Proc:
    """A real prefill worker that kills itself mid-way through its ``die_at``-th KV push (0: never); ``port`` 0: a
    free one."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "tests.faultkit", "die-at-transfer", str(die_at), "serve", "--role", "prefill",
           "--port", str(port), "--max-total-tokens", "8192", *flags]
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return start(name, cmd, f"http://127.0.0.1:{port}", log_dir, {**(env or {}), "PYTHONPATH": path})


def died_mid_transfer(proc: Proc) -> tuple[int, float] | None:
    """(room, wall time) of the push a victim died in, from its log; None if it did not die that way."""
    for line in proc.log.read_text(errors="replace").splitlines():
        if line.startswith("faultkit: SIGKILL mid-transfer"):
            fields = dict(kv.split("=") for kv in line.split()[3:])
            return int(fields["room"]), float(fields["at"])
    return None


def _die_at_transfer(n: int) -> None:
    """Patch the prefill's hand-off: the ``n``-th handshake answer goes out, then the process dies while its
    decode peer reads the pages the answer named."""
    from decode_worker.pd import prefill

    handshake, count = prefill.KVHandoff.handshake, itertools.count(1)

    def die(room: int) -> None:
        print(f"faultkit: SIGKILL mid-transfer room={room} at={time.time()}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    async def handshake_then_death(self, body) -> dict:
        answer = await handshake(self, body)
        if next(count) == n:
            asyncio.get_running_loop().call_later(0.002, die, body.room)  # once the answer is written
        return answer

    prefill.KVHandoff.handshake = handshake_then_death


# ---- router-like traffic -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Peer:
    """A prefill endpoint requests may bootstrap from (a real worker or a stub): its URL and handshake port."""

    name: str
    url: str

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @classmethod
    def of(cls, proc: Proc | StubPrefill) -> Peer:
        return cls(proc.name, proc.url)


@dataclass
class Outcome:
    """One request as its client saw it. ``status`` None: the client gave up (an abort) or never got an answer."""

    decode: str
    peer: str
    prompt: int
    mode: str
    room: int
    n: int
    started: float
    ended: float = 0.0
    status: int | None = None
    message: str = ""
    output: list[int] = field(default_factory=list)

    @property
    def latency(self) -> float:
        return self.ended - self.started

    @property
    def aborted(self) -> bool:
        return self.mode.startswith("abort") and self.status is None


@dataclass
class Mix:
    """What traffic looks like in one episode. Weights need not sum to one."""

    decodes: list[Proc]
    peers: dict[Peer, float]
    concurrency: int = 8
    max_new_tokens: tuple[int, int] = (4, 8)
    modes: dict[str, float] = field(
        default_factory=lambda: {"full": 5, "stream": 3, "abort_early": 1, "abort_stream": 1})
    timeout_s: float = 90.0


async def one_request(client: httpx.AsyncClient, mix: Mix, ref: Reference, rng: random.Random,
                      prompt: int | None = None) -> Outcome:
    """Do what a PD router does (the same body to prefill and decode at once), as the mode says."""
    decode = rng.choice(mix.decodes)
    peer = rng.choices(list(mix.peers), weights=list(mix.peers.values()))[0]
    mode = rng.choices(list(mix.modes), weights=list(mix.modes.values()))[0]
    prompt = rng.randrange(len(ref.prompts)) if prompt is None else prompt
    n = rng.randint(*mix.max_new_tokens)
    room = rng.getrandbits(63)
    body = {"text": ref.prompts[prompt], "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": peer.port, "bootstrap_room": room}
    out = Outcome(decode.name, peer.name, prompt, mode, room, n, time.monotonic())
    prefill = asyncio.ensure_future(client.post(peer.url + "/generate", json=body, timeout=mix.timeout_s))
    try:
        if mode == "abort_early":  # gone at a random point, often before the KV arrived
            await asyncio.wait_for(_call(client, decode.url, body, out, stream=False, timeout=mix.timeout_s),
                                   rng.uniform(0.05, 1.5))
        else:
            await _call(client, decode.url, body, out, stream=mode != "full", timeout=mix.timeout_s,
                        stop_after=rng.randint(1, 3) if mode == "abort_stream" else None)
    except (asyncio.TimeoutError, httpx.HTTPError) as e:
        out.message = out.message or repr(e)
    out.ended = out.ended or time.monotonic()
    try:
        await prefill
    except httpx.HTTPError:
        pass  # a killed or stalled prefill is what some episodes are about
    return out


async def _call(client: httpx.AsyncClient, url: str, body: dict, out: Outcome, stream: bool, timeout: float,
                stop_after: int | None = None) -> None:
    if not stream:
        r = await client.post(url + "/generate", json=body, timeout=timeout)
        out.ended, out.status = time.monotonic(), r.status_code
        data = r.json()
        if r.status_code == 200:
            out.output = data["output_ids"]
        else:
            out.message = data["error"]["message"]
        return
    chunks = 0
    async with client.stream("POST", url + "/generate", json={**body, "stream": True}, timeout=timeout) as r:
        if r.status_code != 200:
            out.ended, out.status = time.monotonic(), r.status_code
            out.message = json.loads(await r.aread())["error"]["message"]
            return
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                out.ended, out.status = time.monotonic(), 200
                return
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if "error" in event:  # a failure after the stream started arrives as its last event
                out.status, out.message = event["error"]["code"], event["error"]["message"]
                out.ended = time.monotonic()
                return
            out.output = event["output_ids"]
            chunks += 1
            unfinished = len(out.output) < body["sampling_params"]["max_new_tokens"]
            if stop_after is not None and chunks >= stop_after and unfinished:
                out.ended = time.monotonic()
                out.message = f"client left after {chunks} chunks"
                return  # leaving the block closes the connection mid-stream
    out.message = "the stream ended without [DONE]"


async def run_traffic(mix: Mix, ref: Reference, seed: int, stop: asyncio.Event) -> list[Outcome]:
    """``mix.concurrency`` clients sending requests back to back until ``stop`` is set."""
    outcomes: list[Outcome] = []
    limits = httpx.Limits(max_connections=4 * mix.concurrency + 8, max_keepalive_connections=2 * mix.concurrency)

    async def client_loop(rng: random.Random) -> None:
        while not stop.is_set():
            out = await one_request(client, mix, ref, rng)
            outcomes.append(out)
            if out.status != 200 and not out.aborted:
                await asyncio.sleep(0.2)  # a dead peer fails at once: do not spin on it

    async with httpx.AsyncClient(limits=limits) as client:
        await asyncio.gather(*(client_loop(random.Random(seed * 1000 + i)) for i in range(mix.concurrency)))
    return outcomes


# ---- checks ------------------------------------------------------------------------------------------------------

STATES = ("free", "used", "evictable", "locked")


def cache_pages(proc: Proc) -> dict[str, dict[str, int]]:
    """Pages per tier and state (plus ``total``) from /server_info."""
    cache = httpx.get(proc.url + "/server_info", timeout=10).json()["cache"]
    return {tier: cache[tier] for tier in ("device", "host") if tier in cache}


def metric_pages(proc: Proc) -> dict[str, dict[str, int]]:
    """``decode_worker_cache_pages{tier,state}`` from /metrics."""
    pages: dict[str, dict[str, int]] = {}
    for line in httpx.get(proc.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("decode_worker_cache_pages{"):
            labels, value = line[len("decode_worker_cache_pages{"):].split("} ")
            kv = dict(part.split("=") for part in labels.split(","))
            pages.setdefault(kv["tier"].strip('"'), {})[kv["state"].strip('"')] = int(float(value))
    return pages


def wait_idle(proc: Proc, timeout_s: float = 30.0) -> dict[str, dict[str, int]]:
    """Until the worker has no live request, no locked page in any tier and no request-owned L1 page."""
    deadline = time.monotonic() + timeout_s
    while True:
        load = httpx.get(proc.url + "/get_load", timeout=10).json()
        pages = cache_pages(proc)
        if load["num_reqs"] == 0 and pages["device"]["used"] == 0 and all(t["locked"] == 0 for t in pages.values()):
            return pages
        if time.monotonic() > deadline:
            raise AssertionError(f"{proc.name} not idle after {timeout_s}s: load {load}, pages {pages}\n"
                                 f"{proc.tail(30)}")
        time.sleep(0.25)


def assert_accounting(proc: Proc) -> dict[str, dict[str, int]]:
    """In every tier free + used + evictable + locked == total, and /metrics says what /server_info says."""
    pages = cache_pages(proc)
    for tier, p in pages.items():
        assert sum(p[s] for s in STATES) == p["total"], f"{proc.name} {tier}: {p}"
    exported = metric_pages(proc)
    assert exported == {tier: {s: p[s] for s in STATES} for tier, p in pages.items()}, (exported, pages)
    return pages


def assert_healthy(proc: Proc) -> None:
    r = httpx.get(proc.url + "/health", timeout=10)
    assert r.status_code == 200, f"{proc.name} /health {r.status_code}: {r.text}\n{proc.tail(30)}"


async def probe(decode: Proc, peer: Peer, ref: Reference, prompts: list[int], n: int, seed: int) -> list[str]:
    """Greedy outputs of fixed prompts, one at a time; returns a line per mismatch or failure."""
    rng = random.Random(f"{seed}-{decode.name}")  # rooms unique per decode: probes run side by side
    mix = Mix([decode], {peer: 1}, modes={"full": 1}, max_new_tokens=(n, n))
    bad = []
    async with httpx.AsyncClient() as client:
        for i in prompts:
            out = await one_request(client, mix, ref, rng, prompt=i)
            if out.status != 200 or not ref.matches(i, out.output):
                bad.append(f"{decode.name} probe {i}: {out.status} {out.message} {out.output} != {ref.outputs[i][:n]}")
    return bad


def check_worker(proc: Proc, idle_timeout_s: float = 30.0) -> dict[str, dict[str, int]]:
    """What must hold after every fault: healthy, idle with nothing locked, pages accounted for."""
    assert_healthy(proc)
    wait_idle(proc, idle_timeout_s)
    return assert_accounting(proc)


def log_errors(proc: Proc) -> list[str]:
    """What a worker's log says went wrong inside it: ERROR records, and the exception line of each traceback."""
    lines = proc.log.read_text(errors="replace").splitlines()
    found = []
    for i, line in enumerate(lines):
        if line.startswith("Traceback"):
            found.append(next((l for l in lines[i + 1:] if l and not l[0].isspace()), line))
        elif (" ERROR " in line or line.startswith("ERROR")) and not _ucx_peer_gone(line):
            found.append(line)
    return found


def _ucx_peer_gone(line: str) -> bool:
    """UCX's own log of a connection to a prefill that was killed: the read fails with peer_lost, as it must."""
    return "UCX  ERROR" in line and any(s in line for s in ("Connection refused", "Connection reset", "somaxconn"))


def summarize(outcomes: list[Outcome]) -> dict:
    """Counts by status (``aborted`` for client aborts, ``none`` for no answer) and latency percentiles."""
    statuses = Counter("aborted" if o.aborted else str(o.status).lower() for o in outcomes)
    lat = sorted(o.latency for o in outcomes if o.status == 200)
    return {"requests": len(outcomes), "status": dict(sorted(statuses.items())),
            "p50_s": round(statistics.median(lat), 3) if lat else None,
            "p99_s": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3) if lat else None}


def wrong_outputs(outcomes: list[Outcome], ref: Reference) -> list[str]:
    """Every successful (or partially streamed) output must be a prefix of the reference: wrong KV derails it."""
    return [f"{o.decode} prompt {o.prompt} room {o.room}: {o.output} != {ref.outputs[o.prompt][:len(o.output)]}"
            for o in outcomes if o.output and not ref.matches(o.prompt, o.output)]


def unexpected(outcomes: list[Outcome], faulty: set[str] = frozenset(), deadline_s: float = 0.0,
               gone: set[str] = frozenset()) -> list[str]:
    """Requests that broke the rules: only a request whose prefill peer is in ``faulty`` may fail, with a clear
    502/504 within ``deadline_s``; one sent to a decode in ``gone`` (shutting down) may get 503 or no answer."""
    bad = []
    for o in outcomes:
        if o.aborted or o.status == 200:
            continue
        if o.peer in faulty and o.status in (502, 504) and "prefill" in o.message and o.latency <= deadline_s:
            continue
        if o.decode in gone and (o.status == 503 or o.status is None):
            continue
        bad.append(f"{o.decode} via {o.peer} {o.mode} room {o.room}: {o.status} after {o.latency:.1f}s: {o.message}")
    return bad


def _main(argv: list[str]) -> int:
    if argv[:1] == ["die-at-transfer"] and len(argv) >= 3:
        if int(argv[1]) > 0:
            _die_at_transfer(int(argv[1]))
        argv = argv[2:]
    if argv[:1] != ["serve"]:
        print("usage: python -m tests.faultkit [die-at-transfer N] serve [decode-worker serve flags]", file=sys.stderr)
        return 2
    _install(Faults(**json.loads(os.environ.get(FAULTS_ENV) or "{}")))
    from decode_worker.cli import main

    return main(argv)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
