"""L1<->L2 copies go through staging allocated once and page-locked in place, in chunks, never through a new
pinned buffer per copy."""
from __future__ import annotations

import pytest
import torch

from decode_worker.cache import copy_engine
from decode_worker.cache.copy_engine import CopyEngine, Staging
from decode_worker.cache.pool import KVLayout, KVPool

LAYOUT = KVLayout("staging", num_layers=3, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.bfloat16)


def pools(pages: int = 24) -> tuple[KVPool, KVPool]:
    device, host = KVPool(LAYOUT, pages), KVPool(LAYOUT, pages)
    device.buffer.copy_(torch.randn_like(device.buffer, dtype=torch.float32))
    return device, host


def test_staging_is_allocated_and_registered_once_then_reused_chunk_by_chunk(monkeypatch: pytest.MonkeyPatch):
    registered, pinned_allocs = [], []
    real_pin, real_empty = copy_engine.pin_in_place, torch.empty
    monkeypatch.setattr(copy_engine, "pin_in_place", lambda buf, **kw: registered.append(buf.data_ptr()) or real_pin(buf, **kw))
    device, host = pools()
    staging = Staging(device.buffer, nbytes=2 * 2 * LAYOUT.page_bytes, stream=None)  # two pages a slot
    assert staging.pages_per_slot == 2 and len(registered) == 2
    addresses = [(s.host.data_ptr(), s.device.data_ptr()) for s in staging.slots]
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: pinned_allocs.append(kw) if kw.get("pin_memory") else real_empty(*a, **kw))

    for n in (1, 2, 5, 7):  # one chunk, a full slot, and copies that wrap around both slots
        src = torch.randperm(23)[:n] + 1
        on_host, back = torch.randperm(24)[:n], torch.randperm(23)[:n] + 1
        staging.backup(device.buffer, host.buffer, src, on_host)
        assert torch.equal(host.buffer[on_host], device.buffer[src])
        expected = device.buffer[src].clone()
        staging.load(host.buffer, device.buffer, on_host, back)
        assert torch.equal(device.buffer[back], expected)
    assert len(registered) == 2 and pinned_allocs == []
    assert [(s.host.data_ptr(), s.device.data_ptr()) for s in staging.slots] == addresses


def test_staging_refuses_mismatched_page_lists():
    device, host = pools(4)
    staging = Staging(device.buffer, nbytes=4 * LAYOUT.page_bytes, stream=None)
    with pytest.raises(ValueError, match="page count mismatch"):
        staging.backup(device.buffer, host.buffer, torch.tensor([1, 2]), torch.tensor([1]))


def test_a_cpu_engine_copies_directly_without_staging():
    device, host = pools(8)
    engine = CopyEngine(device.buffer, host.buffer)
    try:
        assert engine.staging is None
        engine.backup(torch.tensor([3, 1]), torch.tensor([0, 5])).result(timeout=30)
        assert torch.equal(host.buffer[[0, 5]], device.buffer[[3, 1]])
    finally:
        engine.close()
