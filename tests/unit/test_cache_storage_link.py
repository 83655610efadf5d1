"""The L3 link on its own (a real StorageTier over a folder, an L2 pool, no cache): which nodes' pages go on to L3
under each backup policy, and that what it stores can be read back from the store."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from decode_worker.cache.pool import KVLayout, KVPool
from decode_worker.cache.storage import FileStore, StorageTier
from decode_worker.cache.storage.link import SELECTIVE_HITS, StorageLink
from decode_worker.core.policies import StorageBackup

LAYOUT = KVLayout("link", num_layers=1, num_kv_heads=1, head_dim=4, page_size=2, dtype=torch.float32)


def test_all_backs_up_every_node_and_hit_twice_only_those_hit_twice():
    every, twice = StorageLink(None, None, StorageBackup.ALL), StorageLink(None, None, StorageBackup.HIT_TWICE)
    assert every.after_backup(0) and not every.on_hit(SELECTIVE_HITS)
    assert not twice.after_backup(SELECTIVE_HITS - 1) and twice.after_backup(SELECTIVE_HITS)
    assert twice.on_hit(SELECTIVE_HITS) and not twice.on_hit(SELECTIVE_HITS + 1)  # once, on the second hit


def test_stored_l2_pages_come_back_from_the_store(tmp_path):
    async def main():
        host = KVPool(LAYOUT, 4)
        host.buffer[2] = 7.0
        tier = StorageTier(FileStore(tmp_path, max_bytes=1 << 20), LAYOUT)
        link = StorageLink(tier, host)
        keys = ["ab" * 32]
        assert link.store([], np.empty(0, np.int64)) == 0
        assert link.store(keys, np.array([2], dtype=np.int64)) == 1
        await tier.flush()
        assert await tier.prefetch(keys, host, np.array([3], dtype=np.int64), deadline_s=5) == 1
        assert torch.equal(host.buffer[3], host.buffer[2])
        await tier.close()

    asyncio.run(main())


def test_a_page_count_that_does_not_fit_the_keys_is_refused(tmp_path):
    async def main():
        link = StorageLink(StorageTier(FileStore(tmp_path, max_bytes=1 << 20), LAYOUT), KVPool(LAYOUT, 4))
        with pytest.raises(ValueError, match="1 keys for 2 host pages"):
            link.store(["ab" * 32], np.array([0, 1], dtype=np.int64))

    asyncio.run(main())
