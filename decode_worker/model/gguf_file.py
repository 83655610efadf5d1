"""A GGUF file's metadata and tensor table, tensors memory-mapped."""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 8  # ggml's own limit is 4
_STRING, _ARRAY = 8, 9
_LENGTH = struct.Struct("<Q")
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


class GGUFFormatError(ValueError):
    """Not a readable GGUF file."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # dimensions as stored, fastest-varying first
    data: np.ndarray  # read-only view of the mapped file


@dataclass(frozen=True)
class GGUFFile:
    fields: dict[str, Any]  # metadata: str, int, float, bool, or a list of them
    tensors: list[GGUFTensor]


class _Cursor:
    """Little-endian reads from ``buf``, never past its end."""

    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if n < 0 or end > len(self.buf):
            raise GGUFFormatError(f"truncated at byte {self.pos} (wanted {n} more)")
        part, self.pos = self.buf[self.pos:end], end
        return part

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return bytes(self.take(self.unpack("<Q"))).decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        """``count`` strings in one tight loop: a tokenizer's vocabulary and merges are most of a file's metadata."""
        buf, pos, end_of_buf = self.buf, self.pos, len(self.buf)
        length_at = _LENGTH.unpack_from
        out = []
        for _ in range(count):
            if pos + 8 > end_of_buf:
                raise GGUFFormatError(f"truncated at byte {pos} (wanted 8 more)")
            end = pos + 8 + length_at(buf, pos)[0]
            if end > end_of_buf:
                raise GGUFFormatError(f"truncated at byte {pos + 8} (wanted {end - pos - 8} more)")
            out.append(str(buf[pos + 8:end], "utf-8", "replace"))
            pos = end
        self.pos = pos
        return out

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.unpack("<I"), self.unpack("<Q")
            if item == _ARRAY:
                raise GGUFFormatError("nested metadata arrays are not supported")
            if item in _SCALARS:  # one read for the whole run of numbers
                fmt = _SCALARS[item]
                size = struct.calcsize(fmt)
                return list(struct.unpack(f"<{count}{fmt[1]}", self.take(size * count)))
            if item == _STRING:
                return self.strings(count)
            return [self.value(item) for _ in range(count)]
        raise GGUFFormatError(f"unknown metadata value type {kind}")


def read_gguf(path: Path) -> GGUFFile:
    """Parse header, metadata and tensor table."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if path.stat().st_size == 0:  # numpy cannot map an empty file
        raise GGUFFormatError("empty file")
    mapped = np.memmap(path, mode="r", dtype=np.uint8)
    cur = _Cursor(memoryview(mapped))
    if bytes(cur.take(4)) != MAGIC:
        raise GGUFFormatError("no GGUF magic")
    version = cur.unpack("<I")
    if version not in VERSIONS:
        raise GGUFFormatError(f"GGUF version {version} (supported: {', '.join(map(str, VERSIONS))}; big-endian files "
                              "show as a huge version)")
    n_tensors, n_fields = cur.unpack("<Q"), cur.unpack("<Q")
    fields: dict[str, Any] = {}
    for _ in range(n_fields):
        key = cur.string()
        if key in fields:
            raise GGUFFormatError(f"metadata key {key!r} appears twice")
        fields[key] = cur.value(cur.unpack("<I"))
    table = []
    for _ in range(n_tensors):
        name, n_dims = cur.string(), cur.unpack("<I")
        if n_dims > MAX_DIMS:
            raise GGUFFormatError(f"tensor {name!r} has {n_dims} dimensions")
        dims = [cur.unpack("<Q") for _ in range(n_dims)]
        table.append((name, dims, cur.unpack("<I"), cur.unpack("<Q")))
    alignment = int(fields.get("general.alignment", DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise GGUFFormatError(f"general.alignment {alignment} is not a power of two")
    start = -(-cur.pos // alignment) * alignment
    tensors, names = [], set()
    for name, dims, raw_type, offset in table:
        if name in names:
            raise GGUFFormatError(f"tensor {name!r} appears twice")
        names.add(name)
        try:
            kind = GGMLQuantizationType(raw_type)
        except ValueError:
            raise GGUFFormatError(f"tensor {name!r} has unknown type {raw_type}") from None
        tensors.append(GGUFTensor(name, kind, np.array(dims, dtype=np.uint64),
                                  _tensor_data(mapped, start + offset, dims, kind, GGML_QUANT_SIZES[kind], name)))
    return GGUFFile(fields, tensors)


def _tensor_data(mapped: np.memmap, offset: int, dims: list[int], kind: Any, sizes: tuple[int, int],
                 name: str) -> np.ndarray:
    """A tensor's bytes shaped as the gguf package does."""
    block, type_size = sizes
    elements = math.prod(dims)
    shape = tuple(reversed(dims))
    if not shape or shape[-1] % block:
        raise GGUFFormatError(f"tensor {name!r}: shape {shape} is not whole {kind.name} blocks")
    n_bytes = elements * type_size // block
    if offset + n_bytes > mapped.size:
        raise GGUFFormatError(f"tensor {name!r} ends past the end of the file")
    raw = mapped[offset:offset + n_bytes]
    dtype = _PLAIN_TYPES.get(kind.name)
    if dtype is not None:
        return raw.view(dtype).reshape(shape)
    return raw.reshape(*shape[:-1], shape[-1] // block * type_size)


_PLAIN_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                "I32": np.int32, "I64": np.int64}
