"""The PD data path between two processes: decode copies delta pages straight out of prefill's KV pool.

This process is the decode side; it spawns itself with ``--role prefill``, which allocates a shared pool of known
bytes and registers it (``transfer/agent.py``'s ``KVAgent``, as a prefill worker does) and serves reads. Each step
times what a PD request waits for once prefill has answered the handshake: ``KVAgent.read`` of the delta's pages,
at random indices in both pools, from its call until every byte is in decode's pool (the path ``pd/decode.py``
takes; reads of 2 MB and more run on the copy thread). Bytes are checked after every step.

Both processes run on this host, so ``pd_path`` is the same-host path a decode worker takes by default: prefill's
pool mapped read-only, pages copied with memcpy (``core/shared_memory.py``). ``pd_path_nixl`` times the same read
over NIXL's UCX backend, the path between hosts (here UCX copies with CMA, ``process_vm_readv``), as a decode
worker with ``DECODE_WORKER_PD_SHARED_MEMORY=off`` would. ``pd_path_runs`` times a default read of a run of
consecutive pages on both sides, as fresh allocations mostly are: one copy for the whole run.

Two baselines in the same run, each timed once after every transfer step so all three see the same machine
(absolute speeds on this shared 2-core machine drift 2-3x within minutes: compare the ratios):

- ``page_copy``: the same number of pages copied at random inside one pool (``buffer[dst] = buffer[src]``), the
  copy a local cache hit or a same-process hand-off would do; ``page_loop`` copies them one ``copy_`` per page
  instead (no temporary: the fastest copy of scattered pages in one thread, reported beside it);
- ``memcpy``: one contiguous ``copy_`` of the same bytes, one thread.

Before each timed copy the shared 32 MB L3 is flushed, so no copy reads what the one before left in cache.

Two KV layouts: ``smollm2`` (the embedded model on CPU: 30 layers, 3 KV heads, float32, 16-token pages, so a page
is one run of 720 KB) and ``bf16_4k`` (32 layers, 2 KV heads, bfloat16: one run of 256 KB, the layout the old
staging path was measured with). The pool is page-major (``buffer[page, layer, kv, ...]``), so a transfer moves
one run, and names one descriptor, per page; runs of neighbouring pages merge. (Layer-major pools, the layout
before this one, moved ``2 * layers`` runs of 12 KB or 4 KB per page.)

The staged path this replaced (gather into a buffer, UCX send, scatter) measured 0.07 / 0.21 / 0.26 of memcpy at
1 / 16 / 64 MB with the ``bf16_4k`` layout; it is gone, so it is not re-run here.

    python benchmarks/bench_transfer.py [--reps 10]

Prints one JSON line.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
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

from decode_worker.cache.pool import KVLayout, KVPool  # noqa: E402
from decode_worker.transfer.agent import KVAgent  # noqa: E402
from decode_worker.transfer.descriptors import PoolDescriptor  # noqa: E402

SIZES_MB = (1, 16, 64)
WARMUP = 3
LAYOUTS = {
    "smollm2": KVLayout("bench@0", num_layers=30, num_kv_heads=3, head_dim=64, page_size=16, dtype=torch.float32),
    "bf16_4k": KVLayout("bench@1", num_layers=32, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.bfloat16),
}
POOL_BYTES = 160 << 20  # per side and layout: room for 64 MB at random indices
EVICT_BYTES = 64 << 20  # twice the L3


def pool_of(layout: KVLayout, seed: int | None, shared: bool = False) -> KVPool:
    """A host pool of ``POOL_BYTES``; with ``seed``, filled with bytes both processes can regenerate."""
    pool = KVPool(layout, POOL_BYTES // layout.page_bytes, shared=shared)
    if seed is not None:
        pool.buffer.view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(seed))
    return pool


def serve(args: argparse.Namespace) -> None:
    """Prefill: register one seeded pool per layout, print what decode needs to read them, and drive progress (and
    count release notifications) until decode closes our stdin."""
    pools = {name: pool_of(layout, seed, shared=True) for seed, (name, layout) in enumerate(LAYOUTS.items(), 1)}
    agents = {name: KVAgent(pool.buffer, "prefill", pool.shared) for name, pool in pools.items()}
    print(json.dumps({name: {"metadata": base64.b64encode(a.metadata()).decode(), "pool": a.pool.to_dict()}
                      for name, a in agents.items()}), flush=True)
    done, released = threading.Event(), 0
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    while not done.is_set():
        released += sum(len(a.notifications()) for a in agents.values())
        time.sleep(0.0005)
    print(json.dumps({"released": released}), flush=True)


async def measure(args: argparse.Namespace) -> dict:
    prefill = subprocess.Popen([sys.executable, __file__, "--role", "prefill"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    peers = json.loads(await asyncio.to_thread(prefill.stdout.readline))
    evict = cache_evictor()
    result, reads = {}, 0
    for seed, (name, layout) in enumerate(LAYOUTS.items(), 1):
        pool = pool_of(layout, None)
        agent = KVAgent(pool.buffer, "decode")
        peer = agent.add_peer(base64.b64decode(peers[name]["metadata"]), PoolDescriptor.from_dict(peers[name]["pool"]))
        if peer.mapping is not None:
            await peer.mapping  # prefill's pool file, asked for in a thread
        if peer.mapped is None:
            raise SystemExit(f"{name}: prefill's pool could not be mapped, see the log")
        mapping = peer.mapped
        reference = pool_of(layout, seed).buffer  # prefill's bytes, to check each read against
        rng = torch.Generator().manual_seed(seed)
        rows = {}
        for mb in SIZES_MB:
            n_pages = max(1, (mb << 20) // layout.page_bytes)
            times: dict[str, list[float]] = {"pd_path": [], "pd_path_nixl": [], "pd_path_runs": [], "page_copy": [],
                                             "page_loop": [], "memcpy": []}
            src, dst = bytes_of(n_pages * layout.page_bytes), bytes_of(n_pages * layout.page_bytes)
            for step in range(WARMUP + args.reps):
                for path, peer.mapped in (("pd_path", mapping), ("pd_path_nixl", None)):  # None: as from another host
                    theirs, ours = (torch.randperm(pool.num_pages, generator=rng)[:n_pages] for _ in range(2))
                    evict()
                    t0 = time.perf_counter()
                    await agent.read(step, peer, ours.tolist(), theirs.tolist(), asyncio.get_running_loop().time() + 60)
                    elapsed = time.perf_counter() - t0
                    agent.notify(peer.name, b"release")  # as pd/decode.py does, after the read: not on its path
                    reads += 1
                    if not torch.equal(pool.page_data(ours).view(torch.uint8), reference[theirs].view(torch.uint8)):
                        raise SystemExit(f"{name} {mb} MB {path}: bytes read differ from prefill's")
                    if step >= WARMUP:
                        times[path].append(elapsed)
                peer.mapped = mapping
                if step < WARMUP:
                    continue
                start_theirs, start_ours = (int(torch.randint(pool.num_pages - n_pages + 1, (1,), generator=rng))
                                            for _ in range(2))
                evict()
                t0 = time.perf_counter()
                await agent.read(step, peer, list(range(start_ours, start_ours + n_pages)),
                                 list(range(start_theirs, start_theirs + n_pages)), asyncio.get_running_loop().time() + 60)
                times["pd_path_runs"].append(time.perf_counter() - t0)
                a, b = (torch.randperm(pool.num_pages, generator=rng)[:n_pages] for _ in range(2))
                evict()
                times["page_copy"].append(timed(lambda: pool.buffer.__setitem__(b, pool.buffer[a])))
                evict()
                times["page_loop"].append(timed(lambda: [pool.buffer[d].copy_(pool.buffer[s])
                                                         for s, d in zip(a.tolist(), b.tolist())]))
                evict()
                times["memcpy"].append(timed(lambda: dst.copy_(src)))
            nbytes = n_pages * layout.page_bytes
            gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
            rows[f"{mb}MB"] = {"bytes": nbytes, "pd_path_ms": round(statistics.median(times["pd_path"]) * 1e3, 3),
                               "pd_path_gbps": round(gbps["pd_path"], 2), "page_copy_gbps": round(gbps["page_copy"], 2),
                               "memcpy_gbps": round(gbps["memcpy"], 2),
                               "ratio_vs_page_copy": round(gbps["pd_path"] / gbps["page_copy"], 2),
                               "page_loop_gbps": round(gbps["page_loop"], 2),
                               "ratio_vs_page_loop": round(gbps["pd_path"] / gbps["page_loop"], 2),
                               "ratio_vs_memcpy": round(gbps["pd_path"] / gbps["memcpy"], 2),
                               "pd_path_nixl_ms": round(statistics.median(times["pd_path_nixl"]) * 1e3, 3),
                               "nixl_ratio_vs_page_copy": round(gbps["pd_path_nixl"] / gbps["page_copy"], 2),
                               "nixl_ratio_vs_memcpy": round(gbps["pd_path_nixl"] / gbps["memcpy"], 2),
                               "pd_path_runs_ms": round(statistics.median(times["pd_path_runs"]) * 1e3, 3),
                               "runs_ratio_vs_page_copy": round(gbps["pd_path_runs"] / gbps["page_copy"], 2)}
        agent.close()
        result[name] = {"page_bytes": layout.page_bytes, "runs_per_page": 1, **rows}
    prefill.stdin.close()
    released = json.loads(await asyncio.to_thread(prefill.stdout.readline))["released"]
    await asyncio.to_thread(prefill.wait)
    result["release_notifications"] = f"{released} of {reads}"
    return result


def cache_evictor():
    """A call that pushes everything out of the 32 MB L3 shared by both processes."""
    src, dst = bytes_of(EVICT_BYTES), bytes_of(EVICT_BYTES)
    return lambda: dst.copy_(src)


def bytes_of(nbytes: int) -> torch.Tensor:
    """Host bytes, touched now so no timed copy pays their page faults."""
    return torch.ones(nbytes, dtype=torch.uint8)


def timed(copy) -> float:
    t0 = time.perf_counter()
    copy()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--role", default="decode", choices=("decode", "prefill"), help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(1)  # memcpy and the page copy on one thread, as the CMA read is
    if args.role == "prefill":
        serve(args)
        return
    result = {"bench": "kv_transfer", "reps": args.reps, "stat": "median",
              "pd_path": "KVAgent.read of random pages into random pages, bytes checked: prefill's pool mapped "
                         "(same host, the default)",
              "pd_path_nixl": "the same read over NIXL READ (UCX backend, CMA here), as between hosts",
              "page_copy": "random pages inside one pool, 1 thread", "memcpy": "contiguous copy_, 1 thread",
              **uvloop.run(measure(args))}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
