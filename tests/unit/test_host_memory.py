"""PD staging buffers are zeroed, huge-page aligned, and on huge pages where Linux has them."""
from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from decode_worker.core.host_memory import HUGE_PAGE, host_buffer
from decode_worker.transfer.staging import StagingPool

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_page_bytes(address: int) -> int:
    """``AnonHugePages`` of the mapping holding ``address``, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    raise LookupError(f"no mapping holds {address:#x}")


def test_a_large_buffer_is_zeroed_aligned_and_outlives_its_mapping_object():
    n = (5 << 20) + 123
    view = host_buffer(n)[HUGE_PAGE:]
    gc.collect()  # only the view keeps the mapping now
    assert view.numel() == n - HUGE_PAGE and view.dtype == torch.uint8
    assert view.data_ptr() % HUGE_PAGE == 0
    assert int(view.count_nonzero()) == 0
    view.fill_(7)
    assert int(view.sum()) == 7 * view.numel()


def test_a_small_buffer_is_ordinary_zeroed_memory():
    small = host_buffer(1000)
    assert small.numel() == 1000 and int(small.count_nonzero()) == 0


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="kernel without transparent huge pages")
def test_touched_memory_is_backed_by_huge_pages():
    buf = host_buffer(16 << 20)
    buf.fill_(1)
    assert huge_page_bytes(buf.data_ptr()) >= 8 << 20  # ordinary torch memory has none here (THP: madvise)


def test_staging_blocks_use_it():
    with StagingPool().borrow((3 << 20,), torch.uint8) as staged:
        assert staged.data_ptr() % HUGE_PAGE == 0
