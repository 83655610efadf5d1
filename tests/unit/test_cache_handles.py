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


def test_match_prefix_takes_l1_then_l2_and_stops_at_a_gap_reading_the_tree_only():
    from decode_worker.cache.handles import match_prefix
    from decode_worker.cache.node import token_key
    from decode_worker.cache.radix_tree import RadixTree

    tree = RadixTree(page_size=2)
    dev = tree.add_child(tree.root, token_key(range(4)), np.array([1, 2]))
    host = tree.add_host_child(dev, token_key(range(4, 8)), np.array([5, 6]))
    gap = tree.add_host_child(host, token_key(range(8, 10)), np.array([7]))
    tree.clear_host(gap)  # in neither tier: the match ends before it
    version = tree.version
    m = match_prefix(tree, token_key(range(12)))
    assert (m.device_hit_tokens, m.host_hit_tokens, m.restore_nodes, m.path) == (4, 4, [host], [dev, host])
    assert m.device_indices.tolist() == [1, 2] and m.tail_pages == 2 and tree.version == version
    both = tree.add_child(host, token_key(range(20, 22)), np.array([8]))
    tree.set_host(both, np.array([9]))  # on L1 below a node still on L2 alone: not an L1 hit, a gap
    m = match_prefix(tree, token_key([*range(8), 20, 21]))
    assert m.path == [dev, host] and m.device_hit_tokens == 4 and m.host_hit_tokens == 4
    part = match_prefix(tree, token_key(range(3)))  # one full page of ``dev``
    assert part.path == [dev] and part.tail_pages == 1 and part.device_indices.tolist() == [1]
