"""What an L1 -> L2 backup costs per token where L1 and L2 share the memory bus (a CPU worker), and how much it
slows the compute running beside it.

SmolLM2-135M's KV layout (30 layers, 3 KV heads, 64 dims, pages of 16 tokens, bfloat16: 23,040 bytes per
token). Each backup is one 256-token prefix (16 pages at scattered L1 and L2 ids), as the decode worker's
write-through policy queues one per request it caches, with a short gap between backups. Two figures:

- ``copy_us_per_token``: median wall time of one backup on the copy engine, per token;
- ``cpu_us_per_token``: CPU time the process spent on them (all threads), per token;
- ``load_back_ms`` (p50, p99): a 16-page load-back submitted behind 8 queued 7-page backups of other pages (a
  burst of write-throughs), from submission to done: what it waits for on the one copy thread, plus its copy.

Set against prefill's compute per token (`decode-worker bench --link` reports it), these say what share of a
core's time the backups take from the forward where both run on the same cores.

    .venv/bin/python benchmarks/bench_backup.py [--repeats 200]
"""
from __future__ import annotations

import argparse
import json
import random
import time

import numpy as np
import torch

from decode_worker.cache.copy_engine import CopyEngine
from decode_worker.cache.pool import KVLayout, KVPool

LAYOUT = KVLayout("SmolLM2-135M", num_layers=30, num_kv_heads=3, head_dim=64, page_size=16, dtype=torch.bfloat16)
PREFIX_PAGES = 16
GAP_S = 0.002  # between backups, as between the requests that queue them
QUEUED_BACKUPS, BACKUP_PAGES = 8, 7  # queued ahead of a load-back


def _pages(rng: random.Random, total: int) -> np.ndarray:
    return np.array(rng.sample(range(1, total), PREFIX_PAGES), dtype=np.int64)


def copy_cost(engine: CopyEngine, device_pages: int, host_pages: int, repeats: int) -> tuple[float, float]:
    """Median wall and mean CPU microseconds per token of one prefix backup."""
    rng = random.Random(0)
    walls, cpu0 = [], time.process_time()
    for _ in range(repeats):
        src, dst = _pages(rng, device_pages), _pages(rng, host_pages)
        start = time.perf_counter()
        engine.backup(src, dst).result()
        walls.append(time.perf_counter() - start)
        time.sleep(GAP_S)
    tokens = PREFIX_PAGES * LAYOUT.page_size
    cpu = (time.process_time() - cpu0) / repeats  # sleeping costs none
    return float(np.median(walls)) / tokens * 1e6, cpu / tokens * 1e6


def load_back_wait(engine: CopyEngine, device_pages: int, host_pages: int, repeats: int) -> tuple[float, float]:
    """p50 and p99 milliseconds of a load-back submitted behind queued backups that touch none of its pages."""
    rng, times = random.Random(1), []
    backup_pages = QUEUED_BACKUPS * BACKUP_PAGES
    for _ in range(repeats):
        src = rng.sample(range(1, device_pages), backup_pages + PREFIX_PAGES)  # distinct: no copy waits for another
        dst = rng.sample(range(1, host_pages), backup_pages + PREFIX_PAGES)
        backups = [engine.backup(np.array(src[i: i + BACKUP_PAGES]), np.array(dst[i: i + BACKUP_PAGES]))
                   for i in range(0, backup_pages, BACKUP_PAGES)]
        start = time.perf_counter()
        engine.load(np.array(dst[backup_pages:]), np.array(src[backup_pages:])).result()
        times.append(time.perf_counter() - start)
        for f in backups:
            f.result()
        time.sleep(GAP_S)
    return float(np.percentile(times, 50)) * 1e3, float(np.percentile(times, 99)) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=200)
    args = p.parse_args()
    device_pages, host_pages = 512, 1536
    device, host = KVPool(LAYOUT, device_pages), KVPool(LAYOUT, host_pages)
    engine = CopyEngine(device.buffer, host.buffer)
    try:
        copy_cost(engine, device_pages, host_pages, 20)  # first touch of the pools' pages
        wall, cpu = copy_cost(engine, device_pages, host_pages, args.repeats)
        load_p50, load_p99 = load_back_wait(engine, device_pages, host_pages, args.repeats)
    finally:
        engine.close()
    print(json.dumps({"bench": "bench_backup", "torch_threads": torch.get_num_threads(),
                      "kv_bytes_per_token": LAYOUT.page_bytes // LAYOUT.page_size, "prefix_tokens":
                      PREFIX_PAGES * LAYOUT.page_size, "copy_us_per_token": round(wall, 3),
                      "cpu_us_per_token": round(cpu, 3), "load_back_ms_p50": round(load_p50, 2),
                      "load_back_ms_p99": round(load_p99, 2)}))


if __name__ == "__main__":
    main()
