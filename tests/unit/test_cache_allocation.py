"""Allocation apart from reuse, on its own (no tree, no cache): what an allocation must evict first, pages in
transit (drained by copies, lent to a prefetch) and the tier figures it reports."""
from __future__ import annotations

import pytest

from decode_worker.cache.allocation import Allocation
from decode_worker.cache.pool import OutOfPages


def test_l1_page_zero_is_scratch_and_a_refused_allocation_says_why():
    pages = Allocation(device_pages=5, host_pages=None)
    assert pages.device.total == 4 and pages.host is None
    got = pages.take_device(3, locked=0)
    assert 0 not in got
    with pytest.raises(OutOfPages, match=r"need 2 L1 pages: 1 free, 0 still being backed up to L2, 7 locked"):
        pages.take_device(2, locked=7)
    assert pages.device.num_free == 1  # nothing taken


def test_draining_pages_count_as_coming_back_until_their_copy_lands():
    pages = Allocation(device_pages=5, host_pages=None)
    held = pages.take_device(4, locked=0)
    pages.drain_later(held[:3])
    assert pages.device_short(3) == 0  # the three come back: nothing to evict
    assert pages.device_short(4) == 1
    pages.drained(held[:3])
    assert pages.draining == 0 and pages.device.num_free == 3


def test_lent_l2_pages_are_neither_free_nor_in_the_tree_until_attached_or_returned():
    pages = Allocation(device_pages=2, host_pages=4)
    lent = pages.take_host(3)
    assert pages.take_host(2) is None and pages.host_short(2) == 1
    pages.lend_host(lent)
    assert pages.host_out == 3
    pages.attach_host(1)
    pages.return_host(lent[1:])
    assert pages.host_out == 0 and pages.host.num_free == 3


def test_tier_figures_add_up_to_the_total():
    pages = Allocation(device_pages=9, host_pages=6)
    pages.take_device(5, locked=0)  # 4 of them in the tree, 1 locked
    dev = pages.device_pages(in_tree=4, locked=1)
    assert (dev.free, dev.used, dev.evictable, dev.locked) == (3, 1, 3, 1)
    assert dev.free + dev.used + dev.evictable + dev.locked == dev.total == 8
    pages.take_host(5)
    host = pages.host_pages(locked=2, evictable=1)
    assert (host.free, host.used, host.evictable, host.locked) == (1, 2, 1, 2)
    assert Allocation(3, None).host_pages(0, 0) is None
