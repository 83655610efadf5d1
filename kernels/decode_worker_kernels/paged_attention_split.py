"""Split-KV (flash-decoding) paged decode attention: the sequence is cut into splits so small batches fill the GPU.

The one-pass kernel in :mod:`.paged_attention` runs one program per (request, kv head): at batch 1 with 8 kv heads
that is 8 programs on a 132-SM GPU, each reading the whole context alone. This kernel serves every CUDA decode
batch; where the batch already fills the GPU it runs with one split (stage 2 then only copies the result out). Here stage 1 runs one program per
(request, kv head, split), scoring the split's tokens for all query heads of the GQA group with ``tl.dot`` (the
group padded to 16 rows, the smallest ``tl.dot`` shape) and writing a normalised partial output with its
log-sum-exp; stage 2 merges a request's splits per query head. Same inputs and layout as the one-pass kernel:
K/V are strided ``[num_pages, page_size, kv_heads, head_dim]`` views, addressed in int64.

The grid never depends on ``seq_lens`` (no host sync, so CUDA graphs can capture it): the split count comes from
the page table's width, and each request cuts its own length into that many splits of at least
``min_split_tokens``; programs whose split starts past their request's length do nothing, and stage 2 recomputes
the same cut to know which partials exist.
"""
from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs never call this module (the dispatcher checks for CUDA first)
    triton = None

# Stage 1's tile, picked by compiling for sm_90 as the launch specialises it (unit strides constant, 16-byte aligned
# pointers): head_dim 128 in bf16 takes 64 registers a thread at 32 tokens and 8 warps, so 4 programs share an SM
# (half its warps); 64 tokens take 80 (3 programs). tests/unit/test_split_attention.py checks it; the GPU probe
# times both tiles.
BLOCK_N = 32  # tokens per tl.dot step
NUM_WARPS = 8
NUM_STAGES = 2
MIN_SPLIT_TOKENS = 256  # shorter splits cost more in stage 2 and partial traffic than they add in parallelism
MAX_SPLITS = 64  # bounds the partial buffers and stage 2's loop
WAVES = 2  # target programs per SM: one wave leaves SMs idle behind the slowest split
MIN_DOT_ROWS = 16


def choose_num_splits(
    batch: int, kv_heads: int, max_tokens: int, sm_count: int, min_split_tokens: int = MIN_SPLIT_TOKENS,
) -> int:
    """Splits per (request, kv head): enough programs for ``WAVES`` per SM, no split under ``min_split_tokens``
    of the longest possible request (``max_tokens``, the page table's capacity), at most ``MAX_SPLITS``."""
    to_fill = -(-WAVES * sm_count // max(1, batch * kv_heads))
    by_length = -(-max_tokens // min_split_tokens)
    return max(1, min(to_fill, by_length, MAX_SPLITS))


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (the Triton interpreter runs programs one by one)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


if triton is not None:
    _DOT_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

    @triton.jit
    def _split_len(seq_len, num_splits, MIN_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr):
        """Tokens per split of one request: its length over num_splits, rounded up to whole BLOCK_N steps."""
        per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        return tl.maximum(per_split, MIN_SPLIT)

    @triton.jit
    def _split_stage1_kernel(
        q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, part_ptr, lse_ptr,
        scale_log2, num_splits,
        stride_qb, stride_qh, stride_qd,
        stride_kp, stride_ks, stride_kh, stride_kd,
        stride_vp, stride_vs, stride_vh, stride_vd,
        stride_tb, stride_tp,
        stride_pb, stride_ph, stride_ps, stride_pd, stride_lb, stride_lh, stride_ls,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
        MIN_SPLIT: tl.constexpr, PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """One program per (request, kv head, split): online softmax (base 2, float32) over the split's tokens.

        Writes the split's output already divided by its softmax sum, and ``lse = max + log2(sum)``, so stage 2
        weighs each split by ``2^(lse - max lse)``. ``tl.dot`` operands are cast to DOT_DTYPE: the input dtype on
        a GPU (a no-op), float32 under the interpreter, whose ``tl.dot`` multiplies bf16 bit patterns as integers.
        """
        b = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1).to(tl.int64)
        split = tl.program_id(2)
        seq_len = tl.load(lens_ptr + b)
        split_len = _split_len(seq_len, num_splits, MIN_SPLIT, BLOCK_N)
        split_start = split * split_len
        if split_start < seq_len:
            split_end = tl.minimum(split_start + split_len, seq_len)
            g = tl.arange(0, BLOCK_G)
            d = tl.arange(0, BLOCK_D)
            n = tl.arange(0, BLOCK_N)
            gd_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
            heads = kv_head * GROUP + g
            q_ptrs = q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :] * stride_qd
            q = tl.load(q_ptrs, mask=gd_mask, other=0.0).to(DOT_DTYPE)
            k_base = k_ptr + kv_head * stride_kh + d[None, :] * stride_kd
            v_base = v_ptr + kv_head * stride_vh + d[None, :] * stride_vd

            m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_G], tl.float32)
            acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
            for start in range(split_start, split_end, BLOCK_N):
                pos = start + n
                pos_mask = pos < split_end
                page = tl.load(table_ptr + b * stride_tb + (pos // PAGE_SIZE) * stride_tp, mask=pos_mask, other=0)
                page, slot = page.to(tl.int64), (pos % PAGE_SIZE).to(tl.int64)
                kv_mask = pos_mask[:, None] & (d < HEAD_DIM)[None, :]
                k = tl.load(k_base + page[:, None] * stride_kp + slot[:, None] * stride_ks, mask=kv_mask, other=0.0)
                scores = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=PRECISION) * scale_log2
                scores = tl.where(pos_mask[None, :], scores, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(scores, axis=1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(scores - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                v = tl.load(v_base + page[:, None] * stride_vp + slot[:, None] * stride_vs, mask=kv_mask, other=0.0)
                acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION)
                m_i = m_new

            part_base = part_ptr + b * stride_pb + split * stride_ps
            tl.store(part_base + heads[:, None] * stride_ph + d[None, :] * stride_pd, acc / l_i[:, None], mask=gd_mask)
            lse_ptrs = lse_ptr + b * stride_lb + heads * stride_lh + split * stride_ls
            tl.store(lse_ptrs, m_i + tl.log2(l_i), mask=g < GROUP)

    @triton.jit
    def _split_stage2_kernel(
        part_ptr, lse_ptr, lens_ptr, out_ptr, num_splits,
        stride_pb, stride_ph, stride_ps, stride_pd,
        stride_lb, stride_lh, stride_ls,
        stride_ob, stride_oh, stride_od,
        HEAD_DIM: tl.constexpr, MIN_SPLIT: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """One program per (request, query head): merge the splits stage 1 wrote, by the same cut of the length."""
        b = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        seq_len = tl.load(lens_ptr + b)
        splits_used = tl.cdiv(seq_len, _split_len(seq_len, num_splits, MIN_SPLIT, BLOCK_N))
        d = tl.arange(0, BLOCK_D)
        d_mask = d < HEAD_DIM
        part_base = part_ptr + b * stride_pb + head * stride_ph + d * stride_pd
        lse_base = lse_ptr + b * stride_lb + head * stride_lh

        m = float("-inf")
        total = 0.0
        acc = tl.zeros([BLOCK_D], tl.float32)
        for s in range(splits_used):
            lse = tl.load(lse_base + s * stride_ls)
            part = tl.load(part_base + s * stride_ps, mask=d_mask, other=0.0)
            m_new = tl.maximum(m, lse)
            alpha = tl.exp2(m - m_new)
            weight = tl.exp2(lse - m_new)
            acc = acc * alpha + weight * part
            total = total * alpha + weight
            m = m_new
        total = tl.where(total > 0, total, 1.0)  # a zero-length request has no split: its output is 0, not NaN
        tl.store(out_ptr + b * stride_ob + head * stride_oh + d * stride_od, acc / total, mask=d_mask)


def paged_decode_attention_split(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    min_split_tokens: int = MIN_SPLIT_TOKENS,
    block_n: int = BLOCK_N,
    num_warps: int = NUM_WARPS,
) -> torch.Tensor:
    """Split-KV version of ``paged_decode_attention_reference``; any strides, no host sync.

    ``num_splits`` defaults to :func:`choose_num_splits` for this device; tests pass small ``min_split_tokens``
    and ``block_n`` (a multiple of 16 dividing ``min_split_tokens``) to cut short sequences many ways, and the
    GPU probe times other ``block_n`` / ``num_warps``.
    """
    batch, num_q_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    group = num_q_heads // kv_heads
    if min_split_tokens % block_n or block_n % MIN_DOT_ROWS:
        raise ValueError(f"block_n={block_n} must be a multiple of 16 dividing min_split_tokens={min_split_tokens}")
    if num_splits is None:
        num_splits = choose_num_splits(batch, kv_heads, page_table.shape[1] * page_size, sm_count(q.device),
                                       min_split_tokens)
    page_table = page_table.to(q.device)
    seq_lens = seq_lens.to(q.device).contiguous()
    partial = torch.empty(batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    block_d = triton.next_power_of_2(head_dim)
    _split_stage1_kernel[(batch, kv_heads, num_splits)](
        q, k_pages, v_pages, page_table, seq_lens, partial, lse,
        scale * 1.4426950408889634, num_splits,  # scale times log2(e): the kernel works in base 2
        *q.stride(), *k_pages.stride(), *v_pages.stride(), *page_table.stride(), *partial.stride(), *lse.stride(),
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        MIN_SPLIT=min_split_tokens, PRECISION="ieee" if q.dtype == torch.float32 else None,
        DOT_DTYPE=_DOT_DTYPES[q.dtype] if q.is_cuda else tl.float32,
        BLOCK_G=max(MIN_DOT_ROWS, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=block_n,
        num_warps=num_warps, num_stages=NUM_STAGES,
    )
    _split_stage2_kernel[(batch, num_q_heads)](
        partial, lse, seq_lens, out, num_splits,
        *partial.stride(), *lse.stride(), *out.stride(),
        HEAD_DIM=head_dim, MIN_SPLIT=min_split_tokens, BLOCK_D=block_d, BLOCK_N=block_n,
    )
    return out
