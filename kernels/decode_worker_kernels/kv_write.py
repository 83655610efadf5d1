"""Store the K/V of newly computed tokens into one layer of the paged pool.

``k_pages``/``v_pages`` are the page views ``[num_pages, page_size, kv_heads, head_dim]`` of
``KVPool.k_pages(layer)``/``v_pages(layer)``: strided, since in the page-major pool a page's stride spans every
layer. ``slots[i]`` (``page * page_size + offset``) receives row ``i``. ``k``/``v`` may be strided views (e.g.
slices of a fused QKV projection) and are cast to the pool dtype.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference serves every call
    triton = None


def slot_rows(pages: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A page view as token rows ``[rows, kv_heads, head_dim]`` plus ``rows_per_page``: slot ``page * page_size +
    offset`` is row ``page * rows_per_page + offset`` (see ``slot_index``). The rows between two pages belong to
    other layers and are never indexed; one flat index op then reaches any token, which on CPU is several times
    faster than indexing pages and offsets separately."""
    num_pages, page_size, kv_heads, head_dim = pages.shape
    page_stride, row_stride = pages.stride(0), pages.stride(1)
    if pages.stride()[1:] != (kv_heads * head_dim, head_dim, 1) or page_stride % row_stride:
        raise ValueError(f"a KV page view needs dense token rows, got strides {pages.stride()}")
    rows_per_page = page_stride // row_stride
    num_rows = (num_pages - 1) * rows_per_page + page_size if num_pages else 0
    rows = pages.as_strided((num_rows, kv_heads, head_dim), pages.stride()[1:], pages.storage_offset())
    return rows, rows_per_page


def slot_index(slots: torch.Tensor, page_size: int, rows_per_page: int) -> torch.Tensor:
    """Rows of ``slot_rows`` holding ``slots`` (int64, on ``slots``' device); the same for every layer, K and V."""
    slots = slots.to(torch.int64)
    if rows_per_page == page_size:
        return slots
    return torch.add(slots, slots // page_size, alpha=rows_per_page - page_size)  # two ops: this runs every layer


def write_kv_reference(
    k_pages: torch.Tensor, v_pages: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """k_pages[slot // page_size, slot % page_size] = k (and V alike); slots are distinct."""
    k_rows, rows_per_page = slot_rows(k_pages)
    v_rows, _ = slot_rows(v_pages)
    index = slot_index(slots.to(k_pages.device), k_pages.shape[1], rows_per_page)
    k_rows.index_copy_(0, index, k.to(k_pages.dtype))
    v_rows.index_copy_(0, index, v.to(v_pages.dtype))


if triton is not None:

    @triton.jit
    def _write_kv_kernel(
        k_pages_ptr, v_pages_ptr, slots_ptr, k_ptr, v_ptr,
        stride_kp, stride_ks, stride_kh, stride_kd,
        stride_vp, stride_vs, stride_vh, stride_vd,
        stride_kn, stride_kin_h, stride_kin_d,
        stride_vn, stride_vin_h, stride_vin_d,
        PAGE_SIZE: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """One program per token: copy its ``[kv_heads, head_dim]`` K and V rows into their page and offset.
        Offsets are int64: ``page * stride_page`` passes 2^31 in a pool of a few GB."""
        i = tl.program_id(0)
        slot = tl.load(slots_ptr + i).to(tl.int64)
        page = slot // PAGE_SIZE
        offset = slot % PAGE_SIZE
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < KV_HEADS) & (d < HEAD_DIM)
        k = tl.load(k_ptr + i * stride_kn + h * stride_kin_h + d * stride_kin_d, mask=mask)
        v = tl.load(v_ptr + i * stride_vn + h * stride_vin_h + d * stride_vin_d, mask=mask)
        k_dst = k_pages_ptr + page * stride_kp + offset * stride_ks + h * stride_kh + d * stride_kd
        v_dst = v_pages_ptr + page * stride_vp + offset * stride_vs + h * stride_vh + d * stride_vd
        tl.store(k_dst, k.to(k_pages_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, v.to(v_pages_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    k_pages: torch.Tensor, v_pages: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Triton version of :func:`write_kv_reference`; one launch for K and V, any pool strides, no host sync."""
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k_pages, v_pages, slots.to(k_pages.device).contiguous(), k, v,
        *k_pages.stride(), *v_pages.stride(), *k.stride(), *v.stride(),
        PAGE_SIZE=k_pages.shape[1], KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )


def write_kv(k_pages: torch.Tensor, v_pages: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store ``k``/``v`` ``[N, kv_heads, head_dim]`` at ``slots`` ``[N]``: Triton on CUDA when available."""
    if triton is not None and k_pages.is_cuda:
        write_kv_triton(k_pages, v_pages, slots, k, v)
    else:
        write_kv_reference(k_pages, v_pages, slots, k, v)
