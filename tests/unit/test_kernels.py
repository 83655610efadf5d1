"""Kernel tests: torch references against naive per-request loops, and Triton against the references.

Triton runs on CPU under TRITON_INTERPRET=1 in a subprocess (the variable must be set before triton is imported),
on tiny fp32 shapes; tests/gpu/test_kernels_gpu.py runs the same cases on a CUDA device, fp32 and bf16. Running this file as a script prints
the Triton-vs-reference errors as JSON; that is what the interpreter subprocess does.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
from decode_worker_kernels import (
    copy_pages,
    gather_pages,
    kv_write,
    page_copy,
    paged_attention,
    paged_decode_attention,
    scatter_pages,
    write_kv,
)

# (num_q_heads, kv_heads, head_dim, page_size, seq_lens): GQA groups 1 and 3, page sizes 1/4/16, ragged lengths
# with 1 and an exact multiple of the page size, lengths over 32 so the Triton kernel takes several steps, and a
# request of length 0 (its output is 0, not NaN).
ATTENTION_SHAPES = [
    (2, 2, 16, 1, [1, 5, 0, 3]),
    (6, 2, 16, 4, [1, 8, 37]),
    (6, 2, 24, 16, [16, 1, 40]),
    (3, 3, 16, 16, [33, 1, 32, 7]),
]
# Extra shapes for a real GPU: the SmolLM2 geometry and a Llama-style one.
GPU_ATTENTION_SHAPES = [
    (9, 3, 64, 16, [1, 16, 200, 257, 1000, 63] * 5),
    (32, 8, 128, 1, [1, 777, 64, 2048]),
]
# (layers, page_size, kv_heads, head_dim, num_pages)
PAGE_SHAPES = [(2, 1, 2, 16, 9), (3, 4, 3, 8, 12), (1, 16, 1, 24, 6)]

requires_triton = pytest.mark.skipif(paged_attention.triton is None, reason="triton is not importable")


# ---------------------------------------------------------------- case builders and naive implementations


def make_attention_case(
    num_q_heads: int, kv_heads: int, head_dim: int, page_size: int, seq_lens: list[int],
    dtype: torch.dtype = torch.float32, device: str = "cpu", table_dtype: torch.dtype = torch.int32, seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Pages of each request scattered over a shuffled pool; table entries past a request's pages point at
    random pages, and a spare column, so masking (not zero-filled memory) must hide them. K and V are one layer's
    strided views of a page-major pool, as ``KVPool.k_pages`` gives them, so kernels must honour the strides."""
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(counts) + 3
    order = torch.randperm(num_pages, generator=gen)
    table = torch.randint(0, num_pages, (len(seq_lens), max(counts) + 1), generator=gen)
    used = 0
    for b, count in enumerate(counts):
        table[b, :count] = order[used:used + count]
        used += count
    pool = torch.randn(num_pages, 2, 2, page_size, kv_heads, head_dim, generator=gen).to(device, dtype)  # 2 layers
    return {
        "q": torch.randn(len(seq_lens), num_q_heads, head_dim, generator=gen).to(device, dtype),
        "k_pages": pool[:, 1, 0],
        "v_pages": pool[:, 1, 1],
        "page_table": table.to(device, table_dtype),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=device),
        "scale": head_dim ** -0.5,
    }


def naive_attention(q, k_pages, v_pages, page_table, seq_lens, scale) -> torch.Tensor:
    """Per request, per query head, token by token through the page table, in float64."""
    batch, num_q_heads, head_dim = q.shape
    page_size, kv_heads = k_pages.shape[1], k_pages.shape[2]
    group = num_q_heads // kv_heads
    out = torch.empty(batch, num_q_heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        where = [(int(page_table[b, t // page_size]), t % page_size) for t in range(int(seq_lens[b]))]
        for h in range(num_q_heads):
            keys = torch.stack([k_pages[p, s, h // group] for p, s in where]).double()
            values = torch.stack([v_pages[p, s, h // group] for p, s in where]).double()
            weights = torch.softmax(keys @ q[b, h].double() * scale, dim=0)
            out[b, h] = weights @ values
    return out


def make_page_buffers(layers: int, page_size: int, kv_heads: int, head_dim: int, num_pages: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_pages, layers, 2, page_size, kv_heads, head_dim)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen), gen


# ---------------------------------------------------------------- (a) references against naive loops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("group", [1, 3])
def test_paged_attention_reference_matches_naive(group: int, page_size: int, dtype: torch.dtype):
    kv_heads = 2
    seq_lens = [1, 2 * page_size, 37, page_size + 1, 3 * page_size - 1]
    table_dtype = torch.int32 if page_size == 4 else torch.int64
    case = make_attention_case(group * kv_heads, kv_heads, 16, page_size, seq_lens, dtype, table_dtype=table_dtype)
    out = paged_decode_attention(**case)
    assert out.shape == case["q"].shape and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), naive_attention(**case), atol=tol, rtol=tol)


def test_paged_attention_reference_ignores_pages_past_length():
    case = make_attention_case(6, 2, 16, 4, [5, 9])
    before = paged_decode_attention(**case)
    case["page_table"][0, 2:] = 0
    case["page_table"][1, 3:] = 1
    case["k_pages"][case["page_table"][0, 1], 1:] = 1e4  # slots past the last token of request 0
    case["v_pages"][case["page_table"][0, 1], 1:] = 1e4
    torch.testing.assert_close(paged_decode_attention(**case), before, atol=0, rtol=0)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_write_kv_reference_matches_naive(page_size: int, pool_dtype: torch.dtype):
    gen = torch.Generator().manual_seed(page_size)
    kv_heads, head_dim, num_pages, n = 3, 8, 6, 5
    pool = torch.randn(num_pages, 2, 2, page_size, kv_heads, head_dim, generator=gen).to(pool_dtype)  # 2 layers
    k_pages, v_pages = pool[:, 1, 0], pool[:, 1, 1]
    qkv = torch.randn(n, 3 * kv_heads * head_dim, generator=gen)  # k, v as strided slices, as a fused projection gives
    k = qkv[:, kv_heads * head_dim:2 * kv_heads * head_dim].view(n, kv_heads, head_dim)
    v = qkv[:, 2 * kv_heads * head_dim:].view(n, kv_heads, head_dim)
    slots = torch.randperm(num_pages * page_size, generator=gen)[:n]
    want = pool.clone()
    for i, slot in enumerate(slots.tolist()):
        want[slot // page_size, 1, 0, slot % page_size] = k[i].to(pool_dtype)
        want[slot // page_size, 1, 1, slot % page_size] = v[i].to(pool_dtype)
    write_kv(k_pages, v_pages, slots, k, v)
    assert torch.equal(pool, want)  # layer 0 and every other slot untouched


@pytest.mark.parametrize("shape", PAGE_SHAPES, ids=lambda s: f"ps{s[1]}")
def test_page_moves_reference_match_naive(shape):
    src, dst, gen = make_page_buffers(*shape)
    num_pages = shape[-1]
    src_pages = torch.randperm(num_pages, generator=gen)[:4]
    dst_pages = torch.randperm(num_pages, generator=gen)[:4].to(torch.int32)

    want = dst.clone()
    for s, d in zip(src_pages.tolist(), dst_pages.tolist()):
        want[d] = src[s]
    copy_pages(src, dst, src_pages, dst_pages)
    assert torch.equal(dst, want)

    staging = gather_pages(src, src_pages)
    assert staging.is_contiguous()
    assert torch.equal(staging, torch.stack([src[p] for p in src_pages.tolist()]))

    target = torch.zeros_like(src)
    scatter_pages(staging, target, dst_pages)
    for s, d in zip(src_pages.tolist(), dst_pages.tolist()):
        assert torch.equal(target[d], src[s])
    untouched = torch.ones(num_pages, dtype=torch.bool)
    untouched[dst_pages.long()] = False
    assert not target[untouched].any()


@pytest.mark.parametrize("dtype,page_size,head_dim,row_dtype", [(torch.bfloat16, 4, 64, torch.complex128),
                                                                (torch.float32, 1, 3, torch.int64),
                                                                (torch.bfloat16, 1, 3, torch.int32)])
def test_page_moves_copy_bits_whatever_the_row_element_type(dtype, page_size: int, head_dim: int, row_dtype):
    """Pages move as rows of wide elements (see ``_page_rows``); every bit pattern, NaNs included, arrives unchanged."""
    gen = torch.Generator().manual_seed(3)
    shape = (7, 1, 2, page_size, 1, head_dim)  # one layer, one kv head: pages of 24 or 12 bytes stay narrow
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    src, dst = (torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).view(dtype).view(shape) for _ in range(2))
    assert page_copy._page_rows(src, dst)[0].dtype == row_dtype
    src_pages, dst_pages = torch.tensor([5, 0, 3]), torch.tensor([1, 6, 2])
    want = dst.clone()
    want[dst_pages] = src[src_pages]
    staging = gather_pages(src, src_pages)
    assert torch.equal(staging.view(torch.uint8), src[src_pages].contiguous().view(torch.uint8))
    scatter_pages(staging, dst, dst_pages)
    assert torch.equal(dst.view(torch.uint8), want.view(torch.uint8))
    copy_pages(src, dst, src_pages.flip(0), dst_pages)
    want[dst_pages] = src[src_pages.flip(0)]
    assert torch.equal(dst.view(torch.uint8), want.view(torch.uint8))


def test_page_moves_between_buffers_aligned_differently():
    """A buffer that starts 2 bytes into its storage moves pages as 2-byte rows, and so does its partner."""
    raw = torch.randint(0, 256, (2 * 2 * 5 * 4 * 3 * 8 * 2 + 2,), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    buf = raw[2:].view(torch.bfloat16).view(5, 2, 2, 4, 3, 8)
    staging = gather_pages(buf, torch.tensor([4, 1]))
    assert torch.equal(staging.view(torch.uint8), buf[[4, 1]].contiguous().view(torch.uint8))
    scatter_pages(staging, buf, torch.tensor([0, 2]))
    assert torch.equal(buf[[0, 2]].view(torch.uint8), staging.view(torch.uint8))


def test_page_moves_reject_count_mismatch():
    src, dst, _ = make_page_buffers(*PAGE_SHAPES[0])
    with pytest.raises(ValueError):
        copy_pages(src, dst, torch.tensor([1, 2]), torch.tensor([3]))
    with pytest.raises(ValueError):
        scatter_pages(gather_pages(src, torch.tensor([1, 2])), dst, torch.tensor([3]))


def test_page_moves_empty_is_noop():
    src, dst, _ = make_page_buffers(*PAGE_SHAPES[0])
    before = dst.clone()
    empty = torch.tensor([], dtype=torch.int64)
    copy_pages(src, dst, empty, empty)
    scatter_pages(gather_pages(src, empty), dst, empty)
    assert torch.equal(dst, before)


# ---------------------------------------------------------------- (b, c) Triton against the references


def triton_cases(device: str, dtype: torch.dtype) -> dict[str, Callable[[], float]]:
    """Each case returns max |triton - reference| (0.0 when exact)."""
    cases: dict[str, Callable[[], float]] = {}
    shapes = ATTENTION_SHAPES + (GPU_ATTENTION_SHAPES if device == "cuda" else [])
    for i, shape in enumerate(shapes):
        table_dtype = torch.int64 if i % 2 else torch.int32
        cases[f"attention-{i}"] = lambda shape=shape, t=table_dtype: _attention_error(shape, dtype, device, t)
    for i, shape in enumerate(PAGE_SHAPES):
        cases[f"write_kv-{i}"] = lambda shape=shape: _write_kv_error(shape, dtype, device)
        cases[f"page_copy-{i}"] = lambda shape=shape: _page_copy_error(shape, dtype, device)
    return cases


def triton_errors(device: str, dtype: torch.dtype) -> dict[str, float | str]:
    """Error per case, or the exception text so one broken kernel does not hide the others."""
    errors: dict[str, float | str] = {}
    for name, run in triton_cases(device, dtype).items():
        try:
            errors[name] = run()
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
    return errors


def _attention_error(shape, dtype, device, table_dtype) -> float:
    case = make_attention_case(*shape, dtype=dtype, device=device, table_dtype=table_dtype)
    got = paged_attention.paged_decode_attention_triton(**case)
    # on CPU, where SDPA gives a zero-length request zeros; CUDA's SDPA kernels need not
    want = paged_attention.paged_decode_attention_reference(**{k: v.cpu() if isinstance(v, torch.Tensor) else v
                                                               for k, v in case.items()})
    return (got.cpu().double() - want.double()).abs().max().item()


def _write_kv_error(shape, dtype, device) -> float:
    _, page_size, kv_heads, head_dim, num_pages = shape
    buffers, _, gen = make_page_buffers(*shape)
    buffers = buffers.to(device, dtype)
    n = min(7, num_pages * page_size)
    new = torch.randn(2, n, kv_heads, 2 * head_dim, generator=gen).to(device, dtype)[..., ::2]  # strided input
    slots = torch.randperm(num_pages * page_size, generator=gen)[:n].to(device)
    got = buffers.clone()
    layer = buffers.shape[1] - 1  # strided page views, as KVPool.k_pages gives them
    kv_write.write_kv_triton(got[:, layer, 0], got[:, layer, 1], slots, new[0], new[1])
    kv_write.write_kv_reference(buffers[:, layer, 0], buffers[:, layer, 1], slots, new[0], new[1])
    return (got.double() - buffers.double()).abs().max().item()


def _page_copy_error(shape, dtype, device) -> float:
    src, dst, gen = make_page_buffers(*shape)
    src, dst = src.to(device, dtype), dst.to(device, dtype)
    num_pages = shape[-1]
    src_pages = torch.randperm(num_pages, generator=gen)[:5].to(device)
    dst_pages = torch.randperm(num_pages, generator=gen)[:5].to(device, torch.int32)
    got, want = dst.clone(), dst.clone()
    page_copy.copy_pages_triton(src, got, src_pages, dst_pages)
    page_copy.copy_pages_reference(src, want, src_pages, dst_pages)
    staging = page_copy.gather_pages_triton(src, src_pages)
    errors = [
        (got - want).abs().max(),
        (staging - page_copy.gather_pages_reference(src, src_pages)).abs().max(),
    ]
    got, want = dst.clone(), dst.clone()
    page_copy.scatter_pages_triton(staging, got, dst_pages)
    page_copy.scatter_pages_reference(staging, want, dst_pages)
    errors.append((got - want).abs().max())
    return max(e.item() for e in errors)


def _check(errors: dict[str, float | str], name: str, tol: float) -> None:
    error = errors[name]
    assert not isinstance(error, str), error
    if name.startswith("attention"):
        assert error <= tol, f"{name}: max error {error}"
    else:
        assert error == 0.0, f"{name}: copies must be exact, max error {error}"


@pytest.fixture(scope="module")
def interpreter_errors() -> dict[str, float | str]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@requires_triton
@pytest.mark.parametrize("name", list(triton_cases("cpu", torch.float32)))
def test_triton_interpreter_matches_reference(interpreter_errors, name: str):
    _check(interpreter_errors, name, tol=1e-5)


if __name__ == "__main__":
    print(json.dumps(triton_errors("cpu", torch.float32)))
