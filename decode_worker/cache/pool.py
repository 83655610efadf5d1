"""Paged KV pools, page-major so that a page is one contiguous run, and the page allocator."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from decode_worker.core.shared_memory import SharedFile, shared_zeros


@dataclass(frozen=True)
class KVLayout:
    """What two parties must agree on to exchange KV pages."""

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype

    @property
    def page_bytes(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.page_size * self.num_kv_heads * self.head_dim * elem

    @property
    def page_shape(self) -> tuple[int, ...]:
        return self.num_layers, 2, self.page_size, self.num_kv_heads, self.head_dim

    def pages_shape(self, num_pages: int) -> tuple[int, ...]:
        return num_pages, *self.page_shape

    def describe(self) -> dict[str, object]:
        return {
            "model_id": self.model_id,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "page_size": self.page_size,
            "dtype": str(self.dtype).removeprefix("torch."),
            "order": "page_major",  # a page's byte order: a pool or L3 record laid out otherwise must not match
        }

    def fingerprint(self) -> str:
        """Seeds L3 keys; checked in the PD handshake."""
        text = ";".join(f"{k}={v}" for k, v in sorted(self.describe().items()))
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def differences(self, other: dict[str, object]) -> list[str]:
        mine = self.describe()
        return [f"{k}: ours={mine[k]!r} theirs={other.get(k)!r}" for k in mine if other.get(k) != mine[k]]


class KVPool:
    """A fixed paged KV buffer; a device pool's page 0 takes padding writes."""

    def __init__(self, layout: KVLayout, num_pages: int, device: torch.device | str = "cpu", pin_memory: bool = False,
                 shared: bool = False):
        """``shared``: mappable by other processes on this host (``self.shared``)."""
        self.layout = layout
        self.num_pages = num_pages
        self.device = torch.device(device)
        self.shared: SharedFile | None = None
        # Not huge pages: faulting them in would slow start-up more than page copies gain (docs/architecture.md,
        # "Cache internals"). Both allocations fault every page in now, so requests never pay for the faults.
        if shared and self.device.type == "cpu" and not pin_memory:
            self.buffer, self.shared = shared_zeros(layout.pages_shape(num_pages), layout.dtype, owner=self)
        else:
            self.buffer = torch.zeros(layout.pages_shape(num_pages), dtype=layout.dtype, device=self.device,
                                      pin_memory=pin_memory)
        # Each layer's page views, made once: slicing the buffer anew costs a decode step ~10 us a layer.
        self._k = [self.buffer[:, layer, 0] for layer in range(self.buffer.shape[1])]
        self._v = [self.buffer[:, layer, 1] for layer in range(self.buffer.shape[1])]

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    def k_pages(self, layer: int) -> torch.Tensor:
        """Layer K as ``[num_pages, page_size, kv_heads, head_dim]``; index it through its strides."""
        return self._k[layer]

    def v_pages(self, layer: int) -> torch.Tensor:
        return self._v[layer]

    def page_data(self, pages: torch.Tensor | list[int] | int) -> torch.Tensor:
        """A copy of ``pages``."""
        return self.buffer[torch.as_tensor(pages, dtype=torch.int64, device=self.device)]


class OutOfPages(RuntimeError):
    """An allocation that cannot be met; it took nothing."""


FREE = -1  # ``PageAllocator._state`` of a page that is not handed out
IN_USE = -2  # ...of one that is (free() briefly stamps a batch's pages with their positions, 0..n-1)
RESERVED = -3  # ...of one never handed out


class PageAllocator:
    """All-or-nothing; refuses a double free; never hands out the ``reserved`` first pages."""

    def __init__(self, num_pages: int, reserved: int = 0):
        if num_pages <= reserved:
            raise ValueError(f"pool of {num_pages} pages has no usable page after {reserved} reserved")
        self.num_pages = num_pages
        self.reserved = reserved
        self._stack = np.arange(num_pages - 1, reserved - 1, -1, dtype=np.int64)  # the top hands out low pages first
        self._top = self._stack.size  # free pages: self._stack[:self._top]
        self._state = np.full(num_pages, FREE, dtype=np.int64)
        self._state[:reserved] = RESERVED
        self._positions = np.arange(num_pages, dtype=np.int64)
        # what a batch's states read back as, compared as bytes (one memcmp; ndarray.all() costs more than the rest)
        self._all_in_use = np.full(num_pages, IN_USE, dtype=np.int64).tobytes()
        self._all_positions = self._positions.tobytes()

    @property
    def total(self) -> int:
        return self.num_pages - self.reserved

    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_used(self) -> int:
        return self.total - self._top

    def in_use(self, page: int) -> bool:
        return bool(self._state[page] == IN_USE)

    def alloc(self, n: int) -> np.ndarray:
        """``n`` page ids, or OutOfPages taking nothing."""
        if n > self._top:
            raise OutOfPages(f"need {n} pages, {self._top} free")
        pages = self._stack[self._top - n : self._top][::-1].copy()
        self._top -= n
        self._state[pages] = IN_USE
        return pages

    def free(self, pages: PageIds) -> None:
        """Free pages; raises, freeing none, if one is not in use or listed twice."""
        idx = page_ids(pages)
        n = len(idx)
        if n <= 1:
            if n:
                self._free_one(int(idx[0]))  # a request's partial last page: no array operations
            return
        state, size = self._state, n * idx.itemsize
        try:  # a negative id would count from the end; one past the pool raises IndexError
            if idx[idx.argmin()] < 0 or state.take(idx).tobytes() != self._all_in_use[:size]:
                raise RuntimeError(f"double free or foreign pages: {idx.tolist()}")
        except IndexError:
            raise RuntimeError(f"foreign pages: {idx.tolist()}") from None
        state[idx] = self._positions[:n]
        if state.take(idx).tobytes() != self._all_positions[:size]:
            state[idx] = IN_USE
            raise RuntimeError(f"page freed twice in one call: {idx.tolist()}")
        state[idx] = FREE
        self._stack[self._top : self._top + n] = idx[::-1]  # the first page freed is the next handed out
        self._top += n

    def _free_one(self, page: int) -> None:
        if not 0 <= page < self.num_pages or self._state.item(page) != IN_USE:
            raise RuntimeError(f"double free or foreign pages: {[page]}")
        self._state[page] = FREE
        self._stack[self._top] = page
        self._top += 1


PageIds = np.ndarray | torch.Tensor | list[int]
NO_PAGES = np.empty(0, dtype=np.int64)


def page_ids(pages: PageIds) -> np.ndarray:
    """Page ids as the cache keeps them: int64 numpy."""
    if type(pages) is np.ndarray and pages.dtype == np.int64:
        return pages
    if isinstance(pages, torch.Tensor):
        return pages.detach().to("cpu", torch.int64).numpy()
    return np.asarray(pages, dtype=np.int64)


def cat_pages(parts: list[np.ndarray]) -> np.ndarray:
    """Page id arrays joined."""
    return parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else NO_PAGES
