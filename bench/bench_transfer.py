"""Delta-KV transfer throughput between two processes over the UCX data plane, against a local memcpy.

This process is the decode side (``KVReceiver``); it spawns itself with ``--role sender`` as the prefill
side (``KVSender``). Each step is timed from the sender's first ``send()`` to two ends, on the one
monotonic clock both processes share:

- delivered: the receiver's ``expect()`` future settled, i.e. every byte and the trailer are in the decode
  process (what a decode request waits for);
- acked: the sender got the receiver's DONE (when prefill may free its copy; one more control hop).

Payloads and receive buffers are huge-page host buffers (``core/host_memory.py``), as the staging pools
on both sides of PD lend them. The memcpy baseline is ``torch`` ``copy_`` of the same bytes between two
such buffers within the sender process, one sample after each timed step, so both see the same machine
(absolute speeds on a shared machine drift by 2-3x within minutes; the ratio is what
to compare). Before each timed copy (transfer, memcpy, CMA) both processes' shared 32 MB L3 is flushed:
otherwise whichever copy runs second reads what the first left in cache. The memcpy runs on one thread:
the CMA copy UCX does here is one thread too, and torch's two-thread copy is erratic on a busy 2-core
machine (medians 0.1-60 GB/s). For reference:

- ``memcpy_4k_pages_gbps``: the same copy between plain torch tensors;
- ``memcpy_hot_loop_gbps``: the copy repeated back to back. Up to 16 MB both buffers fit in the 32 MB L3
  here, so this runs faster than any single copy does; at 64 MB the two agree.

``pd_path`` rows time what a PD request waits for around the transfer too: prefill gathers the delta pages
from its KV pool into a staging buffer, sends it, and decode scatters it into its own pool, each copy through
``run_page_copy`` as ``pd/prefill.py`` and ``pd/decode.py`` do;
from the gather's start to the scatter's end. The pools are host ``KVPool``s as the product makes them, of
256 KB pages, the pages picked at random.

``fresh_buffer`` rows receive into a new, never-touched buffer each time, as the decode side did before it
kept its staging buffers (``transfer/staging.py``): the same transfer, paying first-touch page faults.

The transport's own ceiling is measured too: one ``process_vm_readv`` of the sender's payload into this
process, the single-threaded cross-process copy (CMA) that UCX's shared-memory zero-copy rendezvous does.

    python bench/bench_transfer.py [--reps 15] [--progress-mode thread|blocking] [--busy]

``--busy`` runs a torch matmul loop in a second thread of the receiver while it receives, as the decode
step will. Prints one JSON line.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import ctypes
import itertools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import uvloop

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from decode_worker.core.host_memory import host_buffer  # noqa: E402
from decode_worker.cache.pool import KVLayout, KVPool  # noqa: E402
from decode_worker.transfer import ucx_channel  # noqa: E402
from decode_worker.transfer.ucx_receiver import KVReceiver  # noqa: E402
from decode_worker.transfer.ucx_sender import KVSender  # noqa: E402
from decode_worker.transfer.staging import run_page_copy  # noqa: E402
from decode_worker.transfer.wire import Trailer  # noqa: E402
from decode_worker_kernels.page_copy import gather_pages, scatter_pages  # noqa: E402

SIZES_MB = (1, 16, 64)
WARMUP = 3
IN_FLIGHT = 4
LAYOUT = KVLayout("bench@0", num_layers=32, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.bfloat16)
EVICT_BYTES = 64 << 20  # twice the L3
POOL_PAGES = 512  # 256 KB pages (LAYOUT.page_bytes): 128 MB per side


def pd_pages(n: int, seed: int) -> torch.Tensor:
    """The pool pages holding an ``n``-byte delta, scattered across the pool as a running cache leaves them."""
    return torch.randperm(POOL_PAGES, generator=torch.Generator().manual_seed(seed))[:n // LAYOUT.page_bytes]


def staged(buf: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """``buf`` seen as the staging blob of ``pages``: ``[layer, 2, n, page_size, kv_heads, head_dim]``."""
    return buf.view(LAYOUT.dtype).view(LAYOUT.pages_shape(pages.numel()))


def plan(reps: int) -> list[list[tuple[str, int, list[int]]]]:
    """Steps in sending order, one group per size and kind, as (kind, nbytes, rooms sent at once): a few warm-up
    transfers (wire-up, page faults), ``reps`` single transfers, ``reps`` groups of ``IN_FLIGHT``
    concurrent ones, ``reps`` single transfers into fresh buffers (what a transfer costs without the
    staging pool: first-touch page faults), then ``reps`` single PD paths (gather, transfer, scatter)."""
    rooms = itertools.count(1)
    return [[(kind, mb << 20, [next(rooms) for _ in range(width)]) for _ in range(count)]
            for mb in SIZES_MB
            for kind, count, width in (("warmup", WARMUP, 1), ("serial", reps, 1), ("concurrent", reps, IN_FLIGHT),
                                       ("fresh", reps, 1), ("pd_path", reps, 1))]


async def receive(args: argparse.Namespace) -> dict[str, dict]:
    """Per group: expect its rooms, hand their push addresses to the sender, and time each step's delivery.

    Rooms are expected one group at a time: each expected room holds a posted receive, and a hundred at
    once would drain ucxx's pool of completion futures.
    """
    rx = await KVReceiver.start()
    sender = subprocess.Popen([sys.executable, __file__, "--role", "sender", "--reps", str(args.reps),
                               "--progress-mode", args.progress_mode],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    times: dict[str, dict] = {"acked": {}, "delivered": {}, "memcpy": {}, "memcpy_4k_pages": {}, "memcpy_hot": {},
                              "cma": {}}
    sinks = {mb << 20: [host_buffer(mb << 20).fill_(1) for _ in range(IN_FLIGHT)] for mb in SIZES_MB}
    pool = KVPool(LAYOUT, POOL_PAGES)
    evict = cache_evictor()
    settled: dict[int, float] = {}

    async def deliver(room: int, received: asyncio.Future, sink: torch.Tensor, pd_path: bool) -> None:
        await received
        if pd_path:
            pages = pd_pages(sink.numel(), 2 * room + 1)
            await run_page_copy(sink.numel(), scatter_pages, staged(sink, pages), pool.buffer, pages)
        settled[room] = time.perf_counter()

    for group in plan(args.reps):
        deliveries, addresses = [], {}
        for kind, n, rooms in group:
            for i, room in enumerate(rooms):
                sink = torch.empty(n, dtype=torch.uint8) if kind == "fresh" else sinks[n][i]
                received = rx.expect(room, n, sink, deadline_s=300)
                deliveries.append(deliver(room, received, sink, kind == "pd_path"))
                addresses[room] = base64.b64encode(rx.push_address(room)).decode()
        sender.stdin.write(json.dumps(addresses) + "\n")
        sender.stdin.flush()
        await asyncio.gather(*deliveries)
        report = json.loads(await asyncio.to_thread(sender.stdout.readline))
        n = group[0][1]
        if group[0][0] == "serial":
            times["cma"][n] = [evict() or cma_read(report["pid"], report["payload"], sinks[n][0], n)
                               for _ in range(args.reps)]
            times["memcpy_hot"][n] = report["hot"]
        for (kind, n, rooms), (t0, acked, copy, plain_copy) in zip(group, report["steps"], strict=True):
            if kind != "warmup":
                times["acked"].setdefault(kind, {}).setdefault(n, []).append(acked - t0)
                times["delivered"].setdefault(kind, {}).setdefault(n, []).append(max(settled[r] for r in rooms) - t0)
                times["memcpy"].setdefault(n, []).append(copy)
                times["memcpy_4k_pages"].setdefault(n, []).append(plain_copy)
    sender.stdin.close()
    await asyncio.to_thread(sender.wait)
    await rx.close()
    if sender.returncode:
        raise SystemExit(f"sender failed with {sender.returncode}")
    return times


async def send(args: argparse.Namespace) -> None:
    """Per group print (start, last DONE, memcpy seconds, plain-pages memcpy seconds) per step, the clock starting at the first send(),
    then wait for the next group's addresses with the payload in place, for the receiver's CMA reads."""
    torch.set_num_threads(1)
    tx = await KVSender.start()
    payloads = {mb << 20: host_buffer(mb << 20).copy_(torch.randint(0, 256, (mb << 20,), dtype=torch.uint8))
                for mb in SIZES_MB}
    scratches = {n: host_buffer(n).fill_(1) for n in payloads}
    plain = {n: (p.clone(), torch.ones_like(p)) for n, p in payloads.items()}  # torch's own 4 KB-page tensors
    pool = KVPool(LAYOUT, POOL_PAGES)
    pool.buffer.uniform_()
    evict = cache_evictor()

    async def push(kind: str, room: int, payload: torch.Tensor) -> None:
        if kind == "pd_path":
            pages = pd_pages(payload.numel(), 2 * room)
            await run_page_copy(payload.numel(), gather_pages, pool.buffer, pages, staged(payload, pages))
        await tx.send(addresses[room], room, payload, Trailer(room), deadline_s=60)

    for group in plan(args.reps):
        addresses = {int(room): base64.b64decode(a) for room, a in json.loads(sys.stdin.readline()).items()}
        payload, scratch, (plain_src, plain_dst) = payloads[group[0][1]], scratches[group[0][1]], plain[group[0][1]]
        steps = []
        for kind, _, rooms in group:
            evict()
            t0 = time.perf_counter()
            await asyncio.gather(*(push(kind, r, payload) for r in rooms))
            t1 = time.perf_counter()
            evict()
            copy = timed_copy(scratch, payload)
            evict()
            steps.append((t0, t1, copy, timed_copy(plain_dst, plain_src)))
        hot = [timed_copy(scratch, payload) for _ in range(args.reps)] if group[0][0] == "serial" else []
        print(json.dumps({"steps": steps, "hot": hot, "pid": os.getpid(), "payload": payload.data_ptr()}), flush=True)
    await tx.close()


def cache_evictor() -> Callable[[], None]:
    """A call that pushes everything out of the 32 MB L3 shared by both processes, so that each timed copy of
    a step (transfer, memcpy, CMA) starts from memory, as a copy of KV that was not just copied does."""
    src, dst = host_buffer(EVICT_BYTES).fill_(1), host_buffer(EVICT_BYTES)

    def evict() -> None:
        dst.copy_(src)
    return evict


def timed_copy(dst: torch.Tensor, src: torch.Tensor) -> float:
    t0 = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - t0


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def cma_read(pid: int, address: int, into: torch.Tensor, nbytes: int) -> float:
    """Seconds for one process_vm_readv of ``nbytes`` at ``address`` in process ``pid`` into ``into``."""
    local, remote = _IOVec(into.data_ptr(), nbytes), _IOVec(address, nbytes)
    t0 = time.perf_counter()
    done = _libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    elapsed = time.perf_counter() - t0
    if done != nbytes:
        raise OSError(ctypes.get_errno(), f"process_vm_readv read {done} of {nbytes} bytes")
    return elapsed


_libc = ctypes.CDLL("libc.so.6", use_errno=True)


def busy_loop(stop: threading.Event) -> None:
    a = torch.randn(512, 512)
    while not stop.is_set():
        a = torch.tanh(a @ a)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--progress-mode", default=ucx_channel.PROGRESS_MODE, choices=("thread", "blocking"))
    p.add_argument("--busy", action="store_true", help="compute in a second receiver thread meanwhile")
    p.add_argument("--role", default="receiver", choices=("receiver", "sender"), help=argparse.SUPPRESS)
    args = p.parse_args()
    ucx_channel.PROGRESS_MODE = args.progress_mode
    if args.role == "sender":
        uvloop.run(send(args))
        return
    stop = threading.Event()
    busy = threading.Thread(target=busy_loop, args=(stop,), daemon=True)
    if args.busy:
        busy.start()
    times = uvloop.run(receive(args))
    stop.set()
    if args.busy:
        busy.join()  # a torch op cut off by interpreter exit aborts the process
    result = {"bench": "kv_transfer", "progress_mode": args.progress_mode, "busy": args.busy, "reps": args.reps,
              "ucx": "first send() until the receiver holds every byte (delivered) / the sender got DONE (acked)",
              "memcpy": "torch copy_, 1 thread, huge-page buffers as staged",
              "cma": "one process_vm_readv, the transport's ceiling",
              "pd_path": "prefill's gather until decode's scatter ended, pages at random in 256 KB-page pools",
              "stat": "median", "ratio": "delivered / memcpy"}
    for mb in SIZES_MB:
        n = mb << 20
        copy = n / statistics.median(times["memcpy"][n]) / 1e9
        cma = n / statistics.median(times["cma"][n]) / 1e9
        plain_copy = n / statistics.median(times["memcpy_4k_pages"][n]) / 1e9
        hot = n / statistics.median(times["memcpy_hot"][n]) / 1e9
        row = {"memcpy_gbps": round(copy, 2), "memcpy_4k_pages_gbps": round(plain_copy, 2),
               "memcpy_hot_loop_gbps": round(hot, 2), "cma_gbps": round(cma, 2), "cma_ratio": round(cma / copy, 2)}
        for end in ("delivered", "acked"):
            for kind, width in (("serial", 1), ("concurrent", IN_FLIGHT)):
                gbps = width * n / statistics.median(times[end][kind][n]) / 1e9
                suffix = f"{end}" + ("" if width == 1 else f"_{width}_in_flight")
                row[f"ucx_gbps_{suffix}"] = round(gbps, 2)
                row[f"ratio_{suffix}"] = round(gbps / copy, 2)
        fresh = n / statistics.median(times["delivered"]["fresh"][n]) / 1e9
        row["ucx_gbps_delivered_fresh_buffer"] = round(fresh, 2)
        row["ratio_delivered_fresh_buffer"] = round(fresh / copy, 2)
        pd_path = statistics.median(times["delivered"]["pd_path"][n])
        row["pd_path_ms"] = round(pd_path * 1e3, 2)
        row["pd_path_gbps"] = round(n / pd_path / 1e9, 2)
        row["ratio_pd_path"] = round(row["pd_path_gbps"] / copy, 2)
        row["ratio"] = row["ratio_delivered"]
        row["delivered_vs_cma"] = round(row["ucx_gbps_delivered"] / cma, 2)
        row["ratio_delivered_vs_hot_loop"] = round(row["ucx_gbps_delivered"] / hot, 2)
        result[f"{mb}MB"] = row
    print(json.dumps(result))


if __name__ == "__main__":
    main()
