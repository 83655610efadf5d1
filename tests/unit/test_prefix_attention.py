"""Prefill over a cached prefix on CUDA takes a fused SDPA kernel (a bottom-right causal bias, K/V repeated per
query head) instead of a boolean mask, which sends SDPA to its math kernel. Its result is checked against the
masked path here on CPU; tests/gpu/test_prefix_attention_gpu.py runs it with the math kernel forbidden."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from decode_worker.model.attention import prefix_attention_fused


@pytest.mark.parametrize("new,total,group", [(1, 9, 1), (5, 12, 4), (16, 16, 3), (7, 300, 2)])
def test_fused_prefix_attention_equals_the_masked_path(new: int, total: int, group: int):
    gen = torch.Generator().manual_seed(new + total)
    q = torch.randn(1, 2 * group, new, 16, generator=gen)
    k, v = (torch.randn(1, 2, total, 16, generator=gen) for _ in range(2))
    mask = torch.arange(total)[None, :] <= torch.arange(total - new, total)[:, None]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(prefix_attention_fused(q, k, v, 0.25), want, atol=1e-6, rtol=1e-5)
