"""The native low-bit CPU kernels: Q4_1 and Q8_0 matmuls equal the dequantized float32 matmul up to float32
rounding at every row count (the kernel works in groups of 8 rows), bf16 in and out round only where bf16 must, bad
inputs are refused."""
from __future__ import annotations

import pytest
import torch
from decode_worker_kernels.cpu_lowbit import LowBitMatmul

from decode_worker.model.quant import Q4Blocks, Q8Blocks

ROW_COUNTS = (1, 3, 8, 9, 16, 21)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def q4_blocks(rows: int, cols: int, seed: int) -> Q4Blocks:
    g = generator(seed)
    return Q4Blocks(torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8),
                    torch.rand(rows, cols // 32, generator=g) * 0.1 + 0.01, -torch.rand(rows, cols // 32, generator=g))


def q8_blocks(rows: int, cols: int, seed: int) -> Q8Blocks:
    g = generator(seed)
    scale = (torch.rand(rows, cols // 32, generator=g) * 0.01).half().float()  # GGUF's scales are fp16
    return Q8Blocks(torch.randint(-127, 128, (rows, cols), generator=g, dtype=torch.int8), scale)



def matmuls(native_lib, rows: int, cols: int, seed: int) -> list[tuple[LowBitMatmul, torch.Tensor]]:
    q4, q8 = q4_blocks(rows, cols, seed), q8_blocks(rows, cols, seed + 1)
    return [(LowBitMatmul.q4_1(native_lib, q4.codes, q4.scale, q4.minimum), q4.dequantize()),
            (LowBitMatmul.q8_0(native_lib, q8.codes, q8.scale), q8.dequantize())]


@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_float32_results_are_the_dequantized_matmul_up_to_float32_rounding(native_lib, rows):
    """As close to the float64 product as torch's own float32 matmul of the dequantized weight (a wrong nibble order,
    scale or row group would be off by whole weights)."""
    for matmul, weight in matmuls(native_lib, 48, 256, seed=rows):
        x = torch.randn(rows, 256, generator=generator(100 + rows))
        exact = x.double() @ weight.double().t()
        ours = matmul(x)
        assert ours.dtype == torch.float32 and ours.shape == (rows, 48)
        ours_err = (ours.double() - exact).abs().max().item()
        torch_err = ((x @ weight.t()).double() - exact).abs().max().item()
        assert ours_err <= 4 * torch_err + 1e-6 * exact.abs().max().item(), (ours_err, torch_err)


@pytest.mark.parametrize("rows", (1, 9))
def test_bf16_in_and_out_round_only_the_ends(native_lib, rows):
    for matmul, weight in matmuls(native_lib, 32, 128, seed=rows):
        x = torch.randn(rows, 128, generator=generator(rows)).bfloat16()
        exact = x.double() @ weight.double().t()  # the bf16 input is what the kernel reads
        ours = matmul(x)
        assert ours.dtype == torch.bfloat16
        assert torch.equal(ours, exact.float().bfloat16()) or (ours.double() - exact).abs().max().item() <= (
            2**-8 * exact.abs().max().item())
        as_float = LowBitMatmul(native_lib, matmul.kind, matmul.codes, matmul.tables, (32, 128), out_dtype=torch.float32)(x)
        assert as_float.dtype == torch.float32
        assert (as_float.double() - exact).abs().max().item() < 1e-5 * exact.abs().max().item()


def test_leading_dimensions_and_empty_inputs_keep_their_shape(native_lib):
    (matmul, weight), _ = matmuls(native_lib, 16, 64, seed=3)
    x = torch.randn(2, 3, 64, generator=generator(3))
    assert matmul(x).shape == (2, 3, 16)
    assert torch.allclose(matmul(x), x @ weight.t(), atol=1e-5)
    assert matmul(torch.empty(0, 64)).shape == (0, 16)
    strided = torch.randn(64, 4, generator=generator(4)).t()  # rows not contiguous: copied, not misread
    assert torch.allclose(matmul(strided), strided @ weight.t(), atol=1e-5)


def test_bad_inputs_and_shapes_are_refused(native_lib):
    (matmul, _), _ = matmuls(native_lib, 16, 64, seed=5)
    with pytest.raises(ValueError, match="float32 or bf16"):
        matmul(torch.randn(2, 64).half())
    with pytest.raises(ValueError, match=r"\[\.\.\., 64\]"):
        matmul(torch.randn(2, 32))
    odd = q4_blocks(8, 64, seed=6)  # 8 outputs: not a whole tile of 16
    with pytest.raises(ValueError, match="does not tile"):
        LowBitMatmul.q4_1(native_lib, odd.codes, odd.scale, odd.minimum)
