"""L1<->L2 on CUDA with a pinned L2 pool: the copy engine moves pages straight between the pools, one asynchronous
copy per run of consecutive pages on its side stream, after the caller's work and before it reports done; no
staging is allocated. CUDA's stream and events are stood in for here, so the order of what the copy thread does is
checked without a GPU (tests/gpu/test_memory_gpu.py runs it on one)."""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest
import torch

from decode_worker.cache import copy_engine
from decode_worker.cache.copy_engine import CopyEngine

LOG: list[tuple] = []


class StandIn(torch.Tensor):
    """A CPU tensor the engine takes for a CUDA pool (``device``) or a pinned one (``host``: the engine reads only
    ``is_cuda`` of the first and ``is_pinned`` of the second); it logs each copy into it."""

    @property
    def is_cuda(self) -> bool:
        return True

    def is_pinned(self) -> bool:
        return True

    def copy_(self, src, non_blocking=False):
        LOG.append(("copy", non_blocking))
        return super().copy_(src, non_blocking=non_blocking)


class FakeEvent:
    def record(self, stream=None) -> None:
        LOG.append(("record", "copy" if stream is not None else "caller"))

    def synchronize(self) -> None:
        LOG.append(("wait_done",))


class FakeStream:
    def __init__(self, device=None):
        pass

    def wait_event(self, event) -> None:
        LOG.append(("stream_waits_caller",))


@pytest.fixture
def fake_cuda(monkeypatch):
    @contextmanager
    def on_stream(stream):
        LOG.append(("on_copy_stream",))
        yield

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", on_stream)
    monkeypatch.setattr(copy_engine, "pin_in_place", lambda *args, **kwargs: True)
    LOG.clear()
    yield
    LOG.clear()


def pools() -> tuple[torch.Tensor, torch.Tensor]:
    device = torch.arange(10 * 8, dtype=torch.float32).view(10, 8).as_subclass(StandIn)
    return device, torch.zeros(10, 8).as_subclass(StandIn)


def test_backup_to_a_pinned_pool_is_one_async_copy_per_run_after_the_callers_work(fake_cuda):
    device, host = pools()
    engine = CopyEngine(device, host)
    try:
        assert engine.staging is None
        engine.backup(np.array([2, 3, 4, 7]), np.array([5, 6, 7, 1])).result(timeout=30)
    finally:
        engine.close()
    assert torch.equal(host[[5, 6, 7, 1]], device[[2, 3, 4, 7]])
    assert LOG == [("record", "caller"), ("stream_waits_caller",), ("on_copy_stream",), ("copy", True),
                   ("copy", True), ("record", "copy"), ("wait_done",)]


def test_load_back_from_a_pinned_pool_splits_runs_where_either_side_breaks(fake_cuda):
    device, host = pools()
    host.copy_(torch.randn(10, 8))
    LOG.clear()
    engine = CopyEngine(device, host)
    try:
        engine.load(np.array([5, 6, 7]), np.array([0, 1, 9])).result(timeout=30)
    finally:
        engine.close()
    assert torch.equal(device[[0, 1, 9]], host[[5, 6, 7]])
    assert [entry for entry in LOG if entry[0] == "copy"] == [("copy", True)] * 2


def test_a_pageable_pool_still_goes_through_staging(fake_cuda):
    device, _ = pools()
    engine = CopyEngine(device, torch.zeros(10, 8))
    try:
        assert engine.staging is not None
    finally:
        engine.close()
