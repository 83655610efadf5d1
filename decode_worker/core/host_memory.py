"""Page-locking host memory in place, so what is pinned is what the sizing counted."""
from __future__ import annotations

import weakref

import torch


def pin_in_place(buffer: torch.Tensor, owner: object, cuda_available: bool | None = None) -> bool:
    """Page-lock ``buffer``'s own bytes (``cudaHostRegister``) until ``owner`` is collected; False without CUDA. Not
    ``pin_memory=True``: it rounds up to a power of two."""
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
