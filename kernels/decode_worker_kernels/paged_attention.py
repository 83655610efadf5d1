"""Decode attention over a paged KV cache: one new query token per request, K/V read through a page table.

``k_pages``/``v_pages`` are one layer of the pool, ``[num_pages, page_size, kv_heads, head_dim]``; token ``t`` of
request ``b`` lives at ``page_table[b, t // page_size]``, offset ``t % page_size``. Query head ``h`` reads kv head
``h // (num_q_heads // kv_heads)`` (GQA). Softmax runs in float32; ``seq_lens`` counts the new token.
Slots past a request's length are masked, not skipped, by the reference: they must hold finite values (pool
memory only ever holds zeros or model K/V, so it does). A request of length 0 gets zeros (no NaN) from every
version.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference serves every call
    triton = None

from .paged_attention_split import paged_decode_attention_split

_BLOCK_N = 32  # tokens per online-softmax step of the Triton kernel


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Gather each request's pages into ``[B, kv_heads, L, D]`` and run one masked SDPA for the whole batch.

    The CPU decode path calls this every layer every step, so it stays vectorised: ``index_select`` gathers
    (several times faster than advanced indexing), q is viewed as ``[B, kv_heads, group, D]`` so K/V are never
    repeated per query head, and the gathered K/V go to SDPA as strided views without a copy.
    """
    batch, num_q_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    group = num_q_heads // kv_heads
    if seq_lens.is_cuda:  # no host sync, so the call stays capturable in a CUDA graph
        num_pages = page_table.shape[1]
    else:
        num_pages = min(page_table.shape[1], -(-int(seq_lens.max()) // page_size))
    pages = page_table[:, :num_pages].reshape(-1).to(torch.int64)
    length = num_pages * page_size
    k = k_pages.index_select(0, pages).view(batch, length, kv_heads, head_dim).transpose(1, 2)
    v = v_pages.index_select(0, pages).view(batch, length, kv_heads, head_dim).transpose(1, 2)
    visible = torch.arange(length, device=q.device) < seq_lens.to(q.device)[:, None]
    out = F.scaled_dot_product_attention(
        q.reshape(batch, kv_heads, group, head_dim), k, v, attn_mask=visible[:, None, None, :], scale=scale
    )
    return out.reshape(batch, num_q_heads, head_dim)


if triton is not None:

    @triton.jit
    def _paged_decode_kernel(
        q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr,
        scale,
        stride_qb, stride_qh, stride_qd,
        stride_kp, stride_ks, stride_kh, stride_kd,
        stride_vp, stride_vs, stride_vh, stride_vd,
        stride_tb, stride_tp,
        stride_ob, stride_oh, stride_od,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """One program per (request, kv head): every query head of the group shares each K/V load.

        Online softmax over BLOCK_N-token chunks; reductions are plain ``tl.sum`` so the kernel also runs
        (and is tested) under TRITON_INTERPRET=1.
        """
        b = tl.program_id(0)
        kv_head = tl.program_id(1)
        seq_len = tl.load(lens_ptr + b)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        n = tl.arange(0, BLOCK_N)
        g_mask = g < GROUP
        d_mask = d < HEAD_DIM
        heads = kv_head * GROUP + g

        q_ptrs = q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :] * stride_qd
        q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32) * scale

        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for start in range(0, seq_len, BLOCK_N):
            pos = start + n
            pos_mask = pos < seq_len
            page = tl.load(table_ptr + b * stride_tb + (pos // PAGE_SIZE) * stride_tp, mask=pos_mask, other=0)
            page = page.to(tl.int64)
            offset = pos % PAGE_SIZE
            kv_mask = pos_mask[:, None] & d_mask[None, :]
            k_ptrs = k_ptr + page[:, None] * stride_kp + offset[:, None] * stride_ks + kv_head * stride_kh + d[None, :] * stride_kd
            v_ptrs = v_ptr + page[:, None] * stride_vp + offset[:, None] * stride_vs + kv_head * stride_vh + d[None, :] * stride_vd
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(tl.float32)
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0).to(tl.float32)

            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
            scores = tl.where(pos_mask[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new

        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a zero-length request attends to nothing: 0, not NaN
        out_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :] * stride_od
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Triton version of :func:`paged_decode_attention_reference`; any strides, no host sync."""
    batch, num_q_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    group = num_q_heads // kv_heads
    page_table = page_table.to(q.device)
    seq_lens = seq_lens.to(q.device).contiguous()
    out = torch.empty_like(q)
    _paged_decode_kernel[(batch, kv_heads)](
        q, k_pages, v_pages, page_table, seq_lens, out,
        scale,
        *q.stride(), *k_pages.stride(), *v_pages.stride(), *page_table.stride(), *out.stride(),
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_G=triton.next_power_of_2(group), BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_N=_BLOCK_N,
    )
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``[B, num_q_heads, head_dim]`` attention output: on CUDA (with Triton) the split-KV kernel for every batch,
    cut into one split where the batch already fills the GPU; elsewhere the torch reference.

    The one-pass Triton kernel above stays as the baseline the tests and the GPU probe compare against: at head_dim
    128 and GQA group 7-8 it needs the whole register file and spills, where the split kernel's ``tl.dot`` does not.
    """
    if triton is not None and q.is_cuda:
        return paged_decode_attention_split(q, k_pages, v_pages, page_table, seq_lens, scale)
    return paged_decode_attention_reference(q, k_pages, v_pages, page_table, seq_lens, scale)
