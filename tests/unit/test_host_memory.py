"""The L2 pool is page-locked in place, exactly the bytes its sizing counted."""
from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch

from decode_worker.cache.copy_engine import STAGING_BYTES
from decode_worker.cache.pool import KVLayout
from decode_worker.cache.sizing import InsufficientDeviceMemory, InsufficientHostMemory, host_pool_pages, make_host_pool
from decode_worker.core import host_memory

LAYOUT = KVLayout("test", num_layers=3, num_kv_heads=2, head_dim=24, page_size=16, dtype=torch.bfloat16)


@pytest.fixture
def cuda_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Record cudaHostRegister / cudaHostUnregister instead of calling CUDA."""
    calls: list[tuple] = []
    monkeypatch.setattr(host_memory, "_cuda_host_register", lambda ptr, n: calls.append(("register", ptr, n)))
    monkeypatch.setattr(host_memory, "_cuda_host_unregister", lambda ptr: calls.append(("unregister", ptr)))
    return calls


def test_l2_pool_for_a_cuda_l1_is_registered_in_place_with_no_rounding(cuda_calls):
    """The CUDA path allocates plainly and registers exactly the counted bytes (a pin_memory=True allocation
    would round 100 pages, 921,600 bytes, up to 1 MiB; on a CPU-only build it cannot even be made)."""
    pages = host_pool_pages(LAYOUT, 40, ratio=2.5, available_bytes=10**12)
    cuda_l1 = SimpleNamespace(device=torch.device("cuda"))
    pool = make_host_pool(LAYOUT, pages, cuda_l1, cuda_available=True, device_free_bytes=10**12)
    counted = pages * LAYOUT.page_bytes
    assert pool.buffer.untyped_storage().nbytes() == counted
    assert cuda_calls == [("register", pool.buffer.data_ptr(), counted)]
    ptr = pool.buffer.data_ptr()
    del pool
    gc.collect()
    assert cuda_calls[-1] == ("unregister", ptr)


def test_host_sizing_counts_the_copy_staging_with_cuda():
    """With CUDA the copy engine pins STAGING_BYTES of host memory next to the pool: a host with room for the
    pool alone is refused, one with room for both is not; without CUDA there is no staging to count."""
    pool_bytes = 100 * LAYOUT.page_bytes
    size = dict(ratio=2.5, headroom_bytes=0)
    assert host_pool_pages(LAYOUT, 40, available_bytes=pool_bytes, cuda_available=False, **size) == 100
    with pytest.raises(InsufficientHostMemory, match="plus 0.07 GB copy staging"):
        host_pool_pages(LAYOUT, 40, available_bytes=pool_bytes + STAGING_BYTES - 1, cuda_available=True, **size)
    assert host_pool_pages(LAYOUT, 40, available_bytes=pool_bytes + STAGING_BYTES, cuda_available=True, **size) == 100


def test_l2_pool_is_refused_before_registering_when_the_device_staging_does_not_fit(cuda_calls):
    cuda_l1 = SimpleNamespace(device=torch.device("cuda"))
    with pytest.raises(InsufficientDeviceMemory, match="needs 64 MiB of device memory .* only 63 MiB are free"):
        make_host_pool(LAYOUT, 10, cuda_l1, cuda_available=True, device_free_bytes=STAGING_BYTES - (1 << 20))
    assert not cuda_calls
    pool = make_host_pool(LAYOUT, 10, cuda_l1, cuda_available=True, device_free_bytes=STAGING_BYTES)
    assert cuda_calls == [("register", pool.buffer.data_ptr(), 10 * LAYOUT.page_bytes)]


def test_l2_pool_for_a_cpu_l1_is_plain_memory(cuda_calls):
    pool = make_host_pool(LAYOUT, 7, SimpleNamespace(device=torch.device("cpu")), cuda_available=True)
    assert pool.buffer.untyped_storage().nbytes() == 7 * LAYOUT.page_bytes and not cuda_calls


def test_pin_in_place_registers_a_views_own_bytes(cuda_calls):
    """An aligned slice of a bigger mapping starts past the storage's start: registering the storage's size from
    the view's address would run off the end of the mapping."""
    class Owner:
        pass

    base = torch.zeros(4096, dtype=torch.uint8)
    view = base[1000:3000]
    assert host_memory.pin_in_place(view, owner=Owner(), cuda_available=True)
    assert cuda_calls[0] == ("register", view.data_ptr(), 2000)
    with pytest.raises(ValueError, match="contiguous"):
        host_memory.pin_in_place(base.view(64, 64)[:, :8], owner=SimpleNamespace(), cuda_available=True)


def test_pin_in_place_does_nothing_without_cuda(cuda_calls):
    assert not host_memory.pin_in_place(torch.zeros(8), owner=SimpleNamespace(), cuda_available=False)
    assert not cuda_calls


def test_unsized_cpu_l1_holds_the_model_context_within_a_share_of_available_memory(monkeypatch: pytest.MonkeyPatch):
    from types import SimpleNamespace

    from decode_worker.cache import sizing

    smollm2 = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64, max_context=8192)
    token_bytes = 30 * 2 * 3 * 64 * 2  # bf16 K and V of every layer
    assert sizing.host_device_pool_tokens(smollm2, 16, torch.bfloat16, available_bytes=16 * 2**30) == 8192
    assert sizing.host_device_pool_tokens(smollm2, 16, torch.bfloat16, available_bytes=2**28) == 8192  # never less
    monkeypatch.setattr(sizing, "HOST_CONTEXTS", 4)  # the memory share caps it
    tight = sizing.host_device_pool_tokens(smollm2, 16, torch.bfloat16, available_bytes=6 * 2**30)
    assert 8192 < tight < 4 * 8192 and tight * token_bytes <= 6 * 2**30 / 16 and tight % 16 == 0
    fp32 = sizing.host_device_pool_tokens(smollm2, 16, torch.float32, available_bytes=12 * 2**30)  # 2x the bytes
    assert fp32 == int(12 * 2**30 / 16 / (2 * token_bytes)) // 16 * 16
