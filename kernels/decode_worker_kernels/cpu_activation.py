"""SwiGLU's activation for CPU (``cpu_activation.c``, built by ``cpu_native``): ``silu(gate) * up`` over the fused
gate-up projection in one pass, float32 math and one rounding."""
from __future__ import annotations

import ctypes

import torch
from decode_worker_kernels.cpu_native import DTYPES


def fits(gate_up: torch.Tensor) -> bool:
    """A contiguous float32 or bf16 CPU tensor whose halves are a multiple of 16 wide."""
    return (gate_up.device.type == "cpu" and gate_up.dtype in DTYPES
            and gate_up.is_contiguous() and gate_up.shape[-1] % 32 == 0)


def silu_mul_cpu(lib: ctypes.CDLL, gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [..., 2 * width]``, in its dtype."""
    if not fits(gate_up):
        raise ValueError(f"CPU SwiGLU takes a contiguous float32 or bf16 [..., 32k], got {gate_up.dtype} "
                         f"{tuple(gate_up.shape)}")
    width = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], width, dtype=gate_up.dtype)
    lib.silu_mul(gate_up.data_ptr(), gate_up.numel() // (2 * width), width, out.data_ptr(),
                 int(gate_up.dtype == torch.bfloat16))
    return out
