"""Addressing a registered, page-major KV pool: one NIXL descriptor per page, so transfers name pages by index."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from .pool_share import SharedRegion


@dataclass(frozen=True)
class PoolDescriptor:
    """What a peer needs to address our pool's pages (JSON-safe, in the handshake answer)."""

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
        """A peer's descriptor; ``ValueError`` names a malformed ``shared`` field."""
        shared = d.get("shared")
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k != "shared"},
                   shared=None if shared is None else SharedRegion.from_dict(shared))

    def table(self) -> np.ndarray:
        """Row ``i``: page ``i``'s ``[address, bytes, device]``."""
        rows = np.empty((self.num_pages, 3), dtype=np.uint64)
        rows[:, 0] = self.base + np.arange(self.num_pages, dtype=np.uint64) * self.page_bytes
        rows[:, 1] = self.page_bytes
        rows[:, 2] = self.device
        return rows

    def indices(self, pages: list[int]) -> list[int]:
        """The ``table()`` rows of ``pages``: the indices, range-checked (``ValueError``), as the list NIXL takes."""
        if pages and (min(pages) < 0 or max(pages) >= self.num_pages):
            raise ValueError(f"page index outside the {self.num_pages}-page pool")
        return pages
