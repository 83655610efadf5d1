"""Delta-KV transfer throughput between two processes over the UCX data plane, against a local memcpy.

This process is the decode side (``KVReceiver``); it spawns itself with ``--role sender`` as the prefill
side (``KVSender``). A transfer is timed on the sender from ``send()`` to the receiver's DONE, so control
round trips count. The memcpy baseline is ``torch`` ``copy_`` of the same bytes within the sender process,
one sample after each timed step, so both see the same machine (absolute speeds on a shared machine drift by
2-3x within minutes; the ratio is what to compare). It runs on one thread: the CMA copy UCX does here is one
thread too, and torch's two-thread copy is erratic on a busy 2-core machine (medians 0.1-60 GB/s).

    python bench/bench_transfer.py [--reps 15] [--progress-mode thread|blocking] [--busy]

``--busy`` runs a torch matmul loop in a second thread of the receiver while it receives, as the decode
step will. Prints one JSON line.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import uvloop

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from decode_worker.transfer import ucx_channel  # noqa: E402
from decode_worker.transfer.ucx_receiver import KVReceiver  # noqa: E402
from decode_worker.transfer.ucx_sender import KVSender  # noqa: E402
from decode_worker.transfer.wire import Trailer  # noqa: E402

SIZES_MB = (1, 16, 64)
WARMUP = 3
IN_FLIGHT = 4


def plan(reps: int) -> list[tuple[str, int, list[int]]]:
    """Steps in sending order, as (kind, nbytes, rooms sent at once): per size a few warm-up transfers
    (wire-up, page faults), ``reps`` single transfers, then ``reps`` groups of ``IN_FLIGHT`` concurrent ones."""
    rooms = itertools.count(1)
    return [(kind, mb << 20, [next(rooms) for _ in range(width)])
            for mb in SIZES_MB
            for kind, count, width in (("warmup", WARMUP, 1), ("serial", reps, 1), ("concurrent", reps, IN_FLIGHT))
            for _ in range(count)]


async def receive(args: argparse.Namespace) -> dict[str, dict[int, list[float]]]:
    rx = await KVReceiver.start()
    sinks = {mb << 20: [torch.ones(mb << 20, dtype=torch.uint8) for _ in range(IN_FLIGHT)] for mb in SIZES_MB}
    futures = [rx.expect(room, n, sinks[n][i], deadline_s=300)
               for _, n, rooms in plan(args.reps) for i, room in enumerate(rooms)]
    sender = subprocess.Popen([sys.executable, __file__, "--role", "sender", "--reps", str(args.reps),
                               "--progress-mode", args.progress_mode],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    sender.stdin.write(base64.b64encode(rx.address).decode() + "\n")
    sender.stdin.flush()
    await asyncio.gather(*futures)
    out, _ = await asyncio.to_thread(sender.communicate)
    await rx.close()
    if sender.returncode:
        raise SystemExit(f"sender failed with {sender.returncode}")
    return {kind: {int(n): v for n, v in by_size.items()} for kind, by_size in json.loads(out).items()}


async def send(args: argparse.Namespace) -> None:
    """Time each step from the first send() to the last DONE; print {kind: {nbytes: [seconds]}}."""
    address = base64.b64decode(sys.stdin.readline())
    torch.set_num_threads(1)
    tx = await KVSender.start()
    payloads = {mb << 20: torch.randint(0, 256, (mb << 20,), dtype=torch.uint8) for mb in SIZES_MB}
    scratch = {n: torch.ones_like(p) for n, p in payloads.items()}
    times: dict[str, dict[int, list[float]]] = {"serial": {}, "concurrent": {}, "memcpy": {}}
    for kind, n, rooms in plan(args.reps):
        t0 = time.perf_counter()
        await asyncio.gather(*(tx.send(address, room, payloads[n], Trailer(room), deadline_s=60) for room in rooms))
        t1 = time.perf_counter()
        scratch[n].copy_(payloads[n])
        if kind != "warmup":
            times[kind].setdefault(n, []).append(t1 - t0)
            times["memcpy"].setdefault(n, []).append(time.perf_counter() - t1)
    await tx.close()
    print(json.dumps(times))


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
    if args.busy:
        threading.Thread(target=busy_loop, args=(stop,), daemon=True).start()
    times = uvloop.run(receive(args))
    stop.set()
    result = {"bench": "kv_transfer", "progress_mode": args.progress_mode, "busy": args.busy, "reps": args.reps,
              "ucx": "first send() until the last DONE of a step", "memcpy": "torch copy_, 1 thread",
              "stat": "median"}
    for mb in SIZES_MB:
        n = mb << 20
        copy = n / statistics.median(times["memcpy"][n]) / 1e9
        serial = n / statistics.median(times["serial"][n]) / 1e9
        concurrent = IN_FLIGHT * n / statistics.median(times["concurrent"][n]) / 1e9
        result[f"{mb}MB"] = {"ucx_gbps": round(serial, 2), "memcpy_gbps": round(copy, 2),
                             "ratio": round(serial / copy, 2), f"ucx_gbps_{IN_FLIGHT}_in_flight": round(concurrent, 2),
                             f"ratio_{IN_FLIGHT}_in_flight": round(concurrent / copy, 2)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
