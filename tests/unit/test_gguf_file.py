"""Our GGUF reader gives what the gguf package's reader gives (metadata values, tensor types, shapes and bytes),
and refuses damaged files with a reason instead of reading past them."""
from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from decode_worker.model.gguf_file import GGUFFormatError, read_gguf


def write_small(path, tensors: dict[str, np.ndarray], types: dict[str, gguf.GGMLQuantizationType] | None = None):
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", 2)
    writer.add_float32("llama.rope.freq_base", 10000.5)
    writer.add_bool("some.flag", True)
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "a", "bé", ""])
    writer.add_array("tokenizer.ggml.scores", [0.0, -1.5, 2.25, 3.0])
    for name, array in tensors.items():
        kind = (types or {}).get(name)
        if kind is None:
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def assert_same_as_gguf_reader(path) -> None:
    ours, ref = read_gguf(path), gguf.GGUFReader(str(path))
    assert set(ours.fields) == {k for k in ref.fields if not k.startswith("GGUF.")}
    for key, field in ref.fields.items():
        if not key.startswith("GGUF."):
            want = field.contents()
            assert ours.fields[key] == pytest.approx(want) if isinstance(want, float) else ours.fields[key] == want
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.tensor_type == b.tensor_type and a.shape.tolist() == b.shape.tolist(), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape and np.array_equal(a.data, b.data)


def test_a_small_file_reads_as_the_gguf_package_reads_it(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {"token_embd.weight": rng.standard_normal((8, 64), dtype=np.float32),
               "blk.0.attn_q.weight": rng.standard_normal((4, 64), dtype=np.float32),
               "output_norm.weight": rng.standard_normal(64).astype(np.float16)}
    write_small(tmp_path / "m.gguf", tensors, {"blk.0.attn_q.weight": gguf.GGMLQuantizationType.Q4_1})
    assert_same_as_gguf_reader(tmp_path / "m.gguf")


def test_the_embedded_model_reads_as_the_gguf_package_reads_it(smollm2_path):
    assert_same_as_gguf_reader(smollm2_path)


@pytest.fixture
def small(tmp_path):
    path = tmp_path / "m.gguf"
    write_small(path, {"token_embd.weight": np.ones((4, 32), dtype=np.float32)})
    return path


def test_a_cut_short_file_is_refused(small):
    """At every byte: inside a key, a string array (the vocabulary's fast path), the tensor table or the data."""
    data = small.read_bytes()
    for keep in range(len(data)):
        small.write_bytes(data[:keep])
        with pytest.raises(GGUFFormatError, match="truncated|past the end|magic|empty"):
            read_gguf(small)


def test_a_wrong_version_and_a_huge_string_length_are_refused(small):
    data = bytearray(small.read_bytes())
    data[4:8] = struct.pack("<I", 1)
    small.write_bytes(bytes(data))
    with pytest.raises(GGUFFormatError, match="version 1"):
        read_gguf(small)
    data[4:8] = struct.pack("<I", 3)
    data[24:32] = struct.pack("<Q", 2**62)  # the first key's length
    small.write_bytes(bytes(data))
    with pytest.raises(GGUFFormatError, match="truncated"):
        read_gguf(small)
