"""Keys and page hashes on their own: a key is the token ids packed as int32 little-endian whatever form they come
in, and each page hash chains over the one before it, from the seed."""
from __future__ import annotations

import hashlib

import numpy as np
import torch

from decode_worker.cache.node import TreeNode, chain_hashes, token_key


def test_every_token_form_gives_the_same_key():
    ids = [1, 2, 70000, 3]
    key = token_key(ids)
    assert key == np.array(ids, dtype="<i4").tobytes()
    assert token_key(np.array(ids, dtype=np.int64)) == key == token_key(torch.tensor(ids)) == token_key(key)


def test_chained_hashes_cover_whole_pages_only_and_depend_on_everything_before():
    key, seed = token_key(range(10)), hashlib.sha256(b"seed").digest()
    hashes = chain_hashes(key, 4, seed)
    assert len(hashes) == 2  # the last 2 tokens are no whole page
    assert hashes[0] == hashlib.sha256(seed + key[:16]).digest()
    assert hashes[1] == hashlib.sha256(hashes[0] + key[16:32]).digest()
    assert chain_hashes(token_key([9, *range(1, 10)]), 4, seed)[1] != hashes[1]  # a change on page 0 reaches page 1


def test_a_node_says_its_tiers():
    node = TreeNode(key=token_key(range(8)))
    assert node.num_tokens == 8 and not node.on_device and not node.on_host
    node.host_indices = np.array([3, 4], dtype=np.int64)
    assert node.on_host and repr(node) == "TreeNode(tokens=8, tiers=H, lock=0)"
