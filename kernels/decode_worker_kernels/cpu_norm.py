"""RMS norm over a float64 residual stream for CPU (``cpu_norm.c``, built by ``cpu_native``): adds a layer's output
into the stream in place, then normalises, in one pass over the rows."""
from __future__ import annotations

import ctypes

import torch
from decode_worker_kernels.cpu_native import DTYPES


def fits(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors: a contiguous float64 CPU stream of rows a multiple of 16 wide, and a
    float32 or bf16 weight and (contiguous, same shape) delta."""
    ok = (h.device.type == "cpu" and h.dtype == torch.float64 and h.is_contiguous() and h.shape[-1] % 16 == 0
          and weight.dtype in DTYPES and weight.is_contiguous() and weight.shape == h.shape[-1:])
    if delta is not None:
        ok = ok and delta.dtype in DTYPES and delta.shape == h.shape and delta.is_contiguous()
    return ok


def rms_norm_cpu(lib: ctypes.CDLL, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """``norm(h + delta) * weight`` in ``weight``'s dtype, ``h += delta`` in place first when ``delta`` is given."""
    if not fits(h, delta, weight):
        raise ValueError(f"CPU RMS norm takes a contiguous float64 stream, got {h.dtype} {tuple(h.shape)}")
    out = torch.empty(h.shape, dtype=weight.dtype)
    flags = (delta is not None and delta.dtype == torch.bfloat16) | (weight.dtype == torch.bfloat16) << 1
    flags |= (out.dtype == torch.bfloat16) << 2
    dim = h.shape[-1]
    lib.rms_norm(h.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(), h.numel() // dim, dim,
                 eps, out.data_ptr(), flags)
    return out
