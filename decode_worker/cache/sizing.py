"""L1 and L2 pool sizes from the flags; what would not fit is refused at start."""
from __future__ import annotations

import torch

from decode_worker.cache.copy_engine import STAGING_BYTES
from decode_worker.cache.pool import KVLayout, KVPool
from decode_worker.core.host_memory import pin_in_place

GB = 10**9  # SGLang's --hicache-size unit


class InsufficientHostMemory(RuntimeError):
    """The L2 pool does not fit in memory."""


class InsufficientDeviceMemory(RuntimeError):
    """The copy engine's device staging does not fit."""


def staging_bytes(cuda_available: bool | None = None) -> int:
    """Host (and as much device) memory for copy staging; none off CUDA."""
    return STAGING_BYTES if (torch.cuda.is_available() if cuda_available is None else cuda_available) else 0


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
    cuda_available: bool | None = None,
) -> int:
    """``size_gb`` if given, else ``ratio`` times L1, if that fits with staging and headroom."""
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
    need, staging = pages * layout.page_bytes, staging_bytes(cuda_available)
    have = mem_available_bytes() if available_bytes is None else available_bytes
    if need + staging + headroom_bytes > have:
        raise InsufficientHostMemory(
            f"L2 host KV pool needs {need / GB:.2f} GB ({pages} pages of {layout.page_bytes} bytes, from {asked}) "
            f"plus {staging / GB:.2f} GB copy staging and {headroom_bytes / GB:.2f} GB headroom, "
            f"but the host has only {have / GB:.2f} GB available. "
            "Lower --disaggregation-decode-hicache-ratio or set a smaller --disaggregation-decode-hicache-size."
        )
    return pages


def make_host_pool(layout: KVLayout, num_pages: int, device_pool: KVPool, cuda_available: bool | None = None,
                   device_free_bytes: int | None = None) -> KVPool:
    """The L2 pool, pinned when L1 is on CUDA, once the device staging fits."""
    if device_pool.device.type == "cuda":
        free = torch.cuda.mem_get_info(device_pool.device)[0] if device_free_bytes is None else device_free_bytes
        if free < STAGING_BYTES:
            raise InsufficientDeviceMemory(
                f"the L2 copy staging needs {STAGING_BYTES / 2**20:.0f} MiB of device memory next to the L1 pool, "
                f"but only {free / 2**20:.0f} MiB are free. Lower --max-total-tokens.")
    pool = KVPool(layout, num_pages, device="cpu")
    if device_pool.device.type == "cuda":
        pin_in_place(pool.buffer, owner=pool, cuda_available=cuda_available)
    return pool


MEM_FRACTION_STATIC = 0.85  # the --mem-fraction-static default


def device_pool_tokens(model, page_size: int, dtype: torch.dtype, mem_fraction_static: float = MEM_FRACTION_STATIC,
                       device: torch.device | str | None = None, free_bytes: int | None = None,
                       total_bytes: int | None = None) -> int:
    """L1 tokens on CUDA: weights plus pool within ``mem_fraction_static`` of the device (after loading)."""
    if not 0 < mem_fraction_static < 1:
        raise ValueError(f"--mem-fraction-static must be between 0 and 1, got {mem_fraction_static}")
    layout = KVLayout("sizing", model.num_layers, model.num_kv_heads, model.head_dim, page_size, dtype)
    if free_bytes is None or total_bytes is None:
        torch.cuda.empty_cache()  # blocks the loader freed still count as used until then
        free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    kept = (1 - mem_fraction_static) * total_bytes
    pages = int((free_bytes - kept) // layout.page_bytes) - 1  # less the scratch page
    if pages < 1:
        raise InsufficientDeviceMemory(
            f"no room for a KV pool: {free_bytes / GB:.2f} GB free after the weights, and --mem-fraction-static "
            f"{mem_fraction_static} keeps {kept / GB:.2f} GB of the device's {total_bytes / GB:.2f} GB for activations "
            f"and CUDA graphs (one page is {layout.page_bytes} bytes). Raise --mem-fraction-static or set "
            "--max-total-tokens.")
    return pages * page_size


HOST_CONTEXTS = 1  # full contexts of the model an unsized CPU L1 holds
HOST_L1_SHARE = 1 / 16  # most of the available memory an unsized CPU L1 takes


def host_device_pool_tokens(model, page_size: int, dtype: torch.dtype, available_bytes: int | None = None) -> int:
    """L1 tokens on CPU: ``HOST_CONTEXTS`` contexts, at most ``HOST_L1_SHARE`` of memory, at least one."""
    layout = KVLayout("sizing", model.num_layers, model.num_kv_heads, model.head_dim, page_size, dtype)
    have = mem_available_bytes() if available_bytes is None else available_bytes
    token_bytes = layout.page_bytes / page_size
    tokens = min(HOST_CONTEXTS * model.max_context, int(have * HOST_L1_SHARE / token_bytes))
    tokens = max(tokens, model.max_context)  # a request of the model's whole context always fits
    return max(page_size, tokens // page_size * page_size)
