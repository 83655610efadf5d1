"""The copy engine on its own (two CPU buffers, page ids, no nodes, no cache): copies land where they are sent,
in submission order, as futures."""
from __future__ import annotations

import numpy as np
import torch

from decode_worker.cache.copy_engine import CopyEngine, PageCopier


def test_load_and_backup_move_pages_in_submission_order():
    device, host = torch.zeros(6, 3), torch.arange(18, dtype=torch.float32).view(6, 3)
    engine: PageCopier = CopyEngine(device, host)
    try:
        first = engine.load(np.array([1, 2]), np.array([4, 5]))  # L2 1, 2 -> L1 4, 5
        second = engine.backup(np.array([4]), np.array([0]))  # reads what the load wrote: it runs after it
        second.result(timeout=5)
        assert first.done()
        assert torch.equal(device[4:6], host[1:3]) and torch.equal(host[0], host[1])
    finally:
        engine.close()
