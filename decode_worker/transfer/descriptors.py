"""How a registered KV pool is addressed page by page, on our side and on a peer's.

A pool is page-major (``buffer[page, ...]``, see ``cache/pool.py``): one page, every layer with K and V, is one
contiguous run of ``page_bytes``, so the pool's descriptor list is one descriptor per page, in page order. The pool
is registered once as one region and its list prepared once per side: a transfer then names pages by index only,
one descriptor each, and the transfer library merges consecutive pages into one copy. A pool a peer on the same
host can map says how to ask for it (``transfer/pool_share.py``), so that peer copies its pages without the
library.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from .pool_share import SharedRegion


@dataclass(frozen=True)
class PoolDescriptor:
    """What a peer needs to address our pool's pages (sent in the handshake answer; plain ints, JSON-safe)."""

    agent: str  # the NIXL agent that registered it
    base: int  # address of page 0
    num_pages: int
    page_bytes: int  # one page, all layers, K and V; also the distance between two pages
    device: int = 0  # GPU index; 0 for host memory
    mem: str = "DRAM"  # or "VRAM"
    shared: SharedRegion | None = None  # how a process on the same host asks for the pool, to map it

    @classmethod
    def of(cls, agent: str, buffer: torch.Tensor, shared: SharedRegion | None = None) -> PoolDescriptor:
        if not buffer.is_contiguous():
            raise ValueError("a KV pool must be contiguous to be registered")
        num_pages = buffer.shape[0]
        on_gpu = buffer.device.type == "cuda"
        return cls(agent, buffer.data_ptr(), num_pages, buffer.numel() * buffer.element_size() // num_pages,
                   buffer.get_device() if on_gpu else 0, "VRAM" if on_gpu else "DRAM", shared)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> PoolDescriptor:
        """A peer's descriptor; a ``shared`` region that is present must be well formed (``ValueError`` names the
        field), and one that is absent or null means the peer does not share its pool."""
        shared = d.get("shared")
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k != "shared"},
                   shared=None if shared is None else SharedRegion.from_dict(shared))

    def table(self) -> np.ndarray:
        """Every page as an ``[address, bytes, device]`` row, row ``i`` holding page ``i``."""
        rows = np.empty((self.num_pages, 3), dtype=np.uint64)
        rows[:, 0] = self.base + np.arange(self.num_pages, dtype=np.uint64) * self.page_bytes
        rows[:, 1] = self.page_bytes
        rows[:, 2] = self.device
        return rows

    def indices(self, pages: list[int]) -> list[int]:
        """Rows of ``table()`` holding ``pages``: the pages themselves, checked; two pools' lists for the same
        number of pages pair up row by row. A plain list, as NIXL takes it: building a numpy array first costs
        more than the rest of preparing a one-page read (~70 of ~350 us with cold caches)."""
        if pages and (min(pages) < 0 or max(pages) >= self.num_pages):
            raise ValueError(f"page index outside the {self.num_pages}-page pool")
        return pages
