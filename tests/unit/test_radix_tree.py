"""The page-granular radix tree on its own: matching, splits, locks, chained page hashes and the evictable leaves
it keeps up to date."""
from __future__ import annotations

import hashlib
import random
import struct

import numpy as np
import pytest

from decode_worker.cache.node import chain_hashes, token_key
from decode_worker.cache.radix_tree import RadixTree
from tests.cache_invariants import check_evictable_leaves, key_tokens, prefix_key

PS = 4


def pages(*ids: int) -> np.ndarray:
    return np.array(ids, dtype=np.int64)


def build(seqs: list[tuple[int, ...]], ps: int = PS) -> RadixTree:
    """Insert sequences structurally (splitting like the cache does), one fresh page id per new page."""
    tree, next_page = RadixTree(ps, "seed"), 1
    for seq in seqs:
        n = len(seq) // ps
        key = token_key(seq)
        path, tail = tree.match(key)
        node, pos = tree.root, 0
        for i, child in enumerate(path):
            k = tail if i == len(path) - 1 else tree.num_pages(child)
            if k < tree.num_pages(child) and pos + k < n:
                child = tree.split(child, k)
            node, pos = child, pos + k
        if pos < n:
            pb = tree.page_bytes
            tree.add_child(node, key[pos * pb : n * pb], np.arange(next_page, next_page + n - pos))
            next_page += n - pos
    return tree


def match(tree: RadixTree, seq: tuple[int, ...]):
    return tree.match(token_key(seq))


def matched_tokens(tree: RadixTree, seq: tuple[int, ...]) -> int:
    path, tail = match(tree, seq)
    return sum(n.num_tokens for n in path[:-1]) + tail * tree.page_size if path else 0


def test_empty_tree_matches_nothing():
    tree = RadixTree(PS)
    assert match(tree, tuple(range(10))) == ([], 0)


def test_full_and_partial_match():
    seq = tuple(range(16))
    tree = build([seq])
    path, tail = match(tree, seq + (99, 98))
    assert len(path) == 1 and tail == 4
    path, tail = match(tree, seq[:10])  # 2 full pages; the partial third page never matches
    assert len(path) == 1 and tail == 2
    path, tail = match(tree, seq[:8] + (7, 7, 7, 7))
    assert tail == 2
    assert match(tree, (1,) + seq[1:]) == ([], 0)


def test_split_keeps_size_alignment_and_pages():
    a = tuple(range(16))
    b = a[:8] + (50, 51, 52, 53, 54, 55, 56, 57)
    tree = build([a, b])
    nodes = list(tree.nodes())
    assert sorted(n.num_tokens for n in nodes) == [8, 8, 8]
    assert sum(n.num_tokens for n in nodes) == 24
    assert all(n.num_tokens % PS == 0 and len(n.device_indices) == n.num_tokens // PS for n in nodes)
    (head,) = tree.root.children.values()
    assert head.device_indices.tolist() == [1, 2]  # the split kept a's first pages in the head
    assert sorted(c.device_indices.tolist() for c in head.children.values()) == [[3, 4], [5, 6]]
    assert key_tokens(prefix_key(tree, match(tree, b)[0][-1])) == b


def test_split_copies_lock_and_stats():
    tree = build([tuple(range(12))])
    (node,) = tree.nodes()
    tree.lock(node)
    node.hit_count, node.last_access = 3, 7
    head = tree.split(node, 1)
    assert head.lock_ref == node.lock_ref == 1 and head.hit_count == 3 and head.last_access == 7
    assert tree.locked_device_pages == 3
    tree.unlock(node)
    assert head.lock_ref == 0 and tree.locked_device_pages == 0


def test_every_match_is_page_aligned_and_correct():
    rng = random.Random(0)
    for ps in (1, 2, 4):
        seqs = [tuple(rng.randrange(3) for _ in range(rng.randrange(1, 30))) for _ in range(40)]
        tree = build(seqs, ps)
        stored = {s[: (len(s) // ps) * ps] for s in seqs}
        for _ in range(200):
            q = tuple(rng.randrange(3) for _ in range(rng.randrange(0, 30)))
            got = matched_tokens(tree, q)
            want = max(
                (p for s in stored for p in range(0, len(s) + 1, ps) if q[:p] == s[:p] and p <= len(q)), default=0
            )
            assert got % ps == 0 and got == want, (ps, q, got, want)
        distinct_pages = {s[:p] for s in stored for p in range(ps, len(s) + 1, ps)}
        assert sum(n.num_tokens for n in tree.nodes()) == len(distinct_pages) * ps


def test_common_pages_binary_search_on_a_long_node():
    key = tuple(range(4096))
    tree = build([key])
    for cut in (1, 2, 3, 500, 1023):
        q = key[: cut * PS] + (-1,) * PS + key[(cut + 1) * PS :]
        assert match(tree, q)[1] == cut


def test_lock_unlock_balance():
    a, b = tuple(range(8)), tuple(range(4)) + (9, 9, 9, 9)
    tree = build([a, b])
    leaf = match(tree, b)[0][-1]
    tree.lock(leaf)
    tree.lock(leaf)
    assert leaf.parent.lock_ref == 2 and tree.locked_device_pages == 2
    tree.unlock(leaf)
    tree.unlock(leaf)
    assert all(n.lock_ref == 0 for n in tree.nodes()) and tree.locked_device_pages == 0
    with pytest.raises(RuntimeError, match="unbalanced"):
        tree.unlock(leaf)


def test_touch_counts_hits_along_the_path():
    tree = build([tuple(range(8)), tuple(range(4)) + (5, 5, 5, 5)])
    leaf = match(tree, tuple(range(8)))[0][-1]
    tree.touch(leaf, hit=True)
    assert leaf.hit_count == 1 and leaf.parent.hit_count == 1 and leaf.last_access == leaf.parent.last_access
    other = match(tree, tuple(range(4)) + (5, 5, 5, 5))[0][-1]
    assert other.hit_count == 0 and other.last_access < leaf.last_access


def test_page_hashes_are_chained_seeded_and_independent_of_splits():
    seq = tuple(range(12))
    whole = build([seq])
    split = build([seq, seq[:4] + (7, 7, 7, 7)])
    want = whole.page_hashes(next(whole.nodes()))
    got = [h for n in match(split, seq)[0] for h in split.page_hashes(n)]
    assert got == want and len(want) == 3
    prev = hashlib.sha256(b"seed").digest()
    for i, h in enumerate(want):
        prev = hashlib.sha256(prev + struct.pack("<4i", *seq[4 * i : 4 * i + 4])).digest()
        assert h == prev.hex()
    other_seed = RadixTree(PS, "other")
    assert chain_hashes(token_key(seq), PS, other_seed.root_hash)[0].hex() != want[0]
    # hashes computed before a split are split with the node
    tree = build([seq])
    node = next(tree.nodes())
    tree.page_hashes(node)
    head = tree.split(node, 2)
    assert head.hashes + node.hashes == want


# -- evictable leaves: kept up to date by every change, checked against a full walk ----------------------------------


def members(tree: RadixTree) -> tuple[set[tuple[int, ...]], set[tuple[int, ...]]]:
    """The L1 and L2 evictable leaves, each named by its tokens from the root; asserted equal to a full walk."""
    check_evictable_leaves(tree)
    name = lambda n: key_tokens(prefix_key(tree, n))  # noqa: E731
    return {name(n) for n in tree.device_leaves.members}, {name(n) for n in tree.host_leaves.members}


def test_a_parent_stops_being_an_l1_leaf_when_a_child_reaches_l1_and_is_one_again_when_it_leaves():
    a, b = tuple(range(8)), tuple(range(4)) + (9, 9, 9, 9)
    tree = build([a[:4]])
    assert members(tree) == ({a[:4]}, set())
    tree = build([a, b])
    head = match(tree, a)[0][0]
    assert members(tree) == ({a, b}, set())
    for leaf in list(head.children.values()):
        tree.set_host(leaf, tree.clear_device(leaf))  # demoted: L2 only
    assert members(tree) == ({a[:4]}, {a, b})
    leaf = match(tree, a)[0][-1]
    tree.set_device(leaf, tree.clear_host(leaf))  # revived under a parent that was an L1 leaf
    assert members(tree) == ({a}, {b})


def test_locks_take_the_path_out_and_the_last_unlock_puts_it_back():
    a, b = tuple(range(8)), tuple(range(4)) + (9, 9, 9, 9)
    tree = build([a, b])
    leaf = match(tree, b)[0][-1]
    tree.set_host(leaf, pages(50, 51))
    tree.lock(leaf)
    tree.lock(leaf)
    assert members(tree) == ({a}, set())
    tree.unlock(leaf)
    assert members(tree) == ({a}, set())
    tree.unlock(leaf)
    assert members(tree) == ({a, b}, set())  # on both tiers: an L1 leaf, not yet an L2 one


def test_removing_the_last_child_makes_a_host_only_parent_an_l2_leaf():
    a = tuple(range(8))
    tree = build([a])
    head = tree.split(match(tree, a)[0][0], 1)
    for node in (head.children[token_key(a[4:8])], head):
        tree.set_host(node, tree.clear_device(node))
    assert members(tree) == (set(), {a})
    child = next(iter(head.children.values()))
    tree.clear_host(child)
    tree.remove(child)
    assert members(tree) == (set(), {a[:4]})


def test_pop_follows_the_rank_as_it_is_now_not_as_it_was_when_filed():
    seqs = [tuple(range(4 * i, 4 * i + 4)) for i in range(3)]
    tree = build(seqs)
    first = match(tree, seqs[0])[0][0]
    tree.touch(first)  # filed first, used last
    popped = [key_tokens(n.key) for n in iter(tree.device_leaves.pop, None)]
    assert popped == [seqs[1], seqs[2], seqs[0]] and not tree.device_leaves
    for node in tree.nodes():  # a popped node is the caller's to act on; refiled, each is queued once again
        tree.refresh(node)
    assert members(tree) == (set(seqs), set())


def test_cutting_a_leaf_s_l1_tail_in_place_keeps_its_head_filed():
    a, b = tuple(range(16)), tuple(range(4)) + (9,) * 8
    tree = build([a, b])
    leaf = match(tree, a)[0][-1]
    assert np.array_equal(tree.cut_device_tail(leaf, 2), pages(4)) and tree.device_pages == 5
    assert key_tokens(leaf.key) == a[4:12] and np.array_equal(leaf.device_indices, pages(2, 3))
    assert members(tree) == ({a[:12], b}, set())
    tree.lock(leaf)
    assert tree.cut_device_tail(leaf, 1) is None and tree.device_pages == 5  # locked: nothing changed
    tree.unlock(leaf)
    tree.set_host(leaf, pages(7, 8))
    assert tree.cut_device_tail(leaf, 1) is None  # it has an L2 copy too


def test_l2_page_counts_follow_tiers_locks_and_splits():
    """The L2 counts ``stats`` and the L2 pre-check read without a walk: locked pages, and unlocked pages held on L2
    alone (a node on both tiers is L1's to give up first)."""
    tree = build([tuple(range(12))])  # one 3-page node, on L1
    node = next(tree.nodes())

    def counts() -> tuple[int, int]:
        return tree.locked_host_pages, tree.host_only_pages

    tree.set_host(node, pages(7, 8, 9))
    assert counts() == (0, 0)  # on both tiers
    tree.clear_device(node)
    assert counts() == (0, 3)
    head = tree.split(node, 1)
    assert counts() == (0, 3)
    tree.lock(node)  # the tail and the head above it
    assert counts() == (3, 0)
    tree.set_device(head, pages(1))
    assert counts() == (3, 0)
    tree.unlock(node)
    assert counts() == (0, 2)  # the tail; the head is on L1 too
    tree.clear_host(node)
    assert counts() == (0, 0)
