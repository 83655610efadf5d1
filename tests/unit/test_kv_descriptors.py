"""A registered pool's page descriptors name exactly the bytes of each page, and page lists pair up row by row."""
from __future__ import annotations

import pytest
import torch

from decode_worker.cache.pool import KVLayout, KVPool
from decode_worker.transfer.descriptors import PoolDescriptor

LAYOUT = KVLayout("t@0", num_layers=3, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.bfloat16)


@pytest.fixture
def pool() -> KVPool:
    return KVPool(LAYOUT, 10)


def test_each_row_is_one_page_of_one_layer_and_kv(pool):
    desc = PoolDescriptor.of("a", pool.buffer)
    assert (desc.planes, desc.num_pages, desc.page_bytes) == (6, 10, LAYOUT.page_bytes)
    table = desc.table()
    for page in (0, 3, 9):
        rows = table[desc.indices([page])]
        expected = [pool.buffer[layer, kv, page].data_ptr() for layer in range(3) for kv in range(2)]
        assert rows[:, 0].tolist() == expected
        assert set(rows[:, 1].tolist()) == {pool.buffer[0, 0, 0].numel() * 2}


def test_page_lists_pair_up_plane_by_plane(pool):
    desc = PoolDescriptor.of("a", pool.buffer)
    table = desc.table()
    ours, theirs = desc.indices([7, 2]), desc.indices([4, 5])
    pairs = list(zip(table[ours][:, 0].tolist(), table[theirs][:, 0].tolist(), strict=True))
    page_of = {pool.buffer[layer, kv, p].data_ptr(): (layer, kv, p) for layer in range(3) for kv in range(2)
               for p in range(10)}
    mapped = {(page_of[a][2], page_of[b][2]) for a, b in pairs}
    assert mapped == {(7, 4), (2, 5)}  # page 7 <- 4 and 2 <- 5 in every plane, nothing crossed
    assert all(page_of[a][:2] == page_of[b][:2] for a, b in pairs)  # same layer and K/V on both sides


def test_consecutive_pages_are_neighbours_in_list_and_memory(pool):
    """What lets the transfer library merge a run of pages into one copy per plane."""
    desc = PoolDescriptor.of("a", pool.buffer)
    rows = desc.table()[desc.indices([4, 5, 6])]
    first_plane = rows[:3]
    assert (first_plane[1:, 0] - first_plane[:-1, 0]).tolist() == [desc.chunk_bytes] * 2


def test_pages_outside_the_pool_and_odd_buffers_are_refused(pool):
    desc = PoolDescriptor.of("a", pool.buffer)
    with pytest.raises(ValueError, match="outside"):
        desc.indices([10])
    with pytest.raises(ValueError, match="outside"):
        desc.indices([-1])
    with pytest.raises(ValueError, match="contiguous"):
        PoolDescriptor.of("a", pool.buffer[:, :, ::2])


def test_descriptor_survives_the_handshake_json(pool):
    desc = PoolDescriptor.of("a", pool.buffer)
    assert PoolDescriptor.from_dict(desc.to_dict()) == desc
