"""A weight's CPU matmul forms: reordered once for oneDNN, fp16-packed for fbgemm, low-bit blocks for the native
kernels, or a plain dense copy."""
from __future__ import annotations

import platform
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from decode_worker.model.native import native_kernels

Matmul = Callable[[torch.Tensor], torch.Tensor]


class HalfLinear:
    """``x @ W.T``, ``W`` packed for fbgemm's fp16 GEMM (float32 in and out)."""

    def __init__(self, weight: torch.Tensor):
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.float().contiguous(), None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x.float(), self.packed)


class DenseLinear:
    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)


class PackedLinear(nn.Module):
    """``x @ W.T + b``, ``W`` reordered once into oneDNN's blocked layout, in its own dtype (float32 or bf16). A plain
    matmul leaves oneDNN or MKL the weight's layout to handle on every call; the packed form is faster at decode's
    row counts (``benchmarks/bench_matmul.py``) and no slower in prefill."""

    PACKED_FOR_ROWS = 32  # the layout's row-count hint; any row count computes correctly

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), self.PACKED_FOR_ROWS)
        self.bias = None if bias is None else bias.detach().to(weight.dtype).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)


@dataclass
class ByRows:
    """``narrow`` for inputs of fewer than ``wide_from_rows`` rows, ``wide`` for the rest."""

    narrow: Matmul
    wide: Matmul
    wide_from_rows: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (self.wide if x.shape[0] >= self.wide_from_rows else self.narrow)(x)


def packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN computes ``dtype`` natively on this CPU: float32 on x86, bf16 with AVX512-BF16 or AMX."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return platform.machine().lower() in ("x86_64", "amd64")
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def packs_bf16() -> bool:
    return packs(torch.bfloat16)


def wide_linear(weight: torch.Tensor, dtype: torch.dtype, exact: bool = False) -> Matmul:
    """Many rows of a low-bit layer: for float32 fp16-packed (low-bit float32 stays low-bit), or with ``exact`` the
    float32 weight packed; oneDNN-packed for bf16 where the CPU has it; else a dense ``dtype`` copy."""
    if dtype == torch.float32 and not exact:
        return HalfLinear(weight)
    if weight.device.type == "cpu" and packs(dtype):
        return PackedLinear(weight.to(dtype))
    return DenseLinear(weight.to(dtype))


HALF_HEAD_BELOW_ROWS = 4  # bf16 vocabulary matmul: fbgemm's fp16 GEMM beats the packed bf16 one below this many rows
# The Q8_0 vocabulary matrix through the native kernel beats the packed form below these rows (bench_matmul.py).
Q8_HEAD_BELOW_ROWS = {torch.bfloat16: 12, torch.float32: 64}


def head_matmul(weight: torch.Tensor, low_bit: bool, q8_blocks=None) -> Matmul | None:
    """The vocabulary matmul's CPU form (float32 logits), or None for the plain matmul. Given the file's Q8_0
    blocks and the native kernels: those at few rows (a quarter of float32's bytes, the exact values). Else: fp16
    for low-bit float32; oneDNN-packed for float32; for bf16 fp16 at few rows (more precise than bf16, and reads
    half of float32's bytes) and packed from ``HALF_HEAD_BELOW_ROWS`` rows."""
    dtype = weight.dtype
    if weight.device.type != "cpu":
        return None
    lib = native_kernels() if q8_blocks is not None and dtype in Q8_HEAD_BELOW_ROWS else None
    if dtype == torch.float32:
        wide = HalfLinear(weight) if low_bit else (PackedLinear(weight) if packs(dtype) else None)
    elif dtype == torch.bfloat16 and packs(dtype):
        wide = PackedLinear(weight)
    else:
        return None
    if lib is not None:
        from decode_worker_kernels.cpu_lowbit import LowBitMatmul

        narrow = LowBitMatmul.q8_0(lib, q8_blocks.codes, q8_blocks.scale, out_dtype=torch.float32)
        return ByRows(narrow, wide or DenseLinear(weight), Q8_HEAD_BELOW_ROWS[dtype])
    if dtype == torch.bfloat16:
        return ByRows(HalfLinear(weight), wide, HALF_HEAD_BELOW_ROWS)
    return wide


def pack_linears(model: nn.Module, skip: tuple[str, ...] = ()) -> int:
    """Replace every dense CPU ``nn.Linear`` (but ``skip``) whose dtype ``packs`` with a ``PackedLinear``, one at a
    time, so the packed weight becomes the only copy and the peak grows by one weight. Returns how many."""
    names = [name for name, module in model.named_modules()
             if type(module) is nn.Linear and name not in skip and module.weight.device.type == "cpu"
             and packs(module.weight.dtype)]
    for name in names:
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent)
        dense = getattr(owner, attr)
        setattr(owner, attr, PackedLinear(dense.weight, dense.bias))
    return len(names)
