"""Q4_1 weights kept 4-bit on CPU: a block's ``d * q + m`` is the int4 kernel's ``(q - 8) * scale + zero``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from decode_worker.model.matmul import wide_linear

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
        blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, cols // Q4_GROUP, 20)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
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


class Int4Linear(nn.Module):
    """``x @ W.T`` over int4 ``W``; inputs of ``wide_from_rows`` rows or more use ``wide_linear``."""

    def __init__(self, blocks: Q4Blocks, dtype: torch.dtype, wide_from_rows: int | None = None):
        super().__init__()
        rows, cols = blocks.shape
        if not packable(rows, cols):
            raise ValueError(f"an int4 weight of shape {(rows, cols)} cannot be packed")
        self.in_features, self.out_features = cols, rows
        self.kernel_dtype = kernel_dtype(dtype)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(blocks.codes.to(torch.int32), _INNER_K_TILES)
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", kernel_scales_and_zeros(blocks, self.kernel_dtype))
        self.wide_from_rows = wide_from_rows
        self.wide = None if wide_from_rows is None else wide_linear(blocks.dequantize(), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if self.wide is not None and flat.shape[0] >= self.wide_from_rows:
            out = self.wide(flat)
        else:  # casts only where needed: a decode step runs this 120 times, and even a no-op cast costs a dispatch
            narrow = flat if flat.dtype == self.kernel_dtype else flat.to(self.kernel_dtype)
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(narrow, self.packed, Q4_GROUP, self.scales_and_zeros)
            out = out if out.dtype == x.dtype else out.to(x.dtype)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)
