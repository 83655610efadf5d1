"""GGUF tensor bytes to float32, whole tensor at once, bit-exact with ``gguf.quants.dequantize``.

The gguf package works through a tensor sixteen rows at a time in Python; the types our GGUFs hold are
decoded here in a few whole-array numpy passes doing the same float32 operations in the same order.
Any other type falls back to the package.
"""
from __future__ import annotations

from typing import Any

import numpy as np

Q4_1_BYTES = 20  # per 32-value block: fp16 d, fp16 m, 16 bytes of nibbles (low nibbles first)
Q8_0_BYTES = 34  # per 32-value block: fp16 d, 32 int8 values


def dequantize(data: np.ndarray, kind: Any) -> np.ndarray:
    """A new writable float32 array of ``data``'s values (``kind`` a ``gguf.GGMLQuantizationType``), shaped
    ``(*data.shape[:-1], values per row)``; the gguf package is imported only for a type not decoded here."""
    if kind.name in ("F32", "F16"):
        return data.astype(np.float32)
    if kind.name == "Q4_1":
        return _q4_1(data)
    if kind.name == "Q8_0":
        return _q8_0(data)
    from gguf.quants import dequantize as package_dequantize

    return np.array(package_dequantize(data, kind), dtype=np.float32)


def block_half(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte ``start`` of every block (blocks on the last axis), as float32, one per block."""
    return blocks[..., start:start + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _q4_1(data: np.ndarray) -> np.ndarray:
    """``d * q + m`` per block (rounded after the product, as the package does)."""
    blocks = data.reshape(-1, Q4_1_BYTES)
    nibbles = blocks[:, 4:]
    out = np.empty((blocks.shape[0], 32), dtype=np.float32)
    np.bitwise_and(nibbles, 0x0F, out=out[:, :16], casting="unsafe")
    np.right_shift(nibbles, 4, out=out[:, 16:], casting="unsafe")
    out *= block_half(blocks, 0)[:, None]
    out += block_half(blocks, 2)[:, None]
    return out.reshape(*data.shape[:-1], -1)


def _q8_0(data: np.ndarray) -> np.ndarray:
    """``q * d`` per block."""
    blocks = data.reshape(-1, Q8_0_BYTES)
    out = blocks[:, 2:].view(np.int8).astype(np.float32)
    out *= block_half(blocks, 0)[:, None]
    return out.reshape(*data.shape[:-1], -1)
