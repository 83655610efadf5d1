"""The write policy and the eviction order on their own: each policy's ranking and how much of a victim it gives up, and the lazy leaf
heap that keeps a tier's evictable leaves in that order, built from bare nodes (no tree, no cache)."""
from __future__ import annotations

import pytest

from decode_worker.cache.node import SELECTIVE_HITS, TreeNode
from decode_worker.cache.strategy import COMPACT_SLACK, LeafHeap, WriteStrategy, eviction_order
from decode_worker.core.policies import EvictionPolicy, WritePolicy


def node(last_access: int, hit_count: int = 0) -> TreeNode:
    return TreeNode(key=b"\0" * 4, last_access=last_access, hit_count=hit_count)


def first_out(policy: EvictionPolicy, nodes: list[TreeNode]) -> list[TreeNode]:
    heap = LeafHeap(eviction_order(policy).rank)
    for n in nodes:
        heap.add(n)
    return [heap.pop() for _ in nodes]


def test_slru_gives_up_never_hit_nodes_before_hit_ones_then_least_recent():
    old_hit, new_cold, old_cold = node(1, hit_count=3), node(5), node(2)
    assert first_out(EvictionPolicy.SLRU, [old_hit, new_cold, old_cold]) == [old_cold, new_cold, old_hit]


def test_lru_ignores_hits_and_lfu_ranks_by_hits_first():
    hot_old, cold_new = node(1, hit_count=9), node(7)
    assert first_out(EvictionPolicy.LRU, [cold_new, hot_old]) == [hot_old, cold_new]
    assert first_out(EvictionPolicy.LFU, [hot_old, cold_new]) == [cold_new, hot_old]


@pytest.mark.parametrize("policy, gives", [(EvictionPolicy.SLRU, 2), (EvictionPolicy.LRU, 5), (EvictionPolicy.LFU, 5)])
def test_only_slru_cuts_a_victim_to_what_is_needed(policy, gives):
    order = eviction_order(policy)
    assert order.policy == policy and order.partial == (policy == EvictionPolicy.SLRU)
    assert order.pages_to_give(5, need=2) == gives
    assert order.pages_to_give(3, need=9) == 3  # never more than the victim holds


def test_a_node_touched_while_queued_pops_by_its_current_rank():
    a, b = node(1), node(2)
    heap = LeafHeap(eviction_order(EvictionPolicy.LRU).rank)
    heap.add(a)
    heap.add(b)
    a.last_access = 10  # touched: its rank grew after it was pushed
    assert heap.pop() is b and heap.pop() is a and heap.pop() is None


def test_a_discarded_member_is_skipped_and_stale_entries_are_compacted():
    heap = LeafHeap(eviction_order(EvictionPolicy.LRU).rank)
    keep = node(0)
    heap.add(keep)
    for i in range(COMPACT_SLACK + 8):  # members come and go: their heap entries go stale
        n = node(i + 1)
        heap.add(n)
        heap.members.discard(n)
    assert len(heap) == 1 and len(heap._heap) <= 2 * len(heap.members) + COMPACT_SLACK
    assert heap.pop() is keep and heap.pop() is None


@pytest.mark.parametrize("policy", list(WritePolicy))
def test_write_strategy_never_backs_up_without_l2(policy):
    writes = WriteStrategy(policy, has_host=False)
    assert not writes.on_insert(forced=True) and not writes.on_hit(SELECTIVE_HITS) and not writes.demotes


def test_each_write_policy_backs_up_at_its_own_moment():
    through, selective, back = (WriteStrategy(p, has_host=True) for p in WritePolicy)
    assert through.on_insert() and not through.on_hit(9) and not through.demotes
    assert not selective.on_insert() and selective.on_insert(forced=True)
    assert not selective.on_hit(SELECTIVE_HITS - 1) and selective.on_hit(SELECTIVE_HITS) and not selective.demotes
    assert not back.on_insert() and not back.on_hit(9) and back.demotes
