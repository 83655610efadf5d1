"""A registered pool's page descriptors name exactly the bytes of each page, and page lists pair up row by row."""
from __future__ import annotations

import json

import pytest
import torch

from decode_worker.cache.pool import KVLayout, KVPool
from decode_worker.transfer.descriptors import PoolDescriptor
from decode_worker.transfer.pool_share import PoolServer

LAYOUT = KVLayout("t@0", num_layers=3, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.bfloat16)


@pytest.fixture
def pool() -> KVPool:
    return KVPool(LAYOUT, 10)


def test_each_row_is_one_whole_page(pool):
    """One descriptor per page, covering every layer's K and V of it and nothing else."""
    desc = PoolDescriptor.of("a", pool.buffer)
    assert (desc.num_pages, desc.page_bytes) == (10, LAYOUT.page_bytes)
    table = desc.table()
    assert table.shape == (10, 3)
    for page in (0, 3, 9):
        (address, nbytes, device), = table[desc.indices([page])].tolist()
        first, last = pool.buffer[page, 0, 0].data_ptr(), pool.buffer[page, -1, 1, -1, -1, -1].data_ptr()
        assert (address, nbytes, device) == (first, LAYOUT.page_bytes, 0)
        assert last + pool.buffer.element_size() == address + nbytes


def test_page_lists_pair_up_row_by_row(pool):
    desc = PoolDescriptor.of("a", pool.buffer)
    table = desc.table()
    ours, theirs = desc.indices([7, 2]), desc.indices([4, 5])
    assert ours == [7, 2] and theirs == [4, 5]
    page_of = {pool.buffer[p].data_ptr(): p for p in range(10)}
    pairs = [(page_of[a], page_of[b]) for a, b in zip(table[ours][:, 0].tolist(), table[theirs][:, 0].tolist())]
    assert pairs == [(7, 4), (2, 5)]


def test_consecutive_pages_are_neighbours_in_list_and_memory(pool):
    """What lets the transfer library merge a run of pages into one copy."""
    desc = PoolDescriptor.of("a", pool.buffer)
    rows = desc.table()[desc.indices([4, 5, 6])]
    assert (rows[1:, 0] - rows[:-1, 0]).tolist() == [desc.page_bytes] * 2


def test_pages_outside_the_pool_and_odd_buffers_are_refused(pool):
    desc = PoolDescriptor.of("a", pool.buffer)
    with pytest.raises(ValueError, match="outside"):
        desc.indices([10])
    with pytest.raises(ValueError, match="outside"):
        desc.indices([-1])
    with pytest.raises(ValueError, match="contiguous"):
        PoolDescriptor.of("a", pool.buffer[:, :, :1])


def test_descriptor_survives_the_handshake_json(pool):
    desc = PoolDescriptor.of("a", pool.buffer)
    assert PoolDescriptor.from_dict(desc.to_dict()) == desc


def test_a_shared_pool_descriptor_says_how_to_ask_for_it_and_survives_the_json():
    shared = KVPool(LAYOUT, 10, shared=True)
    server = PoolServer(shared.shared)
    try:
        desc = PoolDescriptor.of("a", shared.buffer, server.region)
        wire = json.loads(json.dumps(desc.to_dict()))
        assert PoolDescriptor.from_dict(wire) == desc and desc.shared.nbytes == 10 * LAYOUT.page_bytes
        assert desc.shared.key not in repr(desc)  # the key that unlocks the pool stays out of logs
        for absent in (None, "drop"):  # a peer that does not share its pool (or predates sharing): read over NIXL
            if absent == "drop":
                del wire["shared"]
            else:
                wire["shared"] = None
            assert PoolDescriptor.from_dict(wire).shared is None
    finally:
        server.close()


@pytest.mark.parametrize("shared, field", [
    ({"host": "x", "pid": 1, "fd": 5, "inode": 7, "nbytes": 64}, "shared.socket"),  # an old-style region: no path
    ("yes", "shared"),
    ({}, "shared.host"),
])
def test_a_malformed_shared_region_is_refused_naming_the_field(pool, shared, field):
    wire = {**PoolDescriptor.of("a", pool.buffer).to_dict(), "shared": shared}
    with pytest.raises(ValueError, match=field):
        PoolDescriptor.from_dict(wire)
