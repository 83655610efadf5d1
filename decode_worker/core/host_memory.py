"""Host memory: page-locking memory in place.

The L2 pool (and the copy engine's staging) is allocated plainly and then registered with CUDA where it lies,
so what is pinned is exactly what the sizing counted.
"""
from __future__ import annotations

import weakref

import torch


def pin_in_place(buffer: torch.Tensor, owner: object, cuda_available: bool | None = None) -> bool:
    """Page-lock ``buffer``'s memory where it lies (``cudaHostRegister``, as SGLang does) so copies to and from
    the GPU run asynchronously at full speed; unregistered once ``owner`` is collected (the memory must outlive
    it). ``pin_memory=True`` would go through torch's caching host allocator instead, which rounds each block
    up to a power of two: a 150 GB L2 pool would pin 256 GB. False, doing nothing, without CUDA.
    Registers the tensor's own bytes, not its storage's: a view at an offset would otherwise register past the end
    of its memory."""
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
