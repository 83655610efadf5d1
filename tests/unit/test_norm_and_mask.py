"""The decode step's hand-fused pieces compute the same bits as the torch ops they replace: RMSNorm as ``F.rms_norm``
in float32 at decode's and prefill's row counts, rotary as its two halves computed apart, the additive attention mask
as SDPA's boolean one."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from decode_worker.model.layers import RMSNorm, RotaryEmbedding


@pytest.mark.parametrize("rows", [7, RMSNorm.F_BELOW_ROWS + 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_gives_f_rms_norm_bit_for_bit(dtype, rows):
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(576, eps=1e-5).to(dtype)
    norm.weight.data.copy_(torch.rand(576, generator=g) * 2)
    x = (torch.randn(rows, 576, generator=g) * 3).to(dtype)
    ref = F.rms_norm(x.float(), (576,), norm.weight.float(), 1e-5).to(dtype)
    assert norm(x).dtype == dtype
    assert torch.equal(norm(x), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_rotary_gives_the_rotate_half_formula_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(2)
    rotary = RotaryEmbedding(64, 512, 10000.0, None)
    positions = torch.randint(0, 512, (9,), generator=g)
    x = (torch.randn(9, 12, 64, generator=g) * 2).to(dtype)
    wide = x.to(torch.promote_types(dtype, torch.float32))
    x1, x2 = wide.chunk(2, dim=-1)
    cos, sin = rotary.cos[positions][:, None], rotary.sin[positions][:, None]
    ref = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(dtype)
    out = rotary.tables(positions).rotate(x)
    assert out.dtype == dtype
    assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_additive_mask_gives_sdpa_the_boolean_masks_bits(dtype):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(4, 3, 3, 64, generator=g).to(dtype)
    k, v = (torch.randn(4, 3, 48, 64, generator=g).to(dtype) for _ in range(2))
    visible = (torch.arange(48) < torch.tensor([48, 17, 1, 33])[:, None])[:, None, None, :]
    additive = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
    assert torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=additive, scale=0.125),
                       F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=0.125))
