"""Paged attention over the KV pool; a step's indices are planned once (``StepPlan``), not per layer."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from decode_worker_kernels.kv_write import slot_index, slot_rows, write_kv
from decode_worker_kernels.paged_attention import paged_decode_attention

from decode_worker.cache.pool import KVPool
from decode_worker.model.forward_batch import ForwardBatch
from decode_worker.model.layers import AttentionProjections, RopeTables
from decode_worker.model.native import native_kernels
from decode_worker_kernels import cpu_attention, cpu_native, cpu_rope

NATIVE_EXTEND_MAX_TOKENS = 256
"""CPU extends whose requests are all this short run the native decode kernel with one query per new token (each over
its request's slots up to itself): no per-request SDPA and mask. Its work grows with tokens times length without
SDPA's reuse, so longer prompts keep SDPA (a 128-token prefill ran 4% faster native, 384 tokens 7% slower)."""


@dataclass
class StepPlan:
    """One step's indices, shared by every layer."""

    write_rows: torch.Tensor
    context_rows: torch.Tensor | None = None
    pages: torch.Tensor | None = None
    mask: torch.Tensor | None = None  # CPU decode: 0 where a slot is visible, -inf past each row's length
    native: ctypes.CDLL | None = None  # CPU: the native kernels, where they built and take the pool's dtype
    token_table: torch.Tensor | None = None  # CPU extend, native: each new token's request's page-table row
    token_lens: torch.Tensor | None = None  # and the slots it sees: its own and those before it


def plan_step(pool: KVPool, fb: ForwardBatch, q_heads: int) -> StepPlan:
    k_pages = pool.k_pages(0)
    _, rows_per_page = slot_rows(k_pages)
    plan = StepPlan(slot_index(fb.out_slots, pool.page_size, rows_per_page))
    if k_pages.device.type == "cpu" and k_pages.dtype in cpu_native.DTYPES:
        plan.native = native_kernels()
    native_attention = plan.native is not None and cpu_attention.supports(q_heads, *k_pages.shape[2:])
    if not fb.is_decode and native_attention and max(fb.host_seq_lens) <= NATIVE_EXTEND_MAX_TOKENS:
        new = [n - p for n, p in zip(fb.host_seq_lens, fb.prefix_lens)]
        plan.token_table = fb.page_table[torch.repeat_interleave(torch.arange(len(new)), torch.tensor(new))]
        plan.token_lens = fb.positions + 1
    elif not fb.is_decode:
        plan.context_rows = slot_index(fb.context_slots, pool.page_size, rows_per_page)
    elif not fb.seq_lens.is_cuda and not native_attention:
        _plan_gather(plan, pool, fb)
    return plan


def _plan_gather(plan: StepPlan, pool: KVPool, fb: ForwardBatch) -> None:
    """CPU decode without the native kernels: the pages every layer gathers and the mask over them."""
    num_pages = min(fb.page_table.shape[1], -(-int(fb.seq_lens.max()) // pool.page_size))
    plan.pages = fb.page_table[:, :num_pages].reshape(-1)
    slots = torch.arange(num_pages * pool.page_size, device=fb.seq_lens.device)
    hidden = (slots >= fb.seq_lens[:, None])[:, None, None, :]
    # Additive, in the pool's dtype: SDPA would turn a boolean mask into this in every layer.
    plan.mask = torch.zeros(hidden.shape, dtype=pool.k_pages(0).dtype).masked_fill_(hidden, float("-inf"))


def project_and_store(pool: KVPool, layer: int, fb: ForwardBatch, plan: StepPlan, attn: AttentionProjections,
                      x: torch.Tensor, rope: RopeTables) -> torch.Tensor:
    """The layer's rotated queries ``[T, Hq, D]``; its new K (rotated) and V stored in the pool."""
    if plan.native is not None:
        qkv = attn.qkv_proj(x)
        if cpu_rope.fits(qkv, pool.k_pages(layer), attn.num_heads):
            return cpu_rope.rope_store_cpu(plan.native, qkv, rope.cos, rope.sin, attn.num_heads, pool.k_pages(layer),
                                           pool.v_pages(layer), fb.out_slots)
        q, k, v = attn.split_rotate(qkv, rope)
    else:
        q, k, v = attn.qkv(x, rope)
    store_kv(pool, layer, fb, plan, k, v)
    return q


def store_kv(pool: KVPool, layer: int, fb: ForwardBatch, plan: StepPlan, k: torch.Tensor, v: torch.Tensor) -> None:
    k_pages, v_pages = pool.k_pages(layer), pool.v_pages(layer)
    if k_pages.is_cuda:
        write_kv(k_pages, v_pages, fb.out_slots, k, v)
    else:
        slot_rows(k_pages)[0].index_copy_(0, plan.write_rows, k if k.dtype == k_pages.dtype else k.to(k_pages.dtype))
        slot_rows(v_pages)[0].index_copy_(0, plan.write_rows, v if v.dtype == v_pages.dtype else v.to(v_pages.dtype))


def attend(pool: KVPool, layer: int, fb: ForwardBatch, plan: StepPlan, q: torch.Tensor, scale: float) -> torch.Tensor:
    """Queries ``[T, Hq, D]`` attend over each request's KV in the pool."""
    if plan.token_table is not None:  # CPU extend: each new token a query over its request's slots up to itself
        return cpu_attention.paged_decode_attention_cpu(plan.native, q, pool.k_pages(layer), pool.v_pages(layer),
                                                        plan.token_table, plan.token_lens, scale)
    if not fb.is_decode:
        return _extend_attention(pool, layer, fb, plan, q, scale)
    if plan.pages is not None:
        return _planned_decode_attention(pool, layer, plan, q, scale)
    if plan.native is not None:
        return cpu_attention.paged_decode_attention_cpu(plan.native, q, pool.k_pages(layer), pool.v_pages(layer),
                                                        fb.page_table, fb.seq_lens, scale)
    return paged_decode_attention(q, pool.k_pages(layer), pool.v_pages(layer), fb.page_table, fb.seq_lens, scale)


def _planned_decode_attention(pool: KVPool, layer: int, plan: StepPlan, q: torch.Tensor, scale: float) -> torch.Tensor:
    """CPU decode: pages gathered, one masked SDPA per GQA group."""
    batch, num_q_heads, head_dim = q.shape
    k_pages, v_pages = pool.k_pages(layer), pool.v_pages(layer)
    kv_heads = k_pages.shape[2]
    length = plan.mask.shape[-1]
    k = k_pages.index_select(0, plan.pages).view(batch, length, kv_heads, head_dim).transpose(1, 2)
    v = v_pages.index_select(0, plan.pages).view(batch, length, kv_heads, head_dim).transpose(1, 2)
    queries = q.reshape(batch, kv_heads, num_q_heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(queries, k, v, attn_mask=plan.mask, scale=scale)
    return out.reshape(batch, num_q_heads, head_dim)


def _extend_attention(pool: KVPool, layer: int, fb: ForwardBatch, plan: StepPlan, q: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Each request's new tokens over its prefix and themselves."""
    k_ctx = slot_rows(pool.k_pages(layer))[0].index_select(0, plan.context_rows)  # [sum seq_lens, Hkv, D]
    v_ctx = slot_rows(pool.v_pages(layer))[0].index_select(0, plan.context_rows)
    out = torch.empty_like(q)
    start = ctx_start = 0
    for prefix, seq_len in zip(fb.prefix_lens, fb.host_seq_lens):
        n_new = seq_len - prefix
        k = k_ctx[ctx_start: ctx_start + seq_len].transpose(0, 1).unsqueeze(0)  # [1, Hkv, S, D]
        v = v_ctx[ctx_start: ctx_start + seq_len].transpose(0, 1).unsqueeze(0)
        qb = q[start: start + n_new].transpose(0, 1).unsqueeze(0)  # [1, Hq, E, D]
        if prefix == 0:
            o = F.scaled_dot_product_attention(qb, k, v, is_causal=True, scale=scale, enable_gqa=True)
        elif q.is_cuda:
            o = prefix_attention_fused(qb, k, v, scale)
        else:
            q_pos = torch.arange(prefix, seq_len, device=q.device)[:, None]
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos
            o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start: start + n_new] = o[0].transpose(0, 1)
        start += n_new
        ctx_start += seq_len
    return out


def prefix_attention_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """``q`` over a cached prefix plus itself, on CUDA's fused SDPA."""
    from torch.nn.attention.bias import causal_lower_right  # imports torch._dynamo: only a GPU worker pays for it
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]), scale=scale)
