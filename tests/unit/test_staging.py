"""Staging buffers are lent again after a transfer that succeeded, and dropped after one that failed; page copies
into and out of them run off the event loop when large, and never outlive the task that waits for them."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from decode_worker.transfer.staging import INLINE_COPY_BYTES, MIN_BYTES, StagingPool, run_page_copy


def test_reuses_the_best_fitting_block_after_success():
    pool = StagingPool()
    with pool.borrow((3, 1000), torch.float32) as a:
        assert a.shape == (3, 1000) and a.dtype == torch.float32 and a.is_contiguous()
        a_ptr = a.data_ptr()
    with pool.borrow((4 << 20,), torch.uint8) as big:
        big_ptr = big.data_ptr()
    assert pool.cached_bytes == MIN_BYTES + (4 << 20)
    with pool.borrow((10,), torch.bfloat16) as small, pool.borrow((3 << 20,), torch.uint8) as mid:
        assert small.data_ptr() == a_ptr  # the 1 MB block, not the 4 MB one
        assert mid.data_ptr() == big_ptr
        assert pool.cached_bytes == 0


def test_a_failed_transfer_drops_its_block():
    pool = StagingPool()
    with pytest.raises(RuntimeError):
        with pool.borrow((100,), torch.float32):
            raise RuntimeError("transfer failed")
    assert pool.cached_bytes == 0


def test_keeps_at_most_max_cached_bytes_oldest_dropped_first():
    pool = StagingPool(max_cached_bytes=2 * MIN_BYTES)
    with pool.borrow((MIN_BYTES,), torch.uint8) as a, pool.borrow((MIN_BYTES,), torch.uint8) as b, \
            pool.borrow((MIN_BYTES,), torch.uint8) as c:
        ptrs = a.data_ptr(), b.data_ptr(), c.data_ptr()
    # returned in the order c, b, a: c, the oldest, made room
    assert [blk.data_ptr() for blk in pool._free] == [ptrs[1], ptrs[0]]
    with pool.borrow((8 * MIN_BYTES,), torch.uint8):
        pass
    assert pool.cached_bytes == 2 * MIN_BYTES  # a block larger than the cap is never kept


def test_a_cancelled_large_copy_ends_only_after_the_copy_finished():
    finished = threading.Event()

    def slow_scatter() -> None:
        time.sleep(0.3)
        finished.set()

    async def main() -> None:
        task = asyncio.ensure_future(run_page_copy(INLINE_COPY_BYTES, slow_scatter))
        await asyncio.sleep(0.05)
        loop_free_at = time.monotonic()
        task.cancel()
        await asyncio.sleep(0.05)
        assert time.monotonic() - loop_free_at < 0.2  # the copy runs in a thread: the loop kept running
        assert not task.done()  # the pages are still being written: the scheduler must not free them yet
        with pytest.raises(asyncio.CancelledError):
            await task
        assert finished.is_set()

    asyncio.run(main())


def test_a_small_copy_runs_inline_and_a_failing_copy_raises():
    loop_thread = threading.get_ident()
    ran_on = []

    async def main() -> None:
        await run_page_copy(INLINE_COPY_BYTES - 1, lambda: ran_on.append(threading.get_ident()))
        await run_page_copy(INLINE_COPY_BYTES, lambda: ran_on.append(threading.get_ident()))

    asyncio.run(main())
    assert ran_on[0] == loop_thread and ran_on[1] != loop_thread

    def broken() -> None:
        raise IndexError("page out of range")

    with pytest.raises(IndexError, match="page out of range"):
        asyncio.run(run_page_copy(INLINE_COPY_BYTES, broken))
