"""The radix tree's read-only walks the cache uses to drop nodes (flush, a gap left by a failed copy), on a bare
tree (no cache)."""
from __future__ import annotations

import numpy as np

from decode_worker.cache.node import token_key
from decode_worker.cache.radix_tree import RadixTree


def test_unlocked_tops_are_the_highest_unlocked_nodes_and_a_gap_is_found_only_when_unlocked():
    tree = RadixTree(page_size=2)
    a = tree.add_child(tree.root, token_key(range(4)), np.array([1, 2]))
    b = tree.add_child(a, token_key(range(4, 6)), np.array([3]))
    c = tree.add_child(tree.root, token_key(range(10, 12)), np.array([4]))
    assert set(tree.unlocked_tops()) == {a, c}
    tree.lock(a)
    assert set(tree.unlocked_tops()) == {b, c}  # a lock holds a and its ancestors: b hangs below it
    tree.unlock(a)
    tree.clear_device(a)  # a is in neither tier now
    assert tree.highest_gap(b) is a
    tree.lock(b)
    assert tree.highest_gap(b) is None  # locked along with b: not a gap to drop
