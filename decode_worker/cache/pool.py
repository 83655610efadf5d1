"""Paged KV storage and the page allocator shared by the L1 (device) and L2 (host) tiers.

Both tiers use one layout, ``buffer[layer, kv, page, slot, kv_head, head_dim]`` (kv 0 = K, 1 = V), so a page
moves between tiers with a single index copy over the page dimension, and attention reads one layer's K
as a slot-addressed view (``slot = page * page_size + offset``).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    """Everything two parties must agree on before exchanging KV pages."""

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers, K and V."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.page_size * self.num_kv_heads * self.head_dim * elem

    def pages_shape(self, num_pages: int) -> tuple[int, ...]:
        """``[layer, kv, page, slot, kv_head, head_dim]``: a pool of ``num_pages``, or the staging blob of that many."""
        return self.num_layers, 2, num_pages, self.page_size, self.num_kv_heads, self.head_dim

    def describe(self) -> dict[str, object]:
        return {
            "model_id": self.model_id,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "page_size": self.page_size,
            "dtype": str(self.dtype).removeprefix("torch."),
        }

    def fingerprint(self) -> str:
        """Stable hex digest of the layout; seeds storage keys and is checked in the PD handshake."""
        text = ";".join(f"{k}={v}" for k, v in sorted(self.describe().items()))
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def differences(self, other: dict[str, object]) -> list[str]:
        """Human-readable list of fields where ``other`` (a ``describe()`` dict) differs from us."""
        mine = self.describe()
        return [f"{k}: ours={mine[k]!r} theirs={other.get(k)!r}" for k in mine if other.get(k) != mine[k]]


class KVPool:
    """Fixed-size paged KV buffer. Page 0 of a device pool is a scratch page (padding writes go there)."""

    def __init__(self, layout: KVLayout, num_pages: int, device: torch.device | str = "cpu", pin_memory: bool = False):
        self.layout = layout
        self.num_pages = num_pages
        self.device = torch.device(device)
        # Not huge pages (see core/host_memory.py): page copies would gain only 10-20%, and faulting in huge pages
        # here runs at ~0.8 GB/s against ~4 GB/s for 4 KB ones, which would slow start-up by seconds for a pool
        # of a few GB (torch.zeros touches it all now, so requests never pay for the faults).
        self.buffer = torch.zeros(layout.pages_shape(num_pages), dtype=layout.dtype, device=self.device, pin_memory=pin_memory)

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    def k_slots(self, layer: int) -> torch.Tensor:
        """Slot-addressed view ``[num_pages * page_size, kv_heads, head_dim]`` of layer K."""
        return self.buffer[layer, 0].view(-1, self.layout.num_kv_heads, self.layout.head_dim)

    def v_slots(self, layer: int) -> torch.Tensor:
        return self.buffer[layer, 1].view(-1, self.layout.num_kv_heads, self.layout.head_dim)

    def k_pages(self, layer: int) -> torch.Tensor:
        """Page-addressed view ``[num_pages, page_size, kv_heads, head_dim]`` of layer K."""
        return self.buffer[layer, 0]

    def v_pages(self, layer: int) -> torch.Tensor:
        return self.buffer[layer, 1]


class OutOfPages(RuntimeError):
    """Raised when an allocation cannot be satisfied; the caller evicts or rejects."""


class PageAllocator:
    """All-or-nothing page allocator with double-free detection.

    ``reserved`` leading pages are never handed out (the device pool keeps page 0 as scratch).
    """

    def __init__(self, num_pages: int, reserved: int = 0):
        if num_pages <= reserved:
            raise ValueError(f"pool of {num_pages} pages has no usable page after {reserved} reserved")
        self.num_pages = num_pages
        self.reserved = reserved
        self._free = list(range(num_pages - 1, reserved - 1, -1))  # pop() hands out low pages first
        self._in_use = torch.zeros(num_pages, dtype=torch.bool)

    @property
    def total(self) -> int:
        """Usable pages (excludes reserved ones)."""
        return self.num_pages - self.reserved

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.total - len(self._free)

    def alloc(self, n: int) -> torch.Tensor:
        """Return ``n`` page indices (int64) or raise OutOfPages, taking nothing."""
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        idx = torch.tensor(pages, dtype=torch.int64)
        self._in_use[idx] = True
        return idx

    def free(self, pages: torch.Tensor) -> None:
        if pages.numel() == 0:
            return
        pages = pages.to(torch.int64).cpu()
        if not bool(self._in_use[pages].all()) or pages.unique().numel() != pages.numel():
            raise RuntimeError(f"double free or foreign pages: {pages.tolist()}")
        self._in_use[pages] = False
        self._free.extend(reversed(pages.tolist()))
