"""KV events for KV-aware routers (README), vLLM's format: a tier change is one non-blocking ``emit``."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from decode_worker.cache.node import TreeNode

MEDIUM_GPU = "GPU"  # L1
MEDIUM_CPU = "CPU"  # L2


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str

    def wire(self) -> list:
        """msgspec ``array_like``: the tag, then every field in order."""
        return ["BlockStored", self.block_hashes, self.parent_block_hash, self.token_ids, self.block_size, None,
                self.medium, None]


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str

    def wire(self) -> list:
        return ["BlockRemoved", self.block_hashes, self.medium]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    def wire(self) -> list:
        return ["AllBlocksCleared"]


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def block_hash(hex_digest: str) -> int:
    """A page's event hash: its digest's first 8 bytes, big-endian, signed."""
    value = int(hex_digest[:16], 16)
    return value - (1 << 64) if value >= 1 << 63 else value


class HashedTree(Protocol):
    """What the events read of the tree."""

    root: TreeNode
    page_size: int

    def page_hashes(self, node: TreeNode) -> list[str]: ...


class TreeEvents:
    """What ``RadixTree`` calls as nodes gain or lose a tier."""

    def __init__(self, tree: HashedTree, emit: Callable[[KVEvent], None]):
        self.tree = tree
        self.emit = emit

    def stored(self, node: TreeNode, medium: str) -> None:
        hashes = self.tree.page_hashes(node)
        parent = node.parent
        prev = None if parent is self.tree.root else block_hash(self.tree.page_hashes(parent)[-1])
        tokens = np.frombuffer(node.key, dtype="<i4").tolist()
        self.emit(BlockStored([block_hash(h) for h in hashes], prev, tokens, self.tree.page_size, medium))

    def removed(self, node: TreeNode, medium: str) -> None:
        self.emit(BlockRemoved([block_hash(h) for h in self.tree.page_hashes(node)], medium))

    def cleared(self) -> None:
        self.emit(AllBlocksCleared())
