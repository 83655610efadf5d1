"""The tier moves on their own, over a bare radix tree, the allocators and the copies in flight, with an engine
whose copies finish when the test says (no cache): what a copy changes when it starts, when it lands, when it
fails, and what a drop frees."""
from __future__ import annotations

from concurrent.futures import Future

import numpy as np

from decode_worker.cache.allocation import Allocation
from decode_worker.cache.copies import CopiesInFlight, PendingCopy
from decode_worker.cache.node import token_key
from decode_worker.cache.radix_tree import RadixTree
from decode_worker.cache.stats import CacheCounters
from decode_worker.cache.tier_moves import TierMoves

PAGE = 2


class HeldCopies:
    """A ``PageCopier`` that records each copy and hands back a future the test settles."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[int], list[int]]] = []
        self.futures: list[Future] = []

    def _copy(self, kind: str, src, dst) -> Future:
        self.calls.append((kind, list(src), list(dst)))
        self.futures.append(Future())
        return self.futures[-1]

    def load(self, host_pages, device_pages) -> Future:
        return self._copy("load", host_pages, device_pages)

    def backup(self, device_pages, host_pages) -> Future:
        return self._copy("backup", device_pages, host_pages)

    def close(self) -> None:
        pass


def parts() -> tuple[TierMoves, RadixTree, Allocation, HeldCopies]:
    tree, pages, engine = RadixTree(PAGE), Allocation(12, 10), HeldCopies()
    return TierMoves(tree, pages, CopiesInFlight(), engine, CacheCounters()), tree, pages, engine


def settle_all(moves: TierMoves) -> list[PendingCopy]:
    """Apply the finished copies as the cache's ``poll`` does: each as it comes out, so later ones see it."""
    done = []
    for op in moves.copies.finished():
        moves.settle(op, not op.failed())
        done.append(op)
    return done


def test_a_backup_gives_l2_pages_in_path_order_and_holds_its_nodes_until_it_lands():
    moves, tree, pages, engine = parts()
    a = tree.add_child(tree.root, token_key(range(4)), pages.take_device(2, locked=0))
    b = tree.add_child(a, token_key(range(4, 10)), pages.take_device(3, locked=0))
    host = pages.take_host(5)
    moves.backup([a, b], host)
    assert a.host_indices.tolist() == host[:2].tolist() and b.host_indices.tolist() == host[2:].tolist()
    assert engine.calls == [("backup", [*a.device_indices, *b.device_indices], host.tolist())]
    assert a.saving is b.saving is not None and (a.lock_ref, b.lock_ref) == (2, 1)
    engine.futures[0].set_result(None)
    assert settle_all(moves)[0].ok is True
    assert a.saving is b.saving is None and (a.lock_ref, b.lock_ref) == (0, 0)
    assert moves.counters.backed_up == 10 and a.on_device and b.on_host


def test_a_failed_backup_takes_its_l2_pages_back():
    moves, tree, pages, engine = parts()
    a = tree.add_child(tree.root, token_key(range(4)), pages.take_device(2, locked=0))
    moves.backup([a], pages.take_host(2))
    free_before = pages.host.num_free
    engine.futures[0].set_exception(OSError("dma"))
    settle_all(moves)
    assert not a.on_host and a.on_device and pages.host.num_free == free_before + 2
    assert moves.counters.backed_up == 0 and a.lock_ref == 0


def test_a_failed_load_undoes_the_load_below_it_whose_pages_go_when_it_lands():
    moves, tree, pages, engine = parts()
    a = tree.add_host_child(tree.root, token_key(range(4)), pages.take_host(2))
    b = tree.add_host_child(a, token_key(range(4, 8)), pages.take_host(2))
    moves.load([a], pages.take_device(2, locked=0))
    moves.load([b], pages.take_device(2, locked=0))
    assert b.loading.deps == [a.loading]  # b's load reads below a's
    device_free = pages.device.num_free
    engine.futures[0].set_exception(OSError("dma"))
    assert [op.ok for op in settle_all(moves)] == [False]
    assert not a.on_device and not b.on_device and b.loading is None  # b is off L1 before its copy lands...
    assert pages.draining == 2 and pages.device.num_free == device_free + 2  # ...which may still write its pages
    engine.futures[1].set_result(None)
    assert [op.ok for op in settle_all(moves)] == [False]  # it fails with its dependency
    assert pages.draining == 0 and pages.device.num_free == device_free + 4
    assert a.on_host and b.on_host and b.parent is a and moves.counters.loaded_back == 0


def test_a_failed_demotion_prunes_the_node_it_left_in_no_tier():
    moves, tree, pages, engine = parts()
    a = tree.add_child(tree.root, token_key(range(4)), pages.take_device(2, locked=0))
    free_before = pages.device.num_free
    old = tree.clear_device(a)
    tree.set_host(a, pages.take_host(2))
    op = PendingCopy("backup", nodes=[a], locked=[])
    a.saving = op
    moves.demote(op, [old])
    assert engine.calls == [("backup", old.tolist(), a.host_indices.tolist())] and pages.draining == 2
    engine.futures[0].set_exception(OSError("dma"))
    settle_all(moves)
    assert a.parent is None and not tree.root.children  # in no tier: it left the tree
    assert pages.draining == 0 and pages.device.num_free == free_before + 2 and pages.host.num_free == 10


def test_a_demotion_whose_victims_all_left_frees_their_old_pages_without_a_copy():
    moves, tree, pages, engine = parts()
    old = pages.take_device(3, locked=0)
    free_before = pages.device.num_free
    victim = tree.add_host_child(tree.root, token_key(range(6)), pages.take_host(3))
    pages.host.free(tree.clear_host(victim))
    tree.remove(victim)
    moves.demote(PendingCopy("backup", nodes=[victim], locked=[]), [old])
    assert engine.calls == [] and pages.device.num_free == free_before + 3 and pages.draining == 0


def test_a_drop_frees_both_tiers_of_the_subtree_and_counts_the_l2_tokens():
    moves, tree, pages, _ = parts()
    a = tree.add_child(tree.root, token_key(range(4)), pages.take_device(2, locked=0))
    tree.set_host(a, pages.take_host(2))
    b = tree.add_host_child(a, token_key(range(4, 10)), pages.take_host(3))
    held = a.device_indices.tolist()
    device_pages: list[np.ndarray] = []
    moves.drop(a, device_pages)
    assert a.parent is None and b.parent is None and not tree.root.children
    assert [p.tolist() for p in device_pages] == [held] and pages.host.num_free == 10
    assert moves.counters.evicted_host == 10
