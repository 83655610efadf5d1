"""The decode step's hand-fused pieces compute the same bits as the torch ops they replace: RMSNorm as ``F.rms_norm``
in float32, the additive attention mask as SDPA's boolean one."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from decode_worker.model.layers import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_gives_f_rms_norm_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(576, eps=1e-5).to(dtype)
    norm.weight.data.copy_(torch.rand(576, generator=g) * 2)
    x = (torch.randn(7, 576, generator=g) * 3).to(dtype)
    ref = F.rms_norm(x.float(), (576,), norm.weight.float(), 1e-5).to(dtype)
    assert norm(x).dtype == dtype
    assert torch.equal(norm(x), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_additive_mask_gives_sdpa_the_boolean_masks_bits(dtype):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(4, 3, 3, 64, generator=g).to(dtype)
    k, v = (torch.randn(4, 3, 48, 64, generator=g).to(dtype) for _ in range(2))
    visible = (torch.arange(48) < torch.tensor([48, 17, 1, 33])[:, None])[:, None, None, :]
    additive = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
    assert torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=additive, scale=0.125),
                       F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=0.125))
