"""How a registered KV pool is addressed page by page, on our side and on a peer's.

A pool is ``buffer[layer, kv, page, ...]``: one page is ``2 * num_layers`` runs ("planes") of ``chunk_bytes``, each
``num_pages * chunk_bytes`` apart. The pool is registered once as one region, and its descriptor list (one
descriptor per page and plane) is prepared once per side: a transfer then names pages by index only. Indices are
plane-major, so consecutive pages of one plane sit next to each other in the list and in memory, and the transfer
library merges them into one copy.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class PoolDescriptor:
    """What a peer needs to address our pool's pages (sent in the handshake answer; plain ints, JSON-safe)."""

    agent: str  # the NIXL agent that registered it
    base: int  # address of page 0 of plane 0
    num_pages: int
    planes: int
    chunk_bytes: int
    device: int = 0  # GPU index; 0 for host memory
    mem: str = "DRAM"  # or "VRAM"

    @classmethod
    def of(cls, agent: str, buffer: torch.Tensor) -> PoolDescriptor:
        layers, kv, num_pages = buffer.shape[:3]
        if not buffer.is_contiguous():
            raise ValueError("a KV pool must be contiguous to be registered")
        chunk = buffer[0, 0, 0].numel() * buffer.element_size()
        on_gpu = buffer.device.type == "cuda"
        return cls(agent, buffer.data_ptr(), num_pages, layers * kv, chunk,
                   buffer.get_device() if on_gpu else 0, "VRAM" if on_gpu else "DRAM")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> PoolDescriptor:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})

    def table(self) -> np.ndarray:
        """Every (page, plane) run as ``[address, bytes, device]`` rows, plane-major (see ``indices``)."""
        plane = np.repeat(np.arange(self.planes, dtype=np.uint64), self.num_pages)
        page = np.tile(np.arange(self.num_pages, dtype=np.uint64), self.planes)
        rows = np.empty((self.planes * self.num_pages, 3), dtype=np.uint64)
        rows[:, 0] = self.base + (plane * self.num_pages + page) * self.chunk_bytes
        rows[:, 1] = self.chunk_bytes
        rows[:, 2] = self.device
        return rows

    def indices(self, pages: list[int] | np.ndarray | torch.Tensor) -> np.ndarray:
        """Rows of ``table()`` holding ``pages``, plane by plane; two pools' lists for the same number of pages
        pair up row by row."""
        pages = np.asarray(pages, dtype=np.int64)
        if pages.size and (pages.min() < 0 or pages.max() >= self.num_pages):
            raise ValueError(f"page index outside the {self.num_pages}-page pool")
        planes = np.arange(self.planes, dtype=np.int64)[:, None] * self.num_pages
        return (planes + pages[None, :]).reshape(-1).astype(np.int32)

    @property
    def page_bytes(self) -> int:
        return self.planes * self.chunk_bytes
