"""Store the K/V of newly computed tokens into one layer of the paged pool.

``k_slots``/``v_slots`` are the slot views ``[num_pages * page_size, kv_heads, head_dim]`` of
``KVPool.k_slots(layer)``/``v_slots(layer)``; ``slots[i]`` (``page * page_size + offset``) receives row ``i``.
``k``/``v`` may be strided views (e.g. slices of a fused QKV projection) and are cast to the pool dtype.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference serves every call
    triton = None


def write_kv_reference(
    k_slots: torch.Tensor, v_slots: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """k_slots[slots] = k; v_slots[slots] = v (slots are distinct)."""
    index = slots.to(k_slots.device, torch.int64)
    k_slots.index_copy_(0, index, k.to(k_slots.dtype))
    v_slots.index_copy_(0, index, v.to(v_slots.dtype))


if triton is not None:

    @triton.jit
    def _write_kv_kernel(
        k_slots_ptr, v_slots_ptr, slots_ptr, k_ptr, v_ptr,
        stride_ks, stride_kh, stride_kd,
        stride_vs, stride_vh, stride_vd,
        stride_kn, stride_kin_h, stride_kin_d,
        stride_vn, stride_vin_h, stride_vin_d,
        KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """One program per token: copy its ``[kv_heads, head_dim]`` K and V rows into their slot."""
        i = tl.program_id(0)
        slot = tl.load(slots_ptr + i).to(tl.int64)
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < KV_HEADS) & (d < HEAD_DIM)
        k = tl.load(k_ptr + i * stride_kn + h * stride_kin_h + d * stride_kin_d, mask=mask)
        v = tl.load(v_ptr + i * stride_vn + h * stride_vin_h + d * stride_vin_d, mask=mask)
        k_dst = k_slots_ptr + slot * stride_ks + h * stride_kh + d * stride_kd
        v_dst = v_slots_ptr + slot * stride_vs + h * stride_vh + d * stride_vd
        tl.store(k_dst, k.to(k_slots_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, v.to(v_slots_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    k_slots: torch.Tensor, v_slots: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Triton version of :func:`write_kv_reference`; one launch for K and V, no host sync."""
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k_slots, v_slots, slots.to(k_slots.device).contiguous(), k, v,
        *k_slots.stride(), *v_slots.stride(), *k.stride(), *v.stride(),
        KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )


def write_kv(k_slots: torch.Tensor, v_slots: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store ``k``/``v`` ``[N, kv_heads, head_dim]`` at ``slots`` ``[N]``: Triton on CUDA when available."""
    if triton is not None and k_slots.is_cuda:
        write_kv_triton(k_slots, v_slots, slots, k, v)
    else:
        write_kv_reference(k_slots, v_slots, slots, k, v)
