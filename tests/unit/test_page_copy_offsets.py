"""Page copies address pools whose element offsets pass 2^31 (a Llama-8B-shaped pool past ~2,080 pages).

The pools live in an anonymous mapping that the kernel only materialises where it is touched, so a > 2 GiB pool
costs a few MB of RAM. The torch path runs in-process; the Triton kernel runs under TRITON_INTERPRET=1 in a
subprocess (the variable must be set before triton is imported): running this file as a script prints the
Triton case's result as JSON.
"""
from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys

import pytest
import torch
from decode_worker_kernels import page_copy

PAGE = (3, 2, 16, 1, 8)  # [layer, kv, slot, kv_head, head_dim] of one page: 768 one-byte elements
PAGE_ELEMS = 768
PAGE_STRIDE = (1 << 30) + (1 << 20)  # under 2^31, so Triton passes it as int32; page 2 starts past 2^31


def sparse_bytes(nbytes: int) -> torch.Tensor:
    """A zeroed uint8 tensor whose pages get RAM only when touched (the mapping lives as long as the tensor)."""
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(region, dtype=torch.uint8)


def strided_pool(pages: int) -> torch.Tensor:
    """``[pages, *PAGE]`` uint8 with dense pages ~1 GiB apart: from page 2 on, offsets pass 2^31."""
    base = sparse_bytes((pages - 1) * PAGE_STRIDE + PAGE_ELEMS)
    dense = torch.empty(PAGE, dtype=torch.uint8).stride()
    return base.as_strided((pages, *PAGE), (PAGE_STRIDE, *dense))


def fill_pages(pool: torch.Tensor, pages: list[int], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in pages:
        pool[p] = torch.randint(1, 255, PAGE, generator=gen, dtype=torch.uint8)


def triton_case() -> dict[str, object]:
    """Copy three pages between two strided pools with the Triton kernel; True when every page's bytes match."""
    src, dst = strided_pool(4), strided_pool(4)
    src_pages, dst_pages = torch.tensor([3, 0, 2]), torch.tensor([1, 3, 2], dtype=torch.int32)
    fill_pages(src, [3, 0, 2], seed=0)
    page_copy.copy_pages_triton(src, dst, src_pages, dst_pages)
    exact = all(torch.equal(dst[d], src[s]) for s, d in zip(src_pages.tolist(), dst_pages.tolist()))
    untouched = int(dst[0].count_nonzero()) == 0
    return {"exact": exact, "untouched": untouched, "max_offset": src[3].data_ptr() - src.data_ptr()}


def test_torch_path_moves_pages_past_two_gib():
    """A contiguous pool of 3.2 GB: gather, scatter and copy reach its last pages exactly."""
    pages = (1 << 22) + 16  # pages * 768 bytes > 2^31 past page ~2.8M
    src = sparse_bytes(pages * PAGE_ELEMS).view(pages, *PAGE)
    dst = sparse_bytes(src.numel()).view(src.shape)
    far = [pages - 1, pages - 5, 1]
    fill_pages(src, far, seed=1)
    page_copy.copy_pages(src, dst, torch.tensor(far), torch.tensor(far[::-1]))
    for s, d in zip(far, far[::-1]):
        assert torch.equal(dst[d], src[s])
    staging = page_copy.gather_pages(src, torch.tensor(far))
    assert torch.equal(staging, torch.stack([src[p] for p in far]))
    page_copy.scatter_pages(staging, dst, torch.tensor([pages - 2, pages - 3, 0]))
    assert torch.equal(dst[pages - 2], src[pages - 1])
    assert src[pages - 1].data_ptr() - src.data_ptr() > 2**31


@pytest.mark.skipif(page_copy.triton is None, reason="triton is not importable")
def test_triton_kernel_offsets_are_int64_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["max_offset"] > 2**31
    assert result["exact"] and result["untouched"], result


if __name__ == "__main__":
    print(json.dumps(triton_case()))
