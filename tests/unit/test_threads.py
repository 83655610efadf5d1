"""A started pool's threads run before anything is submitted, so a submit from the event loop never waits for a
thread to start."""
from __future__ import annotations

import threading

from decode_worker.core.threads import started_pool


def test_every_thread_runs_before_the_first_submit_and_none_starts_after():
    def running() -> list[str]:
        return sorted(t.name for t in threading.enumerate() if t.name.startswith("probe"))

    pool = started_pool(3, "probe")
    try:
        names = running()
        assert len(names) == 3, names
        seen = {pool.submit(lambda: threading.current_thread().name).result() for _ in range(20)}
        assert seen <= set(names) and running() == names
    finally:
        pool.shutdown()
