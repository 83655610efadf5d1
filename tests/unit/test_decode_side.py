"""The decode side's scatter runs off the event loop but never outlives the request's transfer task."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from decode_worker.transfer.decode_side import run_to_completion


def test_a_cancelled_transfer_ends_only_after_its_scatter_finished():
    finished = threading.Event()

    def slow_scatter() -> None:
        time.sleep(0.3)
        finished.set()

    async def main() -> None:
        task = asyncio.ensure_future(run_to_completion(slow_scatter))
        await asyncio.sleep(0.05)
        loop_free_at = time.monotonic()
        task.cancel()
        await asyncio.sleep(0.05)
        assert time.monotonic() - loop_free_at < 0.2  # the loop kept running meanwhile
        assert not task.done()  # the pages are still being written: the scheduler must not free them yet
        with pytest.raises(asyncio.CancelledError):
            await task
        assert finished.is_set()

    asyncio.run(main())


def test_a_failing_scatter_raises_its_error():
    def broken() -> None:
        raise IndexError("page out of range")

    with pytest.raises(IndexError, match="page out of range"):
        asyncio.run(run_to_completion(broken))
