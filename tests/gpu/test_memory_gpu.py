"""Device and pinned memory on a CUDA device: the registered L2 pool, the copy engine (direct with a pinned pool,
through staging with a pageable one), and the KV pool sized from free memory (their logic is tested on CPU in
tests/unit)."""
from __future__ import annotations

import torch

from decode_worker.cache.copy_engine import CopyEngine
from decode_worker.cache.pool import KVLayout, KVPool
from decode_worker.cache.sizing import device_pool_tokens, make_host_pool
from tests.gpu.conftest import GPU_ONLY, random_loaded

pytestmark = GPU_ONLY

LAYOUT = KVLayout("staging", num_layers=3, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.bfloat16)


def test_registered_l2_pool_is_pinned_on_cuda():
    layout = KVLayout("test", num_layers=3, num_kv_heads=2, head_dim=24, page_size=16, dtype=torch.bfloat16)
    pool = make_host_pool(layout, 100, KVPool(layout, 4, device="cuda"))
    assert pool.buffer.is_pinned() and pool.buffer.untyped_storage().nbytes() == 100 * layout.page_bytes


def test_cuda_engine_round_trips_through_its_registered_staging():
    device = KVPool(LAYOUT, 64, device="cuda")
    device.buffer.copy_(torch.randn_like(device.buffer, dtype=torch.float32))
    host = KVPool(LAYOUT, 64)
    engine = CopyEngine(device.buffer, host.buffer, staging_bytes=6 * LAYOUT.page_bytes)  # 3 pages a slot
    try:
        slots = engine.staging.slots
        assert all(s.host.is_pinned() for s in slots)
        addresses = [s.host.data_ptr() for s in slots]
        src, mid, back = torch.arange(1, 11), torch.arange(20, 30), torch.arange(40, 50)
        for future in (engine.backup(src, mid), engine.load(mid, back)):
            future.result(timeout=60)
        assert torch.equal(host.buffer[mid], device.buffer[src].cpu())
        assert torch.equal(device.buffer[back], device.buffer[src])
        assert [s.host.data_ptr() for s in slots] == addresses
    finally:
        engine.close()


def test_cuda_engine_moves_pages_straight_between_the_pools_when_l2_is_pinned():
    """With the L2 pool registered (as the server makes it), no staging: scattered pages and runs round-trip."""
    device = KVPool(LAYOUT, 64, device="cuda")
    device.buffer.copy_(torch.randn_like(device.buffer, dtype=torch.float32))
    host = make_host_pool(LAYOUT, 64, device)
    engine = CopyEngine(device.buffer, host.buffer)
    try:
        assert engine.staging is None
        src, mid, back = torch.tensor([1, 2, 3, 9, 30, 31]), torch.tensor([40, 41, 5, 6, 7, 60]), torch.arange(10, 16)
        for future in (engine.backup(src.numpy(), mid.numpy()), engine.load(mid.numpy(), back.numpy())):
            future.result(timeout=60)
        assert torch.equal(host.buffer[mid], device.buffer[src].cpu())
        assert torch.equal(device.buffer[back], device.buffer[src])
    finally:
        engine.close()


def test_pool_sized_from_free_memory_fits_and_keeps_the_rest_free():
    """After the weights, a pool of ``device_pool_tokens`` allocates, and about ``1 - fraction`` of the device stays
    free for activations and graphs (the allocator may round each block up by a little)."""
    loaded = random_loaded(dtype=torch.bfloat16)
    fraction = 0.5  # leaves room on a GPU other tests share
    tokens = device_pool_tokens(loaded.config, 16, torch.bfloat16, fraction)
    layout = KVLayout("sized", loaded.config.num_layers, loaded.config.num_kv_heads, loaded.config.head_dim, 16,
                      torch.bfloat16)
    pool = KVPool(layout, tokens // 16 + 1, device="cuda")
    free, total = torch.cuda.mem_get_info()
    assert pool.num_pages == tokens // 16 + 1
    assert free >= (1 - fraction) * total - 64 * 2**20
