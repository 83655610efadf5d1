"""Page-granular radix tree over token ids; each node records where its KV pages live (L1 and/or L2).

The tree owns structure, tiers, lock refs and access stats. Which allocator a page belongs to, copies and
policies are the hierarchical cache's business (``hicache.py``). Keys are token ids packed as int32 bytes:
a node is matched with one ``memcmp`` (``bytes.startswith``), a child found with one dict probe on its first
page, so a 21K-token match is a few Python steps per node, never one per token; and a cached token costs 4
bytes that the garbage collector never scans (a tuple of ints costs ~36 and is scanned).
"""
from __future__ import annotations

import hashlib
import sys
from array import array
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np
import torch

Key = bytes  # token ids, int32 little-endian
Tokens = Sequence[int] | np.ndarray | torch.Tensor | Key
TOKEN_BYTES = 4


def token_key(tokens: Tokens) -> Key:
    """The tree key of a token sequence. Build it once per request and pass it to both match and insert."""
    if isinstance(tokens, bytes):
        return tokens
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.cpu().numpy()
    if isinstance(tokens, np.ndarray):
        return np.ascontiguousarray(tokens, dtype="<i4").tobytes()
    packed = array("i", tokens)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


@dataclass(eq=False)
class TreeNode:
    """A run of whole pages. A node in neither tier only exists transiently (see ``HierarchicalCache``)."""

    key: Key  # this node's run of whole pages
    parent: TreeNode | None = None
    children: dict[Key, TreeNode] = field(default_factory=dict)
    device_indices: torch.Tensor | None = None  # L1 page ids, int64, one per page
    host_indices: torch.Tensor | None = None  # L2 page ids
    lock_ref: int = 0  # live users of this node or any descendant
    last_access: int = 0  # logical clock, for LRU
    hit_count: int = 0  # for LFU and write_through_selective
    loading: Any = None  # in-flight copy writing device_indices (L2->L1)
    saving: Any = None  # in-flight copy writing host_indices (L1->L2)
    hashes: list[str] | None = None  # chained page hashes, computed on first use (L3 keys)

    @property
    def num_tokens(self) -> int:
        return len(self.key) // TOKEN_BYTES

    @property
    def on_device(self) -> bool:
        return self.device_indices is not None

    @property
    def on_host(self) -> bool:
        return self.host_indices is not None

    def __repr__(self) -> str:
        tiers = ("D" if self.on_device else "") + ("H" if self.on_host else "")
        return f"TreeNode(tokens={self.num_tokens}, tiers={tiers or '-'}, lock={self.lock_ref})"


def chain_hashes(key: Key, page_size: int, prev: bytes) -> list[bytes]:
    """SHA-256 per whole page, each over the previous page's digest and the page's int32 LE token ids."""
    step = page_size * TOKEN_BYTES
    out = []
    for start in range(0, len(key) - step + 1, step):
        prev = hashlib.sha256(prev + key[start : start + step]).digest()
        out.append(prev)
    return out


class RadixTree:
    """Structure, tiers and locks of the cached prefixes; page accounting counters for fast budget checks."""

    def __init__(self, page_size: int, hash_seed: str = ""):
        self.page_size = page_size
        self.page_bytes = page_size * TOKEN_BYTES
        self.root = TreeNode(key=())
        self.root_hash = hashlib.sha256(hash_seed.encode()).digest()
        self.version = 0  # bumped on every change a MatchResult could depend on
        self.clock = 0
        self.device_pages = 0  # L1 pages held by nodes
        self.locked_device_pages = 0  # ...of which in nodes with lock_ref > 0

    # -- lookup ---------------------------------------------------------------------------------------------

    def num_pages(self, node: TreeNode) -> int:
        return len(node.key) // self.page_bytes

    def match(self, key: Key) -> tuple[list[TreeNode], int]:
        """Longest page-aligned path spelling a prefix of ``key``, regardless of tiers.

        Returns ``(path, tail_pages)``: every node of ``path`` matches fully except possibly the last, of which
        the first ``tail_pages`` pages match.
        """
        pb = self.page_bytes
        end = len(key) - len(key) % pb
        node, pos, path = self.root, 0, []
        while pos < end:
            child = node.children.get(key[pos : pos + pb])
            if child is None:
                break
            path.append(child)
            klen = len(child.key)
            if pos + klen <= end and key.startswith(child.key, pos):
                node, pos = child, pos + klen
                continue
            return path, self._common_pages(child.key, key, pos, end)
        return path, (self.num_pages(path[-1]) if path else 0)

    def _common_pages(self, node_key: Key, key: Key, pos: int, end: int) -> int:
        """Leading pages of ``node_key`` equal to ``key[pos:end]``; the first page is known to match."""
        pb = self.page_bytes
        hi = min(len(node_key), end - pos) // pb
        if key.startswith(node_key[: hi * pb], pos):
            return hi
        lo = 1  # invariant: lo pages match, hi pages do not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if key.startswith(node_key[: mid * pb], pos):
                lo = mid
            else:
                hi = mid
        return lo

    def nodes(self) -> Iterator[TreeNode]:
        """All nodes except the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def subtree(self, node: TreeNode) -> list[TreeNode]:
        out, stack = [], [node]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def page_hashes(self, node: TreeNode) -> list[str]:
        """Hex chained hash of each page of ``node`` (computed lazily: only the L3 tier needs them)."""
        if node.hashes is None:
            parent = node.parent
            prev = self.root_hash if parent is self.root else bytes.fromhex(self.page_hashes(parent)[-1])
            node.hashes = [h.hex() for h in chain_hashes(node.key, self.page_size, prev)]
        return node.hashes

    # -- structure ------------------------------------------------------------------------------------------

    def touch(self, node: TreeNode, hit: bool = False) -> None:
        """Mark the path to ``node`` used now (LRU) and, for a cache hit, count it (LFU, selective backup)."""
        self.clock += 1
        while node is not self.root:
            node.last_access = self.clock
            node.hit_count += hit
            node = node.parent

    def add_child(self, parent: TreeNode, key: Key, device_indices: torch.Tensor) -> TreeNode:
        assert len(key) % self.page_bytes == 0 and len(key) // self.page_bytes == device_indices.numel()
        self.clock += 1
        node = TreeNode(key=key, parent=parent, last_access=self.clock)
        parent.children[key[: self.page_bytes]] = node
        self.set_device(node, device_indices)
        return node

    def split(self, node: TreeNode, pages: int) -> TreeNode:
        """Cut ``node`` after ``pages`` pages; the returned new node holds the head and becomes its parent."""
        assert 0 < pages < self.num_pages(node)
        pb = self.page_bytes
        cut = pages * pb
        head = TreeNode(
            key=node.key[:cut],
            parent=node.parent,
            children={node.key[cut : cut + pb]: node},
            device_indices=None if node.device_indices is None else node.device_indices[:pages],
            host_indices=None if node.host_indices is None else node.host_indices[:pages],
            lock_ref=node.lock_ref,
            last_access=node.last_access,
            hit_count=node.hit_count,
            loading=node.loading,
            saving=node.saving,
            hashes=None if node.hashes is None else node.hashes[:pages],
        )
        node.parent.children[node.key[:pb]] = head
        node.key = node.key[cut:]
        node.parent = head
        if node.device_indices is not None:
            node.device_indices = node.device_indices[pages:]
        if node.host_indices is not None:
            node.host_indices = node.host_indices[pages:]
        if node.hashes is not None:
            node.hashes = node.hashes[pages:]
        self.version += 1
        return head

    def remove(self, node: TreeNode) -> None:
        """Detach a node and its subtree, whose pages were already released; detached nodes have no parent."""
        del node.parent.children[node.key[: self.page_bytes]]
        for n in self.subtree(node):
            assert n.device_indices is None and n.host_indices is None and n.lock_ref == 0, n
            n.parent = None
        self.version += 1

    # -- tiers ------------------------------------------------------------------------------------------------

    def set_device(self, node: TreeNode, pages: torch.Tensor) -> None:
        assert node.device_indices is None
        node.device_indices = pages
        self.device_pages += pages.numel()
        if node.lock_ref:
            self.locked_device_pages += pages.numel()
        self.version += 1

    def clear_device(self, node: TreeNode) -> torch.Tensor:
        pages = node.device_indices
        node.device_indices = None
        self.device_pages -= pages.numel()
        if node.lock_ref:
            self.locked_device_pages -= pages.numel()
        self.version += 1
        return pages

    def set_host(self, node: TreeNode, pages: torch.Tensor) -> None:
        assert node.host_indices is None
        node.host_indices = pages
        self.version += 1

    def clear_host(self, node: TreeNode) -> torch.Tensor:
        pages = node.host_indices
        node.host_indices = None
        self.version += 1
        return pages

    # -- locks ------------------------------------------------------------------------------------------------

    def lock(self, node: TreeNode) -> None:
        """Pin ``node`` and its ancestors against eviction from either tier."""
        while node is not self.root:
            if node.lock_ref == 0 and node.device_indices is not None:
                self.locked_device_pages += node.device_indices.numel()
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unbalanced unlock of {node}")
            node.lock_ref -= 1
            if node.lock_ref == 0 and node.device_indices is not None:
                self.locked_device_pages -= node.device_indices.numel()
            node = node.parent
