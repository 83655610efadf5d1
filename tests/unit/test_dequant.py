"""Our whole-tensor dequantize gives the gguf package's float32 values bit for bit: on every tensor of the
embedded SmolLM2 and on synthetic blocks with edge-case scales (signed zeros, infinities, NaN, subnormals)."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as package_dequantize
from gguf.quants import quantize

from decode_worker.model.dequant import dequantize
from decode_worker.model.gguf_file import read_gguf

EDGE_HALVES = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 6.1e-5, -6e-8, 65504.0, -65504.0, 1.0, -0.5, 0.0999],
                       dtype=np.float16)


def assert_bit_exact(data: np.ndarray, kind: GGMLQuantizationType) -> None:
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 in the edge blocks
        want = np.asarray(package_dequantize(data, kind), dtype=np.float32)
        got = dequantize(data, kind)
    assert got.dtype == np.float32 and got.shape == want.shape and got.flags.writeable
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def synthetic_blocks(rng: np.random.Generator, rows: int, blocks_per_row: int, halves: int, body: int) -> np.ndarray:
    """Random bytes whose leading ``halves`` fp16 fields take every edge value along with random ones."""
    raw = rng.integers(0, 256, size=(rows * blocks_per_row, 2 * halves + body), dtype=np.uint8)
    scales = rng.choice(EDGE_HALVES, size=(raw.shape[0], halves))
    scales[: len(EDGE_HALVES), 0] = EDGE_HALVES
    scales[: len(EDGE_HALVES), -1] = EDGE_HALVES[::-1]
    raw[:, : 2 * halves] = scales.view(np.uint8)
    return raw.reshape(rows, -1)


def test_q4_1_edge_scales_and_minimums():
    data = synthetic_blocks(np.random.default_rng(0), rows=6, blocks_per_row=4, halves=2, body=16)
    assert_bit_exact(data, GGMLQuantizationType.Q4_1)


def test_q4_1_nibble_order():
    block = np.zeros(20, dtype=np.uint8)
    block[0:2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    block[4:] = np.arange(16, dtype=np.uint8) | (np.arange(16, dtype=np.uint8)[::-1] << 4)
    got = dequantize(block.reshape(1, 20), GGMLQuantizationType.Q4_1)
    assert got.tolist() == [list(range(16)) + list(range(15, -1, -1))]


def test_q8_0_edge_scales():
    data = synthetic_blocks(np.random.default_rng(1), rows=5, blocks_per_row=3, halves=1, body=32)
    assert_bit_exact(data, GGMLQuantizationType.Q8_0)


@pytest.mark.parametrize("kind", [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q5_0])
def test_quantized_values_round_trip(kind):
    """Includes a type decoded by the package fallback."""
    values = np.random.default_rng(2).standard_normal((8, 64)).astype(np.float32)
    assert_bit_exact(quantize(values, kind), kind)


@pytest.mark.parametrize("dtype,kind", [(np.float32, GGMLQuantizationType.F32), (np.float16, GGMLQuantizationType.F16)])
def test_plain_floats(dtype, kind):
    values = np.array([[0.0, -0.0, np.inf, -1.5], [np.nan, 1e-3, 7.0, -np.inf]], dtype=dtype)
    values.flags.writeable = False  # as mapped from the file
    assert_bit_exact(values, kind)


def test_every_smollm2_tensor(smollm2_path):
    reader = read_gguf(smollm2_path)
    kinds = {t.tensor_type.name for t in reader.tensors}
    assert {"Q4_1", "Q8_0"} <= kinds
    for t in reader.tensors:
        assert_bit_exact(t.data, t.tensor_type)
