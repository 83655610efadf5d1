"""Kernels over the paged KV layout of ``decode_worker.cache.pool`` (installed as ``decode_worker_kernels``).

Each module holds a Triton kernel and the torch reference it is tested against. The public functions pick
Triton for tensors on CUDA when it is importable and the reference otherwise, so the CPU runner is plain torch.
"""
from .kv_write import write_kv
from .page_copy import copy_pages, gather_pages, scatter_pages
from .paged_attention import paged_decode_attention

__all__ = ["copy_pages", "gather_pages", "paged_decode_attention", "scatter_pages", "write_kv"]
