"""The tree node, its keys (int32 LE token ids) and page hashes (chained SHA-256 seeded with the layout's
fingerprint)."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from decode_worker.core.sequence import TOKEN_BYTES, pack_tokens

SELECTIVE_HITS = 2  # the hit that backs a node up under write_through_selective (to L2) and hit_twice (to L3)
Key = bytes  # token ids, int32 little-endian (``pack_tokens``)
Tokens = Sequence[int] | np.ndarray | torch.Tensor | Key


def token_key(tokens: Tokens) -> Key:
    """The tree key of a token sequence (a key passes through)."""
    if isinstance(tokens, bytes):
        return tokens
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.cpu().numpy()
    if isinstance(tokens, np.ndarray):
        return np.ascontiguousarray(tokens, dtype="<i4").tobytes()
    return pack_tokens(tokens)


@dataclass(eq=False, slots=True)
class TreeNode:
    """A run of whole pages and where their KV lives: L1, L2 or both."""

    key: Key  # this node's run of whole pages
    parent: TreeNode | None = None
    children: dict[Key, TreeNode] = field(default_factory=dict)
    device_indices: np.ndarray | None = None  # L1 page ids, int64, one per page
    host_indices: np.ndarray | None = None  # L2 page ids
    lock_ref: int = 0  # live users of this node or any descendant
    last_access: int = 0  # logical clock, for LRU
    hit_count: int = 0  # for LFU and write_through_selective
    loading: Any = None  # the copy in flight writing device_indices (L2->L1), a ``PendingCopy``
    saving: Any = None  # the copy in flight writing host_indices (L1->L2)
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
    """Per whole page, SHA-256 over the previous digest and the page's key."""
    step = page_size * TOKEN_BYTES
    out = []
    for start in range(0, len(key) - step + 1, step):
        prev = hashlib.sha256(prev + key[start : start + step]).digest()
        out.append(prev)
    return out
