"""Host memory: PD staging buffers backed by transparent huge pages, and page-locking memory in place.

Linux here gives huge pages only to memory that asks for them (``transparent_hugepage=madvise``), and torch's
allocator does not ask. With 4 KB pages, every copy that crosses processes (UCX's shared-memory rendezvous:
one ``process_vm_readv`` per payload) walks and pins page by page: 6-8 GB/s for 16-64 MB here, against
12-17 GB/s between huge-page buffers. Copies within one process gain 5-15%.

KV pools stay on torch's own pages (``cache/pool.py``): faulting huge pages in is slow on this VM (~0.8 GB/s,
4 KB pages ~4 GB/s), so a pool of a few GB would start seconds later, for 10-20% faster page copies. Staging
buffers are few and reused (``transfer/staging.py``), so their faults are paid once per size.
"""
from __future__ import annotations

import mmap
import weakref

import torch

HUGE_PAGE = 2 << 20


def host_buffer(nbytes: int) -> torch.Tensor:
    """A zero-filled flat uint8 tensor of ``nbytes`` in host memory, on huge pages where the kernel has them.

    The memory is an anonymous private mapping, aligned to a huge page and advised ``MADV_HUGEPAGE``. The kernel
    zeroes each page when it is first touched (``torch.zeros`` instead writes every byte at once), and the
    mapping is freed with the last tensor viewing it.
    Small buffers, or kernels without transparent huge pages, get ordinary pages.
    """
    if nbytes < HUGE_PAGE:
        return torch.zeros(nbytes, dtype=torch.uint8)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):  # no THP in this kernel: ordinary pages work the same, only slower
        pass
    whole = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping alive as long as any view does
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def pin_in_place(buffer: torch.Tensor, owner: object, cuda_available: bool | None = None) -> bool:
    """Page-lock ``buffer``'s memory where it lies (``cudaHostRegister``, as SGLang does) so copies to and from
    the GPU run asynchronously at full speed; unregistered once ``owner`` is collected (the memory must outlive
    it). ``pin_memory=True`` would go through torch's caching host allocator instead, which rounds each block
    up to a power of two: a 150 GB L2 pool would pin 256 GB. False, doing nothing, without CUDA.
    Registers the tensor's own bytes, not its storage's: a view at an offset (``host_buffer``'s aligned slice)
    would otherwise register past the end of its mapping."""
    if not buffer.is_contiguous():
        raise ValueError("pin_in_place needs a contiguous tensor: a strided view's bytes are not one range")
    if not (torch.cuda.is_available() if cuda_available is None else cuda_available):
        return False
    ptr, nbytes = buffer.data_ptr(), buffer.numel() * buffer.element_size()
    _cuda_host_register(ptr, nbytes)
    weakref.finalize(owner, _cuda_host_unregister, ptr)
    return True


def _cuda_host_register(ptr: int, nbytes: int) -> None:
    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(err)}")


def _cuda_host_unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)
