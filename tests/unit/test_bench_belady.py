"""The Belady bound of ``benchmarks/bench_cache.py`` on a trace small enough to work out by hand."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_cache.py"


@pytest.fixture(scope="module")
def belady():
    spec = importlib.util.spec_from_file_location("bench_cache", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.belady_hit_rate


# Pages (size 4): A = shared head, B and C = two tails. Accesses: A B | A C | A B (24 tokens).
TRACE = [[1] * 4 + [2] * 4, [1] * 4 + [3] * 4, [1] * 4 + [2] * 4]


@pytest.mark.parametrize("capacity, rate", [
    (0, 0.0),
    (1, round(2 * 4 / 24, 4)),  # keeps A (needed sooner than B): hits A twice, B never
    (2, round(3 * 4 / 24, 4)),  # keeps A and B, bypasses C (never used again): every reuse hits
])
def test_belady_keeps_what_is_needed_soonest(belady, capacity, rate):
    assert belady(TRACE, 4, capacity) == rate
