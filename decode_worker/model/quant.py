"""GGUF low-bit weights kept low-bit on CPU: Q4_1 layer matrices (``Int4Linear``) and the Q8_0 vocabulary matrix.

Few rows run ``decode_worker_kernels.cpu_lowbit`` (float32 math on the exact weights) where it builds, else torch's
int4 kernel, whose ``(q - 8) * scale + zero`` takes a block's ``d * q + m`` with bf16 activations.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from decode_worker.model.dequant import Q4_1_BYTES, Q8_0_BYTES, block_half
from decode_worker.model.matmul import Matmul, wide_linear
from decode_worker.model.native import native_kernels

Q4_GROUP = 32  # values per Q4_1 block, and the kernel's group size
_INNER_K_TILES = 2  # the packing's K tiling: K must be a multiple of 16 * this


@dataclass
class Q4Blocks:
    """A Q4_1 matrix: codes one per byte, per-block scale and minimum."""

    codes: torch.Tensor  # uint8 [rows, cols], values 0..15
    scale: torch.Tensor  # float32 [rows, cols // 32]
    minimum: torch.Tensor  # float32 [rows, cols // 32]

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @classmethod
    def from_gguf(cls, raw: np.ndarray, rows: int, cols: int) -> "Q4Blocks":
        """Parse GGUF Q4_1 bytes (per block: fp16 d, fp16 m, 16 bytes of nibbles)."""
        blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, cols // Q4_GROUP, Q4_1_BYTES)
        d, m = block_half(blocks, 0), block_half(blocks, 2)
        nibbles = blocks[..., 4:]
        codes = np.concatenate((nibbles & 0x0F, nibbles >> 4), axis=-1).reshape(rows, cols)
        return cls(torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(m))

    def dequantize(self) -> torch.Tensor:
        rows, cols = self.codes.shape
        grouped = self.codes.view(rows, cols // Q4_GROUP, Q4_GROUP).float()
        return (grouped * self.scale[..., None] + self.minimum[..., None]).view(rows, cols)

    def map_rows(self, fn) -> "Q4Blocks":
        """``fn`` applied to every part's rows."""
        return Q4Blocks(fn(self.codes), fn(self.scale), fn(self.minimum))

    @staticmethod
    def stack(parts: list["Q4Blocks"]) -> "Q4Blocks":
        """Row-wise concatenation."""
        return Q4Blocks(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scale", "minimum")))


@dataclass
class Q8Blocks:
    """A Q8_0 matrix: signed codes and a per-block scale."""

    codes: torch.Tensor  # int8 [rows, cols]
    scale: torch.Tensor  # float32 [rows, cols // 32]

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @classmethod
    def from_gguf(cls, raw: np.ndarray, rows: int, cols: int) -> "Q8Blocks":
        """Parse GGUF Q8_0 bytes (per block: fp16 d, 32 int8 values)."""
        blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, cols // Q4_GROUP, Q8_0_BYTES)
        d = block_half(blocks, 0)
        codes = blocks[..., 2:].copy().view(np.int8).reshape(rows, cols)
        return cls(torch.from_numpy(codes), torch.from_numpy(d))

    def dequantize(self) -> torch.Tensor:
        rows, cols = self.codes.shape
        return (self.codes.view(rows, cols // Q4_GROUP, Q4_GROUP).float() * self.scale[..., None]).view(rows, cols)


def packable(rows: int, cols: int) -> bool:
    """Whether the int4 kernel's tiling takes a ``[rows, cols]`` weight."""
    return cols % (16 * _INNER_K_TILES) == 0 and cols % Q4_GROUP == 0 and rows % 8 == 0


def kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    """The int4 kernel's activation dtype: on x86 only bf16 is vectorized, so float32 goes through it."""
    return torch.bfloat16 if dtype == torch.float32 else dtype


def kernel_scales_and_zeros(blocks: Q4Blocks, dtype: torch.dtype) -> torch.Tensor:
    """The kernel's ``[cols // 32, rows, 2]`` table: ``scale = d``, ``zero = m + 8d``."""
    zero = blocks.minimum + 8 * blocks.scale
    return torch.stack((blocks.scale.t(), zero.t()), dim=-1).to(dtype).contiguous()


class TorchInt4Matmul(nn.Module):
    """torch's int4 kernel over Q4_1 blocks; the activations go in as ``kernel_dtype``, the output comes back in
    the input's dtype."""

    def __init__(self, blocks: Q4Blocks, dtype: torch.dtype):
        super().__init__()
        self.kernel_dtype = kernel_dtype(dtype)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(blocks.codes.to(torch.int32), _INNER_K_TILES)
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", kernel_scales_and_zeros(blocks, self.kernel_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # casts only where needed: a decode step runs this 120 times, and even a no-op cast costs a dispatch
        narrow = x if x.dtype == self.kernel_dtype else x.to(self.kernel_dtype)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(narrow, self.packed, Q4_GROUP, self.scales_and_zeros)
        return out if out.dtype == x.dtype else out.to(x.dtype)


class NativeInt4Matmul(nn.Module):
    """``cpu_lowbit``'s Q4_1 matmul: float32 math on the exact weights, in and out in the input's dtype."""

    def __init__(self, blocks: Q4Blocks, lib):
        super().__init__()
        from decode_worker_kernels.cpu_lowbit import LowBitMatmul

        self.matmul = LowBitMatmul.q4_1(lib, blocks.codes, blocks.scale, blocks.minimum)
        self.register_buffer("codes", self.matmul.codes)  # in the state dict, so the weights digest covers them
        self.register_buffer("tables", self.matmul.tables)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)


class Int4Linear(nn.Module):
    """``x @ W.T`` over Q4_1 ``W``: ``NativeInt4Matmul`` where the low-bit kernels build, else ``TorchInt4Matmul``;
    inputs of ``wide_from_rows`` rows or more use ``wide_linear`` (``exact``: float32 keeps float32 weights there)."""

    def __init__(self, blocks: Q4Blocks, dtype: torch.dtype, wide_from_rows: int | None = None, exact: bool = False):
        super().__init__()
        rows, cols = blocks.shape
        if not packable(rows, cols):
            raise ValueError(f"an int4 weight of shape {(rows, cols)} cannot be packed")
        self.in_features, self.out_features = cols, rows
        lib = native_kernels()
        self.narrow = NativeInt4Matmul(blocks, lib) if lib is not None else TorchInt4Matmul(blocks, dtype)
        self.wide_from_rows = wide_from_rows
        self.wide: Matmul | None = None if wide_from_rows is None else wide_linear(blocks.dequantize(), dtype, exact)
        # the forms shape the numbers (and so the KV): the weights digest includes them
        self.form = f"{type(self.narrow).__name__}/{type(self.wide).__name__}@{wide_from_rows}"
        # Both forms as plain callables: a step runs 120 of these matmuls, and reaching a submodule through
        # nn.Module's attribute lookup and call dispatch costs ~2 us each time.
        self.narrow_call = self.narrow.forward
        self.wide_call = getattr(self.wide, "forward", self.wide)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if self.wide_call is not None and flat.shape[0] >= self.wide_from_rows:
            out = self.wide_call(flat)
        else:
            out = self.narrow_call(flat)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)
