"""Paged decode attention for CPU (``cpu_attention.c``, built by ``cpu_native``): each request's query reads its K/V
from the pool's pages through its page-table row, with no gathered copy and no mask, in float32 math. The torch
reference (``paged_attention.paged_decode_attention_reference``) gathers the pages and runs a masked SDPA; this
gives the same result up to float32 rounding in a fraction of the time."""
from __future__ import annotations

import ctypes

import torch
from decode_worker_kernels.cpu_native import DTYPES


def supports(q_heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel takes this head shape (head_dim a multiple of 16 up to 256, up to 16 queries per kv head)."""
    return q_heads % kv_heads == 0 and q_heads // kv_heads <= 16 and head_dim % 16 == 0 and head_dim <= 256


def paged_decode_attention_cpu(lib: ctypes.CDLL, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                               page_table: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """``q`` ``[B, q_heads, D]`` over ``k_pages``/``v_pages`` ``[P, page_size, kv_heads, D]`` (pages may be strided
    apart; a page itself is contiguous); int64 ``page_table`` ``[B, >= pages]`` and ``seq_lens`` ``[B]``. Output in
    ``q``'s dtype. ValueError for what the kernel does not take or a page index or length out of range."""
    batch, q_heads, head_dim = q.shape
    num_pages, page_size, kv_heads, _ = k_pages.shape
    if q.dtype not in DTYPES or k_pages.dtype not in DTYPES or v_pages.dtype != k_pages.dtype:
        raise ValueError(f"CPU paged attention takes float32 or bf16, got q {q.dtype}, K/V {k_pages.dtype}/{v_pages.dtype}")
    if not supports(q_heads, kv_heads, head_dim) or v_pages.shape != k_pages.shape or k_pages.shape[3] != head_dim:
        raise ValueError(f"CPU paged attention does not take q {tuple(q.shape)} over K/V {tuple(k_pages.shape)}")
    for pages in (k_pages, v_pages):
        if pages.device.type != "cpu" or pages.stride()[1:] != (kv_heads * head_dim, head_dim, 1):
            raise ValueError("CPU paged attention needs each page contiguous on the CPU")
    table, lens = _int64(page_table), _int64(seq_lens)
    if table.dim() != 2 or table.shape[0] != batch or lens.shape != (batch,):
        raise ValueError(f"page table {tuple(table.shape)} and lengths {tuple(lens.shape)} do not match batch {batch}")
    q = q.contiguous()
    out = torch.empty_like(q)
    flags = (q.dtype == torch.bfloat16) | (k_pages.dtype == torch.bfloat16) << 1 | (out.dtype == torch.bfloat16) << 2
    status = lib.paged_decode_attention(
        q.data_ptr(), k_pages.data_ptr(), v_pages.data_ptr(), k_pages.stride(0), v_pages.stride(0), num_pages,
        page_size, table.data_ptr(), table.stride(0), table.shape[1], lens.data_ptr(), batch, q_heads, kv_heads,
        head_dim, scale, out.data_ptr(), flags)
    if status == -1:
        raise ValueError(f"a page index outside the pool's {num_pages} pages or a length outside the page table")
    if status != 0:
        raise ValueError(f"CPU paged attention refused q {tuple(q.shape)} over K/V {tuple(k_pages.shape)}")
    return out


def _int64(t: torch.Tensor) -> torch.Tensor:
    t = t if t.dtype == torch.int64 else t.to(torch.int64)
    return t if t.stride(-1) == 1 else t.contiguous()
