"""Reusable staging buffers for delta KV on both sides of PD.

A fresh buffer per transfer costs first-touch page faults: glibc serves blocks over 32 MB with a new mmap
each time, and faulting one in runs at 1-2 GB/s here, slower than the UCX copy itself. So buffers are
kept after a transfer and lent out again, best fit first, up to ``max_cached_bytes``. Host blocks are on
huge pages (``core/host_memory.py``): UCX's cross-process copy runs 1.4-1.7x faster between them.

A buffer comes back only from a transfer that succeeded. After a failure a peer may, in the worst case,
still be touching it (see ``KVReceiver``), so it is left to the garbage collector instead.

``run_page_copy`` runs the page copies into and out of staging buffers (prefill's gather, decode's scatter).
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from math import prod

import torch

from decode_worker.core.host_memory import host_buffer

MIN_BYTES = 1 << 20
INLINE_COPY_BYTES = 2 << 20
"""Page copies below this run on the event loop: the hop to a thread and back costs more (~0.8 ms off a 1 MB PD
path here, ``bench/bench_transfer.py``) than the copy itself (~0.2 ms for 2 MB)."""


@dataclass
class StagingPool:
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    max_cached_bytes: int = 1 << 30
    _free: list[torch.Tensor] = field(default_factory=list)  # flat uint8 blocks, least recently returned first

    @property
    def cached_bytes(self) -> int:
        return sum(b.numel() for b in self._free)

    @contextmanager
    def borrow(self, shape: tuple[int, ...], dtype: torch.dtype) -> Iterator[torch.Tensor]:
        """A contiguous ``shape``/``dtype`` tensor on the pool's device; it returns to the pool when the block
        exits normally and is dropped when it raises."""
        nbytes = prod(shape) * dtype.itemsize
        block = self._take(nbytes)
        yield block[:nbytes].view(dtype).view(shape)
        self._give_back(block)

    def _take(self, nbytes: int) -> torch.Tensor:
        fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
        if fits:
            return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        size = max(MIN_BYTES, 1 << (nbytes - 1).bit_length())  # powers of two, so blocks get reused
        if self.device.type == "cpu":
            return host_buffer(size)
        return torch.empty(size, dtype=torch.uint8, device=self.device)

    def _give_back(self, block: torch.Tensor) -> None:
        if block.numel() > self.max_cached_bytes:
            return
        self._free.append(block)
        while self.cached_bytes > self.max_cached_bytes:
            self._free.pop(0)


async def run_page_copy(nbytes: int, fn: Callable[..., object], *args) -> None:
    """Run the page copy ``fn(*args)`` of ``nbytes``: inline when small, else in a thread, off the event loop (a
    64 MB scatter takes 5-7 ms here, while other requests stream).

    Returns only once the copy finished, even when cancelled meanwhile (then raises ``CancelledError``): the
    caller frees the pages it reads or writes as soon as its task has ended.
    """
    if nbytes < INLINE_COPY_BYTES:
        fn(*args)
        return
    work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    cancelled = False
    while not work.done():
        try:
            await asyncio.shield(work)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    work.result()
