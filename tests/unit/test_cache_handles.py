"""A caller's handle on its own (bare nodes, futures and a counting ``settle`` callback, no cache): it waits for
its copies, settles them through the one callback it holds, reports a failed load-back, and hands its pages over
once."""
from __future__ import annotations

import asyncio
from concurrent.futures import Future

import numpy as np
import pytest

from decode_worker.cache.copies import PendingCopy
from decode_worker.cache.handles import LoadBackError, LoadHandle
from decode_worker.cache.node import TreeNode
from decode_worker.cache.pool import NO_PAGES


def handle(waits: list[PendingCopy], settled: list[int]) -> LoadHandle:
    def settle() -> int:  # what the cache's poll does for these copies: record each outcome
        settled.append(1)
        for op in waits:
            if op.future.done() and op.ok is None:
                op.ok = not op.failed()
        return 0

    prefix, delta = np.array([4, 5], dtype=np.int64), np.array([9], dtype=np.int64)
    return LoadHandle(TreeNode(key=b""), prefix, delta, 0, 4, waits, page_size=2, settle=settle)


def test_wait_settles_once_its_copies_land_and_pages_go_to_the_caller_once():
    async def main():
        op, settled = PendingCopy("load", [], [], future=Future()), []
        h = handle([op], settled)
        assert not h.ready() and settled
        asyncio.get_running_loop().call_later(0.01, op.future.set_result, None)
        await h.wait()
        assert h.ready() and h.prefix_tokens == 4
        assert h.take_pages().tolist() == [4, 5, 9] and h.delta_pages is NO_PAGES

    asyncio.run(main())


def test_a_failed_copy_makes_wait_raise():
    async def main():
        future = Future()
        future.set_exception(OSError("copy failed"))
        h = handle([PendingCopy("load", [], [], future=future)], [])
        with pytest.raises(LoadBackError, match="4-token prefix"):
            await h.wait()

    asyncio.run(main())
