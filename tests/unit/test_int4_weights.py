"""GGUF Q4_1 weights kept 4-bit: block parsing, the kernel's scale/zero convention, and the quantized model against
the dequantized one."""
from __future__ import annotations

from types import NoneType

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from decode_worker.model.loader import load_model
from decode_worker.model.matmul import DenseLinear, HalfLinear, PackedLinear, packs, packs_bf16
from decode_worker.model import quant
from decode_worker.model.quant import (Q4_GROUP, Int4Linear, NativeInt4Matmul, Q4Blocks, TorchInt4Matmul,
                                       kernel_scales_and_zeros)


def random_blocks(rows: int, cols: int, seed: int = 0) -> Q4Blocks:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8)
    scale = torch.rand(rows, cols // 32, generator=g) * 0.1 + 0.01
    minimum = -torch.rand(rows, cols // 32, generator=g) * 0.8  # not -8 * scale: a wrong zero point shows
    return Q4Blocks(codes, scale, minimum)


def test_gguf_q4_1_bytes_parse_to_the_values_gguf_dequantizes():
    w = np.random.default_rng(0).standard_normal((16, 96)).astype(np.float32)
    raw = quantize(w, GGMLQuantizationType.Q4_1)
    ours = Q4Blocks.from_gguf(raw, 16, 96).dequantize()
    assert torch.equal(ours, torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_1).astype(np.float32)))


def test_torch_int4_kernel_computes_the_q4_1_blocks_matmul():
    """The fallback where the native kernels do not build: Q4_1's ``d * q + m`` mapped onto torch's ``(q - 8) *
    scale + zero`` (float32 activations and table: exact up to summation order)."""
    blocks = random_blocks(64, 128)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    layer = TorchInt4Matmul(blocks, torch.float32)
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, layer.packed, Q4_GROUP,
                                                     kernel_scales_and_zeros(blocks, torch.float32))
    assert (out - x @ blocks.dequantize().t()).abs().max().item() < 1e-4


def test_wide_inputs_use_the_dense_copy_and_agree_with_the_int4_kernel():
    blocks = random_blocks(64, 128, seed=2)
    layer = Int4Linear(blocks, torch.bfloat16, wide_from_rows=8)
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(3)).bfloat16()
    wide = layer(x)  # 8 rows: dense
    narrow = torch.cat([layer(x[i : i + 4]) for i in (0, 4)])  # 4 rows each: int4 kernel
    ref = x.float() @ blocks.dequantize().t()
    scale = ref.abs().max().item()
    assert (wide.float() - ref).abs().max().item() < 0.02 * scale
    assert (narrow.float() - ref).abs().max().item() < 0.02 * scale
    assert isinstance(layer.wide, PackedLinear if packs_bf16() else DenseLinear)


def test_narrow_inputs_use_the_native_kernel_where_it_builds(monkeypatch):
    blocks = random_blocks(64, 128, seed=6)
    assert isinstance(Int4Linear(blocks, torch.float32).narrow,
                      NativeInt4Matmul if quant.native_kernels() is not None else TorchInt4Matmul)
    monkeypatch.setattr(quant, "native_kernels", lambda: None)
    assert isinstance(Int4Linear(blocks, torch.float32).narrow, TorchInt4Matmul)


def test_exact_float32_keeps_float32_weights_for_wide_inputs():
    blocks = random_blocks(64, 128, seed=8)
    layer = Int4Linear(blocks, torch.float32, wide_from_rows=6, exact=True)
    assert isinstance(layer.wide, PackedLinear if packs(torch.float32) else DenseLinear)
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(9))
    assert (layer(x) - x @ blocks.dequantize().t()).abs().max().item() < 1e-5


def test_float32_activations_without_native_kernels_run_torchs_in_bf16_and_wide_inputs_in_fp16(monkeypatch):
    """float32 in and out, torch's forms: narrow inputs through the bf16-vectorized int4 kernel, wide ones through
    the fp16-packed copy, both close to the dequantized float32 matmul (fp16 weights far closer than bf16
    activations)."""
    monkeypatch.setattr(quant, "native_kernels", lambda: None)
    blocks = random_blocks(64, 128, seed=6)
    layer = Int4Linear(blocks, torch.float32, wide_from_rows=6)
    assert layer.narrow.kernel_dtype == torch.bfloat16 and isinstance(layer.wide, HalfLinear)
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(7))
    ref = x @ blocks.dequantize().t()
    scale = ref.abs().max().item()
    wide, narrow = layer(x), torch.cat([layer(x[i : i + 4]) for i in (0, 4)])
    assert wide.dtype == narrow.dtype == torch.float32
    assert (wide - ref).abs().max().item() < 1e-3 * scale
    assert (narrow - ref).abs().max().item() < 0.01 * scale


def test_q4_blocks_stack_rows_in_order():
    a, b = random_blocks(8, 32, seed=4), random_blocks(16, 32, seed=5)
    both = Q4Blocks.stack([a, b])
    assert torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))


def test_a_bad_shape_is_refused():
    with pytest.raises(ValueError, match="cannot be packed"):
        Int4Linear(random_blocks(6, 32), torch.float32)


@pytest.fixture(scope="module")
def smollm2_models(smollm2_path):
    return (load_model(smollm2_path, dtype=torch.bfloat16, tokenizer=False),
            load_model(smollm2_path, dtype=torch.bfloat16, tokenizer=False, int4=False))


def test_smollm2_in_bf16_keeps_every_layer_matrix_4bit(smollm2_models):
    quantized, dense = smollm2_models
    assert quantized.int4_layers == 4 * quantized.config.num_layers  # qkv, o, gate_up, down
    assert dense.int4_layers == 0
    assert quantized.weights_digest != dense.weights_digest


def assert_tail_logits_track(models, rows: int) -> None:
    """The last ``rows`` tokens' logits (over a cached prefix) of the low-bit model stay close to the other's."""
    from decode_worker.model.runner import ModelRunner

    ids = [1, 504, 3458, 282, 4649, 314, 1029, 30, 198, 2] * 4
    outs = []
    for loaded in models:
        runner = ModelRunner(loaded, max_total_tokens=256, page_size=16)
        pages = list(range(1, 4))
        runner.forward(runner.build_batch([ids[: 40 - rows]], [0], [pages]))
        outs.append(runner.forward(runner.build_batch([ids[40 - rows :]], [40 - rows], [pages], all_logits=True)))
    low_bit, reference = outs
    assert (low_bit - reference).abs().max().item() < 0.05 * reference.abs().max().item()
    assert (low_bit.argmax(-1) == reference.argmax(-1)).float().mean().item() >= 0.9


@pytest.mark.parametrize("rows", [1, 4, 32])
def test_quantized_model_logits_stay_close_to_the_dequantized_model(smollm2_models, rows):
    """The int4 kernel (few rows) and the dense copy (many) both track the dequantized bf16 model: the same weights,
    only the matmul's rounding differs."""
    assert_tail_logits_track(smollm2_models, rows)


@pytest.fixture(scope="module")
def smollm2_float32_models(smollm2_path):
    return (load_model(smollm2_path, dtype=torch.float32, tokenizer=False, low_bit_float32=True),
            load_model(smollm2_path, dtype=torch.float32, tokenizer=False))


def test_float32_rounds_weights_to_fp16_only_when_asked(smollm2_float32_models):
    """Low-bit float32 reads fp16 weights for many rows; exact float32 keeps the 4-bit layers only where the native
    kernels do float32 math on them, and float32 weights for many rows. Their KV differs, and so do their digests."""
    low_bit, exact = smollm2_float32_models
    native = quant.native_kernels() is not None
    assert low_bit.int4_layers == 4 * low_bit.config.num_layers
    head = low_bit.model.head_matmul
    assert isinstance(head.wide if native else head, HalfLinear)
    if native:
        layer = exact.model.layers[0].mlp.gate_up_proj
        assert exact.int4_layers == 4 * exact.config.num_layers and isinstance(layer.narrow, NativeInt4Matmul)
        assert isinstance(layer.wide, PackedLinear if packs(torch.float32) else DenseLinear)
        assert isinstance(exact.model.head_matmul.wide, PackedLinear if packs(torch.float32) else DenseLinear)
    else:
        assert exact.int4_layers == 0
        assert isinstance(exact.model.head_matmul, PackedLinear if packs(torch.float32) else NoneType)
    assert low_bit.weights_digest != exact.weights_digest


@pytest.mark.parametrize("rows", [1, 4, 32])
def test_low_bit_float32_logits_stay_close_to_the_exact_float32_model(smollm2_float32_models, rows):
    """The int4 kernel in bf16 (few rows), fp16-packed weights (many) and the fp16 vocabulary matrix all track the
    dequantized float32 model."""
    assert_tail_logits_track(smollm2_float32_models, rows)
