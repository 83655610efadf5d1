"""Low-bit weight matmuls for CPU (``cpu_lowbit.c``, built by ``cpu_native``): Q4_1 and Q8_0 blocks stay low-bit in
memory and are dequantized exactly, in float32, inside the matmul. torch's own int4 kernel rounds activations and
scales to bf16 on x86 and has no 8-bit block form; this one keeps float32's numbers, so even the float32 reference
path can read a quarter of its weight bytes.
"""
from __future__ import annotations

import ctypes

import torch
from decode_worker_kernels.cpu_native import DTYPES

LANES = 16  # outputs per weight tile
BLOCK = 32  # values per Q4_1 / Q8_0 block


def tileable(rows: int, cols: int) -> bool:
    """Whether a ``[rows, cols]`` weight fits the kernels' tiles."""
    return rows % LANES == 0 and cols % BLOCK == 0


def _tiles(per_row: torch.Tensor) -> torch.Tensor:
    """``[N, ...]`` into ``[N / 16, ..., 16]``: the tile's 16 outputs innermost."""
    n = per_row.shape[0]
    return per_row.reshape(n // LANES, LANES, *per_row.shape[1:]).movedim(1, -1).contiguous()


class LowBitMatmul:
    """``x @ W.T`` over a Q4_1 or Q8_0 ``W``; ``x`` float32 or bf16 with rows contiguous; the output in ``out_dtype``
    (default: ``x``'s)."""

    def __init__(self, lib: ctypes.CDLL, kind: str, codes: torch.Tensor, tables: torch.Tensor, shape: tuple[int, int],
                 out_dtype: torch.dtype | None):
        self.kind = kind
        self.kernel = lib.q4_1_matmul if kind == "q4_1" else lib.q8_0_matmul
        self.codes, self.tables = codes, tables
        self.out_features, self.in_features = shape
        self.out_dtype = out_dtype

    @classmethod
    def q4_1(cls, lib: ctypes.CDLL, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
             out_dtype: torch.dtype | None = None) -> "LowBitMatmul":
        """``codes``: uint8 ``[N, K]`` of 0..15; ``scale``, ``minimum``: ``[N, K / 32]``; ``W = scale * codes + minimum``."""
        n, k = codes.shape
        if not tileable(n, k):
            raise ValueError(f"a Q4_1 weight of shape {(n, k)} does not tile")
        pairs = codes.reshape(n, k // 2, 2)
        packed = _tiles((pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8))
        tables = _tiles(torch.stack((scale, minimum), dim=2).float())  # [N/16, K/32, 2, 16]
        return cls(lib, "q4_1", packed, tables, (n, k), out_dtype)

    @classmethod
    def q8_0(cls, lib: ctypes.CDLL, codes: torch.Tensor, scale: torch.Tensor,
             out_dtype: torch.dtype | None = None) -> "LowBitMatmul":
        """``codes``: int8 ``[N, K]``; ``scale``: ``[N, K / 32]``; ``W = scale * codes``."""
        n, k = codes.shape
        if not tileable(n, k):
            raise ValueError(f"a Q8_0 weight of shape {(n, k)} does not tile")
        return cls(lib, "q8_0", _tiles(codes.to(torch.int8)), _tiles(scale.float()), (n, k), out_dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in DTYPES or x.shape[-1] != self.in_features:
            raise ValueError(f"low-bit matmul takes float32 or bf16 [..., {self.in_features}], got {x.dtype} "
                             f"{tuple(x.shape)}")
        flat = x.reshape(-1, self.in_features)
        flat = flat if flat.is_contiguous() else flat.contiguous()
        out_dtype = self.out_dtype or x.dtype
        out = torch.empty(flat.shape[0], self.out_features, dtype=out_dtype)
        if flat.shape[0]:
            status = self.kernel(flat.data_ptr(), flat.dtype == torch.bfloat16, flat.shape[0], self.in_features,
                                 self.codes.data_ptr(), self.tables.data_ptr(), self.out_features, out.data_ptr(),
                                 out_dtype == torch.bfloat16)
            if status != 0:
                raise MemoryError("low-bit matmul could not convert its bf16 input")
        return out.view(*x.shape[:-1], self.out_features)
