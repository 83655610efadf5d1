"""Size the L2 host pool from ``--disaggregation-decode-hicache-ratio`` / ``-size`` and refuse early if it won't fit.

Allocating tens of GB of (pinned) host memory that the machine does not have fails late and obscurely (an OOM
kill mid-serving, or a CUDA pinning error); checking ``MemAvailable`` at start turns that into a clear message.
"""
from __future__ import annotations

from decode_worker.cache.pool import KVLayout, KVPool
from decode_worker.core.host_memory import pin_in_place

GB = 10**9  # SGLang's --hicache-size unit


class InsufficientHostMemory(RuntimeError):
    """The requested L2 pool does not fit in this host's available memory."""


def mem_available_bytes(meminfo: str = "/proc/meminfo") -> int:
    with open(meminfo) as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no MemAvailable in {meminfo}")


def host_pool_pages(
    layout: KVLayout,
    device_pages: int,
    ratio: float = 3.0,
    size_gb: float | None = None,
    available_bytes: int | None = None,
    headroom_bytes: int = 2 * 1024**3,
) -> int:
    """Pages of the L2 pool: ``size_gb`` if given, else ``ratio`` times the L1 pool.

    Raises ``InsufficientHostMemory`` when the pool plus ``headroom_bytes`` (for the process itself) exceeds
    the memory the host has available now.
    """
    if size_gb is not None:
        if size_gb <= 0:
            raise ValueError(f"--disaggregation-decode-hicache-size must be positive, got {size_gb}")
        pages = int(size_gb * GB // layout.page_bytes)
        asked = f"--disaggregation-decode-hicache-size {size_gb} GB"
    else:
        if ratio <= 0:
            raise ValueError(f"--disaggregation-decode-hicache-ratio must be positive, got {ratio}")
        pages = int(device_pages * ratio)
        asked = f"--disaggregation-decode-hicache-ratio {ratio} x {device_pages} L1 pages"
    if pages < 1:
        raise ValueError(f"{asked} gives an empty L2 pool (one page is {layout.page_bytes} bytes)")
    need = pages * layout.page_bytes
    have = mem_available_bytes() if available_bytes is None else available_bytes
    if need + headroom_bytes > have:
        raise InsufficientHostMemory(
            f"L2 host KV pool needs {need / GB:.2f} GB ({pages} pages of {layout.page_bytes} bytes, from {asked}) "
            f"plus {headroom_bytes / GB:.2f} GB headroom, but the host has only {have / GB:.2f} GB available. "
            "Lower --disaggregation-decode-hicache-ratio or set a smaller --disaggregation-decode-hicache-size."
        )
    return pages


def make_host_pool(layout: KVLayout, num_pages: int, device_pool: KVPool, cuda_available: bool | None = None) -> KVPool:
    """The L2 pool in host memory, exactly the bytes ``host_pool_pages`` counted; page-locked in place when L1 is
    on CUDA, so copies run asynchronously at full speed (see ``pin_in_place``: no power-of-two rounding)."""
    pool = KVPool(layout, num_pages, device="cpu")
    if device_pool.device.type == "cuda":
        pin_in_place(pool.buffer, owner=pool, cuda_available=cuda_available)
    return pool
