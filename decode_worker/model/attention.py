"""Paged attention over the KV pool: batched decode through the page table, extend per request."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from decode_worker_kernels.kv_write import slot_index, slot_rows, write_kv
from decode_worker_kernels.paged_attention import paged_decode_attention
from torch.nn.attention.bias import causal_lower_right

from decode_worker.cache.pool import KVPool
from decode_worker.model.forward_batch import ForwardBatch


def store_kv(pool: KVPool, layer: int, fb: ForwardBatch, k: torch.Tensor, v: torch.Tensor) -> None:
    write_kv(pool.k_pages(layer), pool.v_pages(layer), fb.out_slots, k, v)


def attend(pool: KVPool, layer: int, fb: ForwardBatch, q: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of the step's queries ``[T, Hq, D]`` over everything in the pool for each request."""
    if fb.is_decode:
        return paged_decode_attention(q, pool.k_pages(layer), pool.v_pages(layer), fb.page_table, fb.seq_lens, scale)
    return _extend_attention(pool, layer, fb, q, scale)


def _extend_attention(pool: KVPool, layer: int, fb: ForwardBatch, q: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of each request's new tokens over its cached prefix plus themselves.

    One gather per layer brings every request's K/V together (``fb.context_slots``, turned into rows of the
    layer's page view); the loop over requests then only slices, with lengths the host already knows, so no step
    waits for the device."""
    k_rows, rows_per_page = slot_rows(pool.k_pages(layer))
    v_rows, _ = slot_rows(pool.v_pages(layer))
    rows = slot_index(fb.context_slots, pool.page_size, rows_per_page)
    k_ctx = k_rows.index_select(0, rows)  # [sum seq_lens, Hkv, D]
    v_ctx = v_rows.index_select(0, rows)
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
    """New tokens ``q`` ``[1, Hq, E, D]`` over a cached prefix plus themselves, ``k``/``v`` ``[1, Hkv, S, D]``: the
    causal mask aligned to the bottom right (query ``i`` sees keys up to ``S - E + i``) as a ``CausalBias``, which
    CUDA's SDPA runs in its flash or memory-efficient kernel; a boolean mask would send it to the math kernel, which
    materialises ``[Hq, E, S]`` scores. K/V are repeated per query head: those kernels take no GQA."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]), scale=scale)

