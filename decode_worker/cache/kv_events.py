"""KV events for KV-aware routers (README), vLLM's format: a tier change is one non-blocking ``emit``."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

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

    def fields(self) -> dict[str, Any]:
        """vLLM's fields in its order; LoRA is never set here."""
        return {"block_hashes": self.block_hashes, "parent_block_hash": self.parent_block_hash,
                "token_ids": self.token_ids, "block_size": self.block_size, "lora_id": None, "medium": self.medium,
                "lora_name": None}


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str

    def fields(self) -> dict[str, Any]:
        return {"block_hashes": self.block_hashes, "medium": self.medium}


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    def fields(self) -> dict[str, Any]:
        return {}


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
ENCODINGS = ("array", "map")


def wire(event: KVEvent, encoding: str) -> list | dict:
    """One event as msgspec writes vLLM's tagged structs: ``array`` (``array_like``: the tag, then every field in
    order, vLLM before 0.24) or ``map`` (the tag under ``type``, then the fields by name, vLLM since 0.24)."""
    tag, fields = type(event).__name__, event.fields()
    return [tag, *fields.values()] if encoding == "array" else {"type": tag, **fields}


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
