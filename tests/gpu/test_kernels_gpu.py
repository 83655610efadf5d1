"""Triton kernels against their references on a CUDA device, fp32 and bf16 (the interpreter runs the same cases on
CPU in tests/unit/test_kernels.py), and the dispatchers and CPU<->CUDA page moves."""
from __future__ import annotations

import pytest
import torch
from decode_worker_kernels import copy_pages, gather_pages, paged_attention, paged_decode_attention, scatter_pages

from tests.gpu.conftest import GPU_ONLY
from tests.unit.test_kernels import PAGE_SHAPES, _check, make_attention_case, make_page_buffers, triton_errors

pytestmark = GPU_ONLY


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_cuda_matches_reference(dtype: torch.dtype):
    errors = triton_errors("cuda", dtype)
    for name in errors:
        _check(errors, name, tol=1e-4 if dtype == torch.float32 else 2e-2)


def test_cuda_dispatch_and_cross_device_moves():
    """Dispatchers on CUDA match the CPU reference, and CPU<->CUDA page moves (the torch path) are exact."""
    case = make_attention_case(9, 3, 64, 16, [1, 16, 45, 300])
    on_cuda = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    want = paged_attention.paged_decode_attention_reference(**case)
    torch.testing.assert_close(paged_decode_attention(**on_cuda).cpu(), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(paged_attention.paged_decode_attention_reference(**on_cuda).cpu(), want, atol=1e-4,
                               rtol=1e-4)

    host, device_buf, _ = make_page_buffers(*PAGE_SHAPES[1])
    device_buf = device_buf.cuda()
    pages = torch.tensor([3, 0, 7])
    copy_pages(host, device_buf, pages, pages)  # load-back
    back = torch.zeros_like(host)
    copy_pages(device_buf, back, pages, pages)  # backup
    assert torch.equal(back[pages], host[pages])
    staging = gather_pages(device_buf, pages).cpu()
    target = torch.zeros_like(device_buf)
    scatter_pages(staging, target, pages)
    assert torch.equal(target[pages].cpu(), host[pages])
