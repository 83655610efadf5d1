"""The native CPU rotary-and-store pass gives the torch path's results: queries rotated as ``RopeTables.rotate``
does (float32 math, one rounding), rotated keys and the values written to exactly their slots of a strided
multi-layer pool and nowhere else; slots outside the pool are refused."""
from __future__ import annotations

import pytest
import torch
from decode_worker_kernels.cpu_rope import fits, rope_store_cpu
from decode_worker_kernels.kv_write import write_kv_reference

from decode_worker.model.layers import RotaryEmbedding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,tokens", [(9, 3, 64, 5), (4, 4, 32, 1), (8, 2, 128, 70)])
def test_queries_keys_and_values_match_the_torch_path(native_lib, dtype, q_heads, kv_heads, head_dim, tokens):
    g = torch.Generator().manual_seed(tokens)
    page_size, num_pages = 4, 40
    pools = [torch.randn(num_pages, 2, 2, page_size, kv_heads, head_dim, generator=g).to(dtype)]
    ours, theirs, original = pools[0], pools[0].clone(), pools[0].clone()
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    rope = RotaryEmbedding(head_dim, 512, 10000.0, None).tables(torch.randint(0, 512, (tokens,), generator=g))
    slots = torch.randperm((num_pages - 1) * page_size, generator=g)[:tokens] + page_size
    q = rope_store_cpu(native_lib, qkv, rope.cos, rope.sin, q_heads, ours[:, 1, 0], ours[:, 1, 1], slots)

    q_size, kv_size = q_heads * head_dim, kv_heads * head_dim
    ref_q = rope.rotate(qkv[:, :q_size].view(tokens, q_heads, head_dim))
    ref_k = rope.rotate(qkv[:, q_size: q_size + kv_size].view(tokens, kv_heads, head_dim))
    ref_v = qkv[:, q_size + kv_size:].view(tokens, kv_heads, head_dim)
    write_kv_reference(theirs[:, 1, 0], theirs[:, 1, 1], slots, ref_k, ref_v)
    assert q.dtype == dtype and q.shape == (tokens, q_heads, head_dim)
    if dtype == torch.float32:  # the compiler may fuse the product and sum: float32 rounding apart
        torch.testing.assert_close(q, ref_q, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    else:  # one bf16 rounding of nearly the same float32 value: at most one step apart, rarely
        for a, b in ((q, ref_q), (ours, theirs)):
            assert (a.float() - b.float()).abs().max() <= b.float().abs().max() * 2 ** -7
            assert (a != b).float().mean() < 0.01
    written = torch.zeros(num_pages * page_size, dtype=torch.bool)
    written[slots] = True
    kept = ~written.view(num_pages, page_size)
    assert torch.equal(ours[:, 0], original[:, 0])  # the other layer
    assert torch.equal(ours[:, 1].transpose(1, 2)[kept], original[:, 1].transpose(1, 2)[kept])  # this one's other slots


def test_a_slot_outside_the_pool_is_refused_and_unsupported_shapes_do_not_fit(native_lib):
    pool = torch.zeros(3, 4, 2, 64)
    qkv = torch.randn(2, (4 + 2 * 2) * 64)
    rope = RotaryEmbedding(64, 16, 10000.0, None).tables(torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="outside the pool"):
        rope_store_cpu(native_lib, qkv, rope.cos, rope.sin, 4, pool, pool.clone(), torch.tensor([1, 12]))
    assert not fits(torch.randn(2, (4 + 2 * 2) * 48), torch.zeros(3, 4, 2, 48), 4)  # head_dim not a multiple of 32
    assert not fits(qkv.half(), pool, 4) and not fits(qkv.t(), pool, 4) and fits(qkv, pool, 4)
