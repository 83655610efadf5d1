"""Thread pools whose threads are running before the event loop needs them."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor


def started_pool(workers: int, name: str) -> ThreadPoolExecutor:
    """A pool of ``workers`` threads, all started. An executor starts a thread on the submit that needs one, and
    starting a thread waits until it runs, which on a loaded host blocked the caller, the event loop, for longer
    than its stall limit (docs/reliability.md). Pools the loop submits to start theirs here, at start-up."""
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
    running = threading.Barrier(workers + 1)
    for _ in range(workers):
        pool.submit(running.wait)  # each blocks until all have started, so every submit starts a new thread
    running.wait()
    return pool
