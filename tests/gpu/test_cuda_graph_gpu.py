"""Real CUDA graphs of the decode step: replay after allocator churn equals the eager step, on buckets and padded
between them (the CPU stand-ins are tested in tests/unit/test_cuda_graph.py)."""
from __future__ import annotations

import pytest

from decode_worker.model.runner import ModelRunner
from tests.gpu.conftest import GPU_ONLY, random_loaded
from tests.unit.test_cuda_graph import replay_matches_eager

pytestmark = GPU_ONLY


@pytest.mark.parametrize("rows", [False, True], ids=["full_build", "page_table_rows"])
def test_graph_replay_after_allocator_churn_matches_eager(rows: bool):
    loaded = random_loaded()
    graphs = ModelRunner(loaded, max_total_tokens=4096, page_size=4, cuda_graph_max_bs=16)
    eager = ModelRunner(loaded, max_total_tokens=4096, page_size=4)
    assert graphs.graphs is not None and eager.graphs is None
    replay_matches_eager(graphs, eager, (1, 3, 8, 13), "cuda", rows)
