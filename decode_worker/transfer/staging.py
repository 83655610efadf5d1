"""Reusable staging buffers for delta KV on both sides of PD.

A fresh buffer per transfer costs first-touch page faults: glibc serves blocks over 32 MB with a new mmap
each time, and faulting one in runs at 1-2 GB/s here, slower than the UCX copy itself. So buffers are
kept after a transfer and lent out again, best fit first, up to ``max_cached_bytes``. Host blocks are on
huge pages (``cache/host_memory.py``), which nearly doubles UCX's cross-process copy.

A buffer comes back only from a transfer that succeeded. After a failure a peer may, in the worst case,
still be touching it (see ``KVReceiver``), so it is left to the garbage collector instead.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from math import prod

import torch

from decode_worker.cache.host_memory import host_buffer

MIN_BYTES = 1 << 20


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
        nbytes = prod(shape) * torch.empty((), dtype=dtype).element_size()
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
