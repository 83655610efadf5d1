"""The native SwiGLU activation is ``silu(gate) * up`` computed in float32 with one rounding: float32 within a few
units in the last place of the float64 value, bf16 the float64 value rounded once (torch's bf16 rounds twice), and
no NaN or overflow at the ends of the range."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from decode_worker_kernels.cpu_activation import fits, silu_mul_cpu


def exact(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.double().chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("rows", [1, 9, 300])
def test_float32_is_silu_times_up_within_float32_rounding(native_lib, rows):
    gate_up = torch.randn(rows, 2 * 96, generator=torch.Generator().manual_seed(rows)) * 4
    ours = silu_mul_cpu(native_lib, gate_up)
    assert ours.shape == (rows, 96) and ours.dtype == torch.float32
    torch.testing.assert_close(ours.double(), exact(gate_up), rtol=4e-7, atol=1e-30)


def test_bf16_rounds_once(native_lib):
    gate_up = (torch.randn(64, 2 * 64, generator=torch.Generator().manual_seed(3)) * 4).bfloat16()
    ours = silu_mul_cpu(native_lib, gate_up)
    once = exact(gate_up).float().bfloat16()
    assert ours.dtype == torch.bfloat16 and (ours != once).float().mean() < 0.01  # a float32 ulp can tip a tie
    assert (ours.float() - once.float()).abs().max() <= once.float().abs().max() * 2 ** -7


def test_the_ends_of_the_range(native_lib):
    gate = torch.tensor([-1e4, -120.0, -88.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 88.0, 120.0, 1e4, 3.0, -3.0, 5.0, 1.0, -1.0])
    ours = silu_mul_cpu(native_lib, torch.cat([gate, torch.ones(16)])[None])
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours[0].double(), F.silu(gate.double()), rtol=4e-7, atol=1e-30)
    assert not fits(torch.randn(2, 48)) and not fits(torch.randn(2, 64).half()) and fits(torch.randn(2, 64))
