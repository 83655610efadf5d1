"""Which L2 pages go on to L3; sees keys, page ids and hit counts, never nodes."""
from __future__ import annotations

import numpy as np

from decode_worker.cache.node import SELECTIVE_HITS
from decode_worker.cache.pool import KVPool
from decode_worker.cache.storage.tier import StorageTier
from decode_worker.core.policies import StorageBackup

__all__ = ["SELECTIVE_HITS", "StorageLink"]


class StorageLink:
    """A ``StorageTier`` fed from the L2 pool."""

    def __init__(self, tier: StorageTier, host_pool: KVPool, policy: StorageBackup = StorageBackup.ALL):
        self.tier = tier
        self.host_pool = host_pool
        self.policy = policy

    def after_backup(self, hit_count: int) -> bool:
        """A node just backed up to L2 goes on to L3?"""
        return self.policy == StorageBackup.ALL or hit_count >= SELECTIVE_HITS

    def on_hit(self, hit_count: int) -> bool:
        """A node on L2 goes to L3 on this hit? Under hit_twice, on its second."""
        return self.policy == StorageBackup.HIT_TWICE and hit_count == SELECTIVE_HITS

    def store(self, keys: list[str], host_pages: np.ndarray) -> int:
        """Queue an L2 -> L3 backup (pages copied out at once); returns pages queued."""
        return self.tier.backup(keys, self.host_pool, host_pages) if keys else 0
