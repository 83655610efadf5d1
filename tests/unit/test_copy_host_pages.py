"""Host-to-host page copies (a CPU worker's L1 <-> L2): runs of consecutive pages copied whole, any order."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from decode_worker.cache.copy_engine import copy_host_pages


@pytest.mark.parametrize("src,dst", [
    ([1, 2, 3, 7, 8, 0], [4, 5, 6, 9, 2, 11]),  # a run, a run broken on one side only, singles
    ([5, 4, 3], [0, 1, 2]),  # descending source: no run
    ([], []),
])
def test_every_page_lands_where_it_was_sent_and_nothing_else_changes(src, dst):
    a = torch.arange(10 * 6, dtype=torch.bfloat16).view(10, 2, 3)
    b = torch.full((12, 2, 3), -1.0, dtype=torch.bfloat16)
    copy_host_pages(a, b, np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64))
    for s, d in zip(src, dst):
        assert torch.equal(b[d], a[s])
    untouched = [i for i in range(12) if i not in dst]
    assert bool((b[untouched] == -1).all())


def test_a_count_mismatch_is_refused():
    with pytest.raises(ValueError, match="2 source vs 1 destination"):
        copy_host_pages(torch.zeros(4, 2), torch.zeros(4, 2), np.array([0, 1]), np.array([0]))
