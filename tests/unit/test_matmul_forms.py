"""The CPU matmul forms: oneDNN-packed weights compute what the plain matmul computes, the vocabulary matmul takes the
form its dtype and row count call for, and packing a model's linears drops their dense copies."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from decode_worker.model.matmul import (HALF_HEAD_BELOW_ROWS, ByRows, HalfLinear, PackedLinear, head_matmul,
                                        pack_linears, packs)

needs_float32_packing = pytest.mark.skipif(not packs(torch.float32), reason="oneDNN float32 packing is x86 only")
needs_bf16_packing = pytest.mark.skipif(not packs(torch.bfloat16),
                                        reason="oneDNN has no native bf16 on this CPU (no AVX512-BF16 or AMX)")
ROW_COUNTS = (1, 5, 12, 31, 32, 33, 100)


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@needs_bf16_packing
def test_the_packed_bf16_weight_gives_the_dense_matmul_bit_for_bit():
    """Reordered once, a bf16 weight computes exactly what a plain bf16 matmul computes at every row count (the layout
    is packed for 32 rows), so packing changes speed and never an output."""
    weight = randn(96, 128, seed=8, dtype=torch.bfloat16)
    packed = PackedLinear(weight)
    for rows in ROW_COUNTS:
        x = randn(rows, 128, seed=rows, dtype=torch.bfloat16)
        assert torch.equal(packed(x), nn.functional.linear(x, weight)), rows
        assert torch.equal(packed(x.t().contiguous().t()), nn.functional.linear(x, weight)), rows  # strided


@needs_float32_packing
def test_the_packed_float32_weight_agrees_with_the_dense_matmul_to_float32_rounding():
    """float32 stays float32 (no bf16 shortcut): only the summation order differs, with a bias and any leading
    shape."""
    weight, bias = randn(96, 128, seed=1), randn(96, seed=2)
    packed = PackedLinear(weight, bias)
    for rows in ROW_COUNTS:
        x = randn(rows, 128, seed=rows)
        ref = nn.functional.linear(x, weight, bias)
        assert (packed(x) - ref).abs().max().item() < 1e-5 * ref.abs().max().item(), rows
    x = randn(2, 3, 128, seed=3)
    assert packed(x).shape == (2, 3, 96)
    assert torch.allclose(packed(x), nn.functional.linear(x, weight, bias), rtol=0, atol=1e-4)


def test_by_rows_sends_few_rows_to_the_narrow_form_and_many_to_the_wide():
    matmul = ByRows(lambda x: torch.zeros(x.shape[0]), lambda x: torch.ones(x.shape[0]), wide_from_rows=4)
    assert matmul(torch.empty(3, 2)).sum() == 0 and matmul(torch.empty(4, 2)).sum() == 4


@needs_bf16_packing
def test_the_bf16_vocabulary_matmul_is_fp16_at_few_rows_and_packed_bf16_at_many():
    weight = randn(64, 32, seed=4, dtype=torch.bfloat16)
    matmul = head_matmul(weight, low_bit=True)
    assert isinstance(matmul, ByRows) and isinstance(matmul.narrow, HalfLinear)
    assert isinstance(matmul.wide, PackedLinear) and matmul.wide_from_rows == HALF_HEAD_BELOW_ROWS
    ref_weight = weight.float()
    for rows in (1, HALF_HEAD_BELOW_ROWS - 1, HALF_HEAD_BELOW_ROWS, 32):
        x = randn(rows, 32, seed=rows, dtype=torch.bfloat16)
        ref = x.float() @ ref_weight.t()
        out = matmul(x).float()
        # fp16 holds a bf16 weight exactly and keeps float32 activations: far closer than a bf16 output's rounding
        tolerance = 1e-2 if rows >= HALF_HEAD_BELOW_ROWS else 1e-3
        assert (out - ref).abs().max().item() < tolerance * ref.abs().max().item(), rows


def test_the_float32_vocabulary_matmul_is_fp16_only_for_low_bit_models():
    weight = randn(64, 32, seed=5)
    assert isinstance(head_matmul(weight, low_bit=True), HalfLinear)
    exact = head_matmul(weight, low_bit=False)
    assert isinstance(exact, PackedLinear) if packs(torch.float32) else exact is None


@needs_float32_packing
def test_packing_a_models_linears_replaces_them_and_frees_their_dense_weights():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 16, bias=False))
    head = nn.Linear(16, 8)
    model.append(head)
    x = randn(5, 32, seed=6)
    ref = model(x).detach()
    dense_weight = weakref.ref(model[0].weight)
    assert pack_linears(model, skip=("3",)) == 2
    gc.collect()
    assert dense_weight() is None, "the dense weight outlived its packed copy"
    assert isinstance(model[0], PackedLinear) and isinstance(model[2], PackedLinear) and model[3] is head
    assert torch.allclose(model(x), ref, rtol=0, atol=1e-5)


def test_a_q8_vocabulary_matrix_runs_the_native_kernel_at_few_rows():
    """Given the file's Q8_0 blocks, few rows read them (the exact values, float32 logits) and many rows the
    dtype's packed form; both agree with the dequantized matmul."""
    from decode_worker.model.matmul import Q8_HEAD_BELOW_ROWS
    from decode_worker.model.native import native_kernels
    from decode_worker.model.quant import Q8Blocks

    if native_kernels() is None:
        pytest.skip("the native low-bit kernels did not build here (no C compiler)")
    g = torch.Generator().manual_seed(11)
    blocks = Q8Blocks(torch.randint(-127, 128, (64, 64), generator=g, dtype=torch.int8),
                      (torch.rand(64, 2, generator=g) * 0.01).half().float())
    weight = blocks.dequantize()
    matmul = head_matmul(weight, low_bit=False, q8_blocks=blocks)
    assert isinstance(matmul, ByRows) and matmul.wide_from_rows == Q8_HEAD_BELOW_ROWS[torch.float32]
    for rows in (1, 7, Q8_HEAD_BELOW_ROWS[torch.float32]):
        x = randn(rows, 64, seed=rows)
        out = matmul(x)
        assert out.dtype == torch.float32
        assert (out - x @ weight.t()).abs().max().item() < 1e-5 * (x @ weight.t()).abs().max().item(), rows
