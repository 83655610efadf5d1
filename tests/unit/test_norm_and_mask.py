"""The decode step's hand-fused pieces compute the same bits as the torch ops they replace: RMSNorm as ``F.rms_norm``
in float32 at decode's and prefill's row counts (the native kernel up to float32 summation order, taking the layer's
output into the float64 residual stream first), rotary as its two halves computed apart, the additive attention mask
as SDPA's boolean one."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from decode_worker.model import layers
from decode_worker.model.layers import RMSNorm, RotaryEmbedding


@pytest.mark.parametrize("rows", [7, RMSNorm.F_BELOW_ROWS + 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_gives_f_rms_norm_bit_for_bit_without_the_native_kernel(dtype, rows, monkeypatch):
    monkeypatch.setattr(layers, "native_kernels", lambda: None)
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(576, eps=1e-5).to(dtype)
    norm.weight.data.copy_(torch.rand(576, generator=g) * 2)
    x = (torch.randn(rows, 576, generator=g) * 3).to(dtype)
    ref = F.rms_norm(x.float(), (576,), norm.weight.float(), 1e-5).to(dtype)
    assert norm(x).dtype == dtype
    assert torch.equal(norm(x), ref)


@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("dtype,delta_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.bfloat16, torch.float32)])
def test_the_float64_stream_takes_the_layer_output_and_normalises_once(dtype, delta_dtype, rows, monkeypatch):
    """The CPU model's residual stream: ``h += delta`` exactly (one float64 add, in place), then the norm of the sum in
    the weight's dtype: the native kernel equals the float64 norm rounded once (so a bf16 result at most one bf16 step
    away, and rarely), and the torch fallback gives the same."""
    g = torch.Generator().manual_seed(rows)
    norm = RMSNorm(576, eps=1e-5).to(dtype)
    norm.weight.data.copy_(torch.rand(576, generator=g) * 2)
    h = torch.randn(rows, 576, generator=g, dtype=torch.float64) * 3
    delta = torch.randn(rows, 576, generator=g).to(delta_dtype)
    total = h + delta.double()
    ref = F.rms_norm(total, (576,), norm.weight.double(), 1e-5)
    results = {}
    for native in (True, False):
        if not native:
            monkeypatch.setattr(layers, "native_kernels", lambda: None)
        elif layers.native_kernels() is None:
            continue  # no C compiler here: the fallback below is still checked
        stream = h.clone()
        results[native] = out = norm(stream, delta)
        assert torch.equal(stream, total) and out.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(out, ref.float(), rtol=2e-7, atol=1e-7)
        else:
            assert (out.float() - ref.to(dtype).float()).abs().max() <= (ref.abs().max() * 2 ** -7)
            assert (out != ref.to(dtype)).float().mean() < 0.01


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
