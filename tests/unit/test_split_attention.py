"""Split-KV decode attention (``decode_worker_kernels/paged_attention_split.py``) against the torch reference.

On CPU the kernel runs under TRITON_INTERPRET=1 in one subprocess (the variable must be set before triton is
imported) on small shapes cut into many short splits; run as a module (``python -m tests.unit.test_split_attention``)
this file prints each case's error as JSON, which is what that subprocess does. tests/gpu/test_split_attention_gpu.py
runs the real sizes on a CUDA device, with the dispatcher, a CUDA graph and a pool whose offsets pass 2^31 elements.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from decode_worker_kernels import paged_attention, paged_attention_split, paged_decode_attention
from decode_worker_kernels.paged_attention_split import choose_num_splits, paged_decode_attention_split

from tests.unit.test_kernels import make_attention_case

ROOT = Path(__file__).resolve().parents[2]


class Case(NamedTuple):
    num_q_heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    seq_lens: list[int]
    dtype: torch.dtype
    num_splits: int | None
    min_split_tokens: int = 16
    block_n: int = 16


# Per request the split length is max(min_split, cdiv(cdiv(len, splits), block_n) * block_n), so e.g. 100 tokens
# in 3 splits are 48 + 48 + 4 and 33 tokens with min_split 32 are 32 + 1: lengths end mid-page and mid-split,
# some requests use fewer splits than the grid has, and one split holds a single token.
INTERPRETER_CASES = {
    "g1-d64-ps1-fp32": Case(2, 2, 64, 1, [1, 5, 37, 64], torch.float32, 4),
    "g3-d128-ps16-bf16": Case(6, 2, 128, 16, [1, 40, 100, 16], torch.bfloat16, 3),
    "g7-d128-ps16-fp32": Case(7, 1, 128, 16, [33, 1, 130], torch.float32, 4, min_split_tokens=32),
    "g8-d64-ps1-bf16": Case(16, 2, 64, 1, [2, 70, 31], torch.bfloat16, 5),
    "g8-d128-ps16-bf16-one-split": Case(8, 1, 128, 16, [50, 1], torch.bfloat16, 1),
    "g3-d64-ps16-fp32-default-blocks": Case(3, 1, 64, 16, [300, 600, 1], torch.float32, 3, 256, 64),
    "g2-d64-ps4-fp32-zero-length": Case(4, 2, 64, 4, [0, 9, 0], torch.float32, 2),  # attends to nothing: 0, no NaN
}
# Real geometries for a GPU: Llama-3-8B (group 4), Qwen2-7B (group 7), Llama-70B (group 8), SmolLM2 (group 3).
GPU_CASES = {
    f"{name}-{dtype_name}": Case(*geometry, [0, 1, 255, 256, 257, 777, 2048, 4000, 8191], dtype, None, 256, 32)
    for name, geometry in {"llama8b": (32, 8, 128, 16), "qwen7b": (28, 4, 128, 16), "llama70b": (64, 8, 128, 1),
                           "smollm2": (9, 3, 64, 16)}.items()
    for dtype_name, dtype in {"fp32": torch.float32, "bf16": torch.bfloat16}.items()
}

requires_triton = pytest.mark.skipif(paged_attention.triton is None, reason="triton is not importable")
CUOBJDUMP = Path(paged_attention.triton.__file__).parent / "backends/nvidia/bin/cuobjdump" if paged_attention.triton \
    else None  # ships with triton: reads a cubin's registers and stack without a GPU


def make_inputs(case: Case, device: str = "cpu", index_dtype: torch.dtype = torch.int32, seed: int = 0) -> dict:
    """``test_kernels.make_attention_case``'s inputs (pages scattered over a shuffled page-major pool, K/V strided
    views of one layer, spare table entries pointing at random pages) with the lengths in ``index_dtype`` too (the
    model's are int64, and int32 must work) and q a strided view as well."""
    inputs = make_attention_case(case.num_q_heads, case.kv_heads, case.head_dim, case.page_size, case.seq_lens,
                                 case.dtype, device, table_dtype=index_dtype, seed=seed)
    q = inputs["q"]
    inputs["q"] = torch.empty(*q.shape[:2], 2 * q.shape[2], dtype=q.dtype, device=q.device)[..., ::2].copy_(q)
    inputs["seq_lens"] = inputs["seq_lens"].to(index_dtype)
    return inputs


def reference(inputs: dict) -> torch.Tensor:
    """The torch reference on float32 CPU copies of the inputs (on the inputs' device): the bf16 cases then measure
    only the kernel's own rounding, and a zero-length request gets CPU SDPA's zeros (CUDA's kernels need not)."""
    upcast = {k: v.float() if k in ("q", "k_pages", "v_pages") else v for k, v in inputs.items()}
    on_cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in upcast.items()}
    return paged_attention.paged_decode_attention_reference(**on_cpu).to(inputs["q"].device)


def split_error(case: Case, device: str = "cpu", index_dtype: torch.dtype = torch.int32) -> float:
    """Max |split - reference| over max(1, |reference|): bf16 rounds relative to the output's size."""
    inputs = make_inputs(case, device, index_dtype)
    got = paged_decode_attention_split(**inputs, num_splits=case.num_splits,
                                       min_split_tokens=case.min_split_tokens, block_n=case.block_n)
    assert got.dtype == case.dtype and got.shape == inputs["q"].shape
    want = reference(inputs)
    return ((got.float() - want).abs() / want.abs().clamp(min=1)).max().item()


def tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2


@pytest.fixture(scope="module")
def interpreter_errors() -> dict[str, float | str]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.unit.test_split_attention"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@requires_triton
@pytest.mark.parametrize("name", list(INTERPRETER_CASES))
def test_split_kernel_matches_reference_in_interpreter(interpreter_errors, name: str):
    error = interpreter_errors[name]
    assert not isinstance(error, str), error
    assert error <= tolerance(INTERPRETER_CASES[name].dtype), f"{name}: max error {error}"


def test_split_count_fills_the_gpu_without_short_splits():
    """132 SMs, 8 kv heads: batch 1 at 8K gets 33 programs per head-group; 2K stops at 256-token splits;
    a batch that already fills the GPU, or a table of one split's capacity, is not cut."""
    assert choose_num_splits(1, 8, 8192, 132) == 32
    assert choose_num_splits(1, 8, 2048, 132) == 8
    assert choose_num_splits(4, 8, 8192, 132) == 9
    assert choose_num_splits(64, 8, 8192, 132) == 1
    assert choose_num_splits(1, 8, 256, 132) == 1
    assert choose_num_splits(1, 1, 1 << 20, 132) == paged_attention_split.MAX_SPLITS


@requires_triton
def test_split_kernel_refuses_blocks_that_do_not_tile_a_split():
    inputs = make_inputs(INTERPRETER_CASES["g1-d64-ps1-fp32"])
    with pytest.raises(ValueError, match="block_n"):
        paged_decode_attention_split(**inputs, num_splits=2, min_split_tokens=24, block_n=16)


# What the launch specialises (Triton makes an int argument equal to 1 a constant and marks pointers and ints
# divisible by 16 as such): unit strides of the last dims, and aligned pointers and strides at serving geometries.
UNIT_STRIDES = ("stride_qd", "stride_kd", "stride_vd", "stride_tp", "stride_pd", "stride_ls")
ALIGNED = ("q_ptr", "k_ptr", "v_ptr", "table_ptr", "lens_ptr", "part_ptr", "lse_ptr", "stride_qb", "stride_qh",
           "stride_kp", "stride_ks", "stride_kh", "stride_vp", "stride_vs", "stride_vh", "stride_pb", "stride_ph",
           "stride_ps")


def stage1_resources(group: int, head_dim: int, page_size: int, cubin: Path) -> dict[str, int]:
    """Compile stage 1 for sm_90 as the wrapper launches it (bf16, int64 indices, specialised like the launch),
    which needs no GPU, and read its registers and stack bytes from the cubin."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = paged_attention_split._split_stage1_kernel
    consts = {"GROUP": group, "HEAD_DIM": head_dim, "PAGE_SIZE": page_size,
              "MIN_SPLIT": paged_attention_split.MIN_SPLIT_TOKENS, "PRECISION": None, "DOT_DTYPE": tl.bfloat16,
              "BLOCK_G": max(16, group), "BLOCK_D": head_dim, "BLOCK_N": paged_attention_split.BLOCK_N,
              **dict.fromkeys(UNIT_STRIDES, 1)}
    pointers = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "table_ptr": "*i64", "lens_ptr": "*i64",
                "part_ptr": "*fp32", "lse_ptr": "*fp32", "scale_log2": "fp32"}
    signature = {name: "constexpr" if name in consts else pointers.get(name, "i32") for name in kernel.arg_names}
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in ALIGNED}
    compiled = triton.compile(ASTSource(kernel, signature, consts, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": paged_attention_split.NUM_WARPS,
                                       "num_stages": paged_attention_split.NUM_STAGES})
    cubin.write_bytes(compiled.asm["cubin"])
    usage = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", str(cubin)], capture_output=True, text=True,
                           check=True).stdout
    registers, stack = re.search(r"REG:(\d+) STACK:(\d+)", usage).groups()
    return {"registers": int(registers), "stack": int(stack)}


def programs_per_sm(registers: int, warps: int, register_file: int = 65536) -> int:
    """Programs an sm_90 SM holds at ``registers`` a thread (allocated in units of 8), by registers alone."""
    return register_file // (-(-registers // 8) * 8 * 32 * warps)


@requires_triton
@pytest.mark.skipif(CUOBJDUMP is None or not CUOBJDUMP.exists(), reason="triton without its CUDA tools")
@pytest.mark.parametrize("group,page_size", [(4, 16), (7, 16), (8, 1)])
def test_stage1_fits_four_programs_per_hopper_sm_at_head_dim_128(group: int, page_size: int, tmp_path: Path):
    """The one-pass kernel spills at GQA group 7-8, head_dim 128 (issue 18); stage 1 must not, and must leave room
    for 4 programs of 8 warps an SM (half its warps: the 64-token tile held 3)."""
    usage = stage1_resources(group, 128, page_size, tmp_path / "stage1.cubin")
    assert usage["stack"] == 0, usage
    assert programs_per_sm(usage["registers"], paged_attention_split.NUM_WARPS) >= 4, usage


class ClaimsCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: enough for the dispatcher's choice, which reads nothing else."""

    @property
    def is_cuda(self) -> bool:
        return True


@pytest.mark.parametrize("batch", [1, 64, 256])
def test_cuda_dispatch_serves_every_batch_with_the_split_kernel(monkeypatch, batch: int):
    """Batches that fill the GPU too (64, 256 at 8 kv heads) take the split kernel, not the one-pass kernel that
    needs the whole register file."""
    if paged_attention.triton is None:
        pytest.skip("triton is not importable")
    calls = []
    monkeypatch.setattr(paged_attention, "paged_decode_attention_split", lambda *a, **k: calls.append("split"))
    monkeypatch.setattr(paged_attention, "paged_decode_attention_triton", lambda *a, **k: calls.append("one_pass"))
    q = torch.zeros(batch, 32, 128).as_subclass(ClaimsCuda)
    k_pages = torch.zeros(4, 16, 8, 128)
    paged_decode_attention(q, k_pages, k_pages, torch.zeros(batch, 512, dtype=torch.int64),
                           torch.full((batch,), 8000), 128 ** -0.5)
    assert calls == ["split"]


if __name__ == "__main__":
    errors: dict[str, float | str] = {}
    for i, (name, case) in enumerate(INTERPRETER_CASES.items()):
        try:
            errors[name] = split_error(case, index_dtype=torch.int64 if i % 2 else torch.int32)
        except Exception as exc:  # noqa: BLE001 - one broken case must not hide the others
            errors[name] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(errors))
