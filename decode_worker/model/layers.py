"""Llama-family blocks: RMSNorm, rotary embedding, attention projections, MLP."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from decode_worker.model.config import ModelConfig
from decode_worker.model.native import native_kernels
from decode_worker_kernels import cpu_activation, cpu_norm


class RMSNorm(nn.Module):
    """RMS normalisation, computed in at least float32, out in the weight's dtype. Given a layer's output ``delta``,
    the input is the residual stream and takes ``delta`` in place first. On CPU the native kernel does both in one
    pass (it takes the float64 stream the CPU model keeps); without it, ``F.rms_norm`` is faster for decode's few
    rows and far slower for a prefill's many (bf16 at 1,000 rows: ~5x); both give the same bits."""

    F_BELOW_ROWS = 128  # CPU rows below which ``F.rms_norm`` runs

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        if cpu_norm.fits(x, delta, self.weight) and (lib := native_kernels()) is not None:
            return cpu_norm.rms_norm_cpu(lib, x, delta, self.weight, self.eps)
        if delta is not None:
            x.add_(delta)
        if x.device.type == "cpu" and x.dtype == self.weight.dtype and x.numel() < self.F_BELOW_ROWS * x.shape[-1]:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        wide = x if x.dtype == torch.float32 else x.to(torch.promote_types(x.dtype, torch.float32))
        weight = self.weight if self.weight.dtype == wide.dtype else self.weight.to(wide.dtype)
        out = wide * wide.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_() * weight
        return out if out.dtype == self.weight.dtype else out.to(self.weight.dtype)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama-3 frequency scaling."""
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_ctx / low, inv_freq / factor, smoothed)
    return torch.where(wavelen < old_ctx / high, inv_freq, out)


class RotaryEmbedding(nn.Module):
    """cos/sin tables by position (rotate-half convention)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "freq_factors":
            inv_freq = inv_freq / torch.tensor(scaling["factors"], dtype=torch.float64)
        elif rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type not in (None, "default"):
            raise ValueError(f"unsupported rope_scaling type {rope_type!r}")
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        # Plain attributes, not buffers: the tables stay float32 when the weights are cast to bf16.
        self.cos = freqs.cos().float()
        self.sin = freqs.sin().float()

    def tables(self, positions: torch.Tensor) -> RopeTables:
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [T, 1, D/2]
        return RopeTables(torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1))

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rope = self.tables(positions)
        return rope.rotate(q), rope.rotate(k)


@dataclass
class RopeTables:
    """A step's rotary rows, full width: ``cos`` is ``[cos, cos]`` and ``sin`` is ``[-sin, sin]`` (``[T, 1, D]``), so
    the rotate-half rotation ``[x1 cos - x2 sin, x2 cos + x1 sin]`` is two products of ``x`` and of ``x`` rolled by
    half, in as few ops as a layer can run (the same bits as the halves computed apart)."""

    cos: torch.Tensor
    sin: torch.Tensor

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, heads, D]`` rotated in at least float32."""
        wide = x if x.dtype == torch.float32 else x.to(torch.promote_types(x.dtype, torch.float32))
        out = wide * self.cos
        out += wide.roll(x.shape[-1] // 2, dims=-1) * self.sin
        return out if out.dtype == x.dtype else out.to(x.dtype)


class MLP(nn.Module):
    """SwiGLU, gate and up in one matmul; on CPU the activation is one native pass where the kernels built."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if cpu_activation.fits(gate_up) and (lib := native_kernels()) is not None:
            return self.down_proj(cpu_activation.silu_mul_cpu(lib, gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class AttentionProjections(nn.Module):
    """Fused QKV projection, RoPE and output projection."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, rope: RopeTables) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[T, Hq, D]``, k and v ``[T, Hkv, D]``, q and k rotated."""
        return self.split_rotate(self.qkv_proj(x), rope)

    def split_rotate(self, qkv: torch.Tensor, rope: RopeTables) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused projection's output split into heads, q and k rotated."""
        qk, v = qkv.split((self.split[0] + self.split[1], self.split[2]), dim=-1)
        qk = rope.rotate(qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim))
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        return q, k, v.view(-1, self.num_kv_heads, self.head_dim)
