"""Split-KV decode attention at real sizes on a CUDA device: against the reference, through the dispatcher and a
CUDA graph, and in a pool whose offsets pass 2^31 elements (the CPU side is tests/unit/test_split_attention.py)."""
from __future__ import annotations

import pytest
import torch
from decode_worker_kernels import paged_decode_attention
from decode_worker_kernels.paged_attention_split import paged_decode_attention_split

from tests.gpu.conftest import GPU_ONLY
from tests.unit.test_split_attention import GPU_CASES, Case, make_inputs, reference, split_error

pytestmark = GPU_ONLY


@pytest.mark.parametrize("name", list(GPU_CASES))
def test_split_kernel_matches_reference_on_gpu(name: str):
    case = GPU_CASES[name]
    error = split_error(case, "cuda", torch.int64)
    assert error <= (1e-4 if case.dtype == torch.float32 else 2e-2), f"{name}: max error {error}"


@pytest.mark.parametrize("batch", [1, 64])
def test_dispatch_is_the_split_kernel_and_graph_replay_follows_new_lengths(batch: int):
    """The dispatcher gives the split kernel's very output at batch 1 (many splits) and 64 (one split); captured in
    a CUDA graph, it follows seq_lens rewritten in place (no host sync baked a length into the graph)."""
    inputs = make_inputs(Case(32, 8, 128, 16, [5000] * batch, torch.bfloat16, None), "cuda", torch.int64)
    assert torch.equal(paged_decode_attention(**inputs), paged_decode_attention_split(**inputs))
    torch.testing.assert_close(paged_decode_attention(**inputs).float(), reference(inputs), atol=2e-2, rtol=0)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        paged_decode_attention(**inputs)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = paged_decode_attention(**inputs)
    for length in (0, 1, 300, 5000):
        inputs["seq_lens"].fill_(length)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), reference(inputs), atol=2e-2, rtol=0)


def test_split_kernel_reads_pages_past_2_31_elements():
    """Pages 2^30 bf16 elements apart (a stride Triton passes as int32): page 3's offsets pass 2^31."""
    page_size, head_dim, stride = 16, 128, 1 << 30
    buffer = torch.randn(3 * stride + 2 * page_size * head_dim, dtype=torch.bfloat16, device="cuda")
    shape, strides = (4, page_size, 1, head_dim), (stride, head_dim, head_dim, 1)
    k_pages = buffer.as_strided(shape, strides)
    v_pages = buffer.as_strided(shape, strides, storage_offset=page_size * head_dim)
    q = torch.randn(1, 8, head_dim, dtype=torch.bfloat16, device="cuda")
    inputs = {"q": q, "k_pages": k_pages, "v_pages": v_pages, "scale": head_dim ** -0.5,
              "page_table": torch.tensor([[3, 1, 2, 0]], device="cuda"),
              "seq_lens": torch.tensor([60], dtype=torch.int32, device="cuda")}
    got = paged_decode_attention_split(**inputs, num_splits=4, min_split_tokens=16, block_n=16)
    torch.testing.assert_close(got.float(), reference(inputs), atol=2e-2, rtol=0)
