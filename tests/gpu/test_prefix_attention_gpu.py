"""Prefill over a cached prefix on CUDA runs without SDPA's math kernel and equals one prefill of the whole prompt."""
from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from decode_worker.model.attention import prefix_attention_fused
from decode_worker.model.runner import ModelRunner
from tests.gpu.conftest import GPU_ONLY, random_loaded

pytestmark = GPU_ONLY


def test_fused_prefix_attention_needs_no_math_kernel():
    q = torch.randn(1, 32, 40, 128, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(1, 8, 1000, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):  # math would raise here
        out = prefix_attention_fused(q, k, v, 128 ** -0.5)
    assert out.shape == q.shape and torch.isfinite(out).all()


def test_extend_over_a_cached_prefix_equals_one_prefill():
    runner = ModelRunner(random_loaded(), max_total_tokens=1024, page_size=4)
    prompt = [(5 * i + 3) % 320 for i in range(41)]
    pages = [list(range(1, 12))]
    whole = runner.forward(runner.build_batch([prompt], [0], pages)).clone()
    runner.forward(runner.build_batch([prompt[:25]], [0], pages))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        split = runner.forward(runner.build_batch([prompt[25:]], [25], pages))
    torch.testing.assert_close(split, whole, atol=1e-4, rtol=1e-4)
