"""Rotary embedding and KV store for CPU (``cpu_rope.c``, built by ``cpu_native``): one pass over a layer's fused
QKV projection rotates the queries and writes the rotated keys and the values straight into their pool slots, where
torch takes about ten ops (split, casts, roll, products, two index copies)."""
from __future__ import annotations

import ctypes

import torch
from decode_worker_kernels.cpu_native import DTYPES


def fits(qkv: torch.Tensor, k_pages: torch.Tensor, q_heads: int) -> bool:
    """Whether the kernel takes this projection and pool: float32 or bf16 on the CPU, contiguous rows, head_dim a
    multiple of 32, dense token rows within a page."""
    _, _, kv_heads, head_dim = k_pages.shape
    return (qkv.device.type == "cpu" and k_pages.device.type == "cpu" and qkv.dtype in DTYPES
            and k_pages.dtype in DTYPES and qkv.dim() == 2 and qkv.is_contiguous()
            and qkv.shape[1] == (q_heads + 2 * kv_heads) * head_dim and head_dim % 32 == 0
            and k_pages.stride()[1:] == (kv_heads * head_dim, head_dim, 1))


def rope_store_cpu(lib: ctypes.CDLL, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_heads: int,
                   k_pages: torch.Tensor, v_pages: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rotated queries ``[T, q_heads, D]`` in ``qkv``'s dtype; token ``t``'s rotated K and its V written to slot
    ``slots[t]`` of ``k_pages``/``v_pages``. ``cos``/``sin``: full-width float32 tables ``[T, ..., D]``
    (``layers.RopeTables``). ValueError for what it does not take or a slot outside the pool."""
    tokens = qkv.shape[0]
    num_pages, page_size, kv_heads, head_dim = k_pages.shape
    if not fits(qkv, k_pages, q_heads) or v_pages.shape != k_pages.shape or v_pages.stride() != k_pages.stride() \
            or v_pages.dtype != k_pages.dtype:
        raise ValueError(f"CPU rope and store does not take qkv {qkv.dtype} {tuple(qkv.shape)} over K/V "
                         f"{k_pages.dtype} {tuple(k_pages.shape)}")
    cos, sin = (t.reshape(tokens, head_dim) for t in (cos, sin))
    if cos.dtype != torch.float32 or sin.dtype != torch.float32 or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("CPU rope takes contiguous float32 tables")
    slots = slots if slots.dtype == torch.int64 and slots.is_contiguous() else slots.to(torch.int64).contiguous()
    if slots.shape != (tokens,):
        raise ValueError(f"{tokens} tokens need {tokens} slots, got {tuple(slots.shape)}")
    q = torch.empty(tokens, q_heads, head_dim, dtype=qkv.dtype)
    flags = (qkv.dtype == torch.bfloat16) | (k_pages.dtype == torch.bfloat16) << 1
    status = lib.rope_store(qkv.data_ptr(), tokens, q_heads, kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(),
                            q.data_ptr(), k_pages.data_ptr(), v_pages.data_ptr(), k_pages.stride(0),
                            v_pages.stride(0), num_pages, page_size, slots.data_ptr(), flags)
    if status != 0:
        raise ValueError(f"a KV slot outside the pool's {num_pages} pages of {page_size}")
    return q
