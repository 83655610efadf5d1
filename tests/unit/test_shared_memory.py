"""A shared KV pool between real processes: another process on this host maps it read-only and sees its bytes, and
every way the region could name someone else's memory is refused with the reason."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from decode_worker.cache.pool import KVLayout, KVPool
from decode_worker.core.shared_memory import SharedRegion, map_region, shared_zeros

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = KVLayout("t@0", num_layers=2, num_kv_heads=2, head_dim=16, page_size=4, dtype=torch.bfloat16)

OWNER = """
import json, sys, torch
from decode_worker.cache.pool import KVPool
from tests.unit.test_shared_memory import LAYOUT
pool = KVPool(LAYOUT, 8, shared=True)
pool.buffer.view(torch.uint8).view(8, -1)[:, :] = torch.arange(8, dtype=torch.uint8).view(8, 1) + 1
print(json.dumps(pool.shared.to_dict()), flush=True)
sys.stdin.read()
"""

WRITER = """
import json, sys
from decode_worker.core.shared_memory import SharedRegion, map_region
mapping, why = map_region(SharedRegion.from_dict(json.loads(sys.argv[1])), int(sys.argv[2]))
print("mapped" if mapping else why, flush=True)
mapping.pages[0, 0] = 7  # read-only: this must kill us, never reach the owner's pool
print("wrote", flush=True)
"""


@pytest.fixture
def owner():
    proc = subprocess.Popen([sys.executable, "-c", OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    region = SharedRegion.from_dict(json.loads(proc.stdout.readline()))
    yield proc, region
    if proc.poll() is None:
        proc.stdin.close()
        proc.wait(10)


def test_a_shared_pool_is_zeroed_and_says_where_it_is():
    pool = KVPool(LAYOUT, 5, shared=True)
    assert pool.buffer.shape == LAYOUT.pages_shape(5) and pool.buffer.dtype == LAYOUT.dtype
    assert int(pool.buffer.count_nonzero()) == 0
    assert pool.shared.pid == os.getpid() and pool.shared.nbytes == 5 * LAYOUT.page_bytes
    assert KVPool(LAYOUT, 5).shared is None  # only when asked


def test_another_process_maps_the_pool_and_sees_its_bytes(owner):
    proc, region = owner
    mapping, why = map_region(region, LAYOUT.page_bytes)
    assert mapping is not None, why
    assert mapping.pages.shape == (8, LAYOUT.page_bytes)
    assert torch.equal(mapping.pages[:, 0], torch.arange(1, 9, dtype=torch.uint8))
    assert torch.equal(mapping.pages[5], torch.full((LAYOUT.page_bytes,), 6, dtype=torch.uint8))
    assert not mapping.owner_exited()
    proc.kill()
    proc.wait(10)
    assert mapping.owner_exited()  # what lets a reader drop a dead peer's memory
    mapping.close()


def test_the_mapping_is_read_only(owner):
    _, region = owner
    writer = subprocess.run([sys.executable, "-c", WRITER, json.dumps(region.to_dict()), str(LAYOUT.page_bytes)],
                            capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            timeout=60)
    assert writer.stdout.splitlines() == ["mapped"] and writer.returncode != 0
    mapping, _ = map_region(region, LAYOUT.page_bytes)
    assert int(mapping.pages[0, 0]) == 1  # the owner's byte is intact


@pytest.mark.parametrize("change, reason", [
    (dict(host="another-boot-id"), "another host"),
    (dict(inode=1), "not the one it named"),
    (dict(nbytes=8 * LAYOUT.page_bytes + LAYOUT.page_bytes), "not the one it named"),
    (dict(fd=9999), "cannot be opened"),
    (dict(nbytes=8 * LAYOUT.page_bytes - 1), "whole number"),
])
def test_a_region_naming_other_memory_is_refused_with_the_reason(owner, change, reason):
    _, region = owner
    mapping, why = map_region(dataclasses.replace(region, **change), LAYOUT.page_bytes)
    assert mapping is None and reason in why


def test_a_region_of_a_process_that_exited_is_refused(owner):
    proc, region = owner
    proc.kill()
    proc.wait(10)
    mapping, why = map_region(region, LAYOUT.page_bytes)
    assert mapping is None and str(region.pid) in why


def test_the_owner_closes_the_file_when_its_pool_goes():
    owner = object.__new__(type("Owner", (), {}))
    _, region = shared_zeros((4, 16), torch.float32, owner)
    assert os.path.exists(f"/proc/self/fd/{region.fd}")
    del owner
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/self/fd/{region.fd}") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not os.path.exists(f"/proc/self/fd/{region.fd}")
