"""The L3 store interface and the self-checking page record; one failing ``decode_record`` is a miss."""
from __future__ import annotations

import errno
import struct
import zlib
from abc import ABC, abstractmethod

MAGIC = b"DWKV"
VERSION = 1
# A record: magic, version, reserved, layout fingerprint, page key, payload length (_HEAD), then a crc32 over
# _HEAD and the payload (_CRC), then the payload: the page's bytes in the pool dtype. Little endian.
_HEAD = struct.Struct("<4sHH16s32sQ")
_CRC = struct.Struct("<I")
HEADER_BYTES = _HEAD.size + _CRC.size

# Failure reasons of a record that did not verify (label values of storage_failures_total{reason}).
SHORT, CORRUPT, FOREIGN = "short", "corrupt", "foreign"


class RecordError(ValueError):
    """A record not to load; ``reason``: SHORT, CORRUPT or FOREIGN."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def seal_record(record: bytearray | memoryview, key: str, fingerprint: str) -> None:
    """Write the header before the payload already in ``record``."""
    view = memoryview(record)
    payload = view[HEADER_BYTES:]
    head = _HEAD.pack(MAGIC, VERSION, 0, bytes.fromhex(fingerprint), bytes.fromhex(key), len(payload))
    view[: _HEAD.size] = head
    _CRC.pack_into(view, _HEAD.size, zlib.crc32(head, zlib.crc32(payload)))


def encode_record(key: str, fingerprint: str, payload: bytes | memoryview) -> bytearray:
    record = bytearray(HEADER_BYTES + len(payload))
    record[HEADER_BYTES:] = payload
    seal_record(record, key, fingerprint)
    return record


def decode_record(record: bytes, key: str, fingerprint: str, payload_bytes: int) -> memoryview:
    """The payload if ``record`` is an intact page of ``key`` in our layout, else RecordError."""
    if len(record) < HEADER_BYTES:
        raise RecordError(SHORT, f"{len(record)} bytes, the header alone is {HEADER_BYTES}")
    magic, version, _, fp, rec_key, length = _HEAD.unpack_from(record)
    if magic != MAGIC or version != VERSION:
        raise RecordError(CORRUPT, f"magic {magic!r} version {version}")
    ours = bytes.fromhex(fingerprint)
    if length != payload_bytes:
        raise RecordError(FOREIGN if fp != ours else CORRUPT, f"payload length {length}, our pages are {payload_bytes}")
    body = memoryview(record)[HEADER_BYTES:]
    if len(body) != length:
        raise RecordError(SHORT if len(body) < length else CORRUPT, f"{len(body)} payload bytes, header says {length}")
    (crc,) = _CRC.unpack_from(record, _HEAD.size)
    if zlib.crc32(record[: _HEAD.size], zlib.crc32(body)) != crc:
        raise RecordError(CORRUPT, "checksum mismatch")
    if fp != ours:
        raise RecordError(FOREIGN, f"layout fingerprint {fp.hex()} is not ours ({fingerprint})")
    if rec_key != bytes.fromhex(key):
        raise RecordError(CORRUPT, f"record of page {rec_key.hex()} stored under {key}")
    return body


class StoreBackend(ABC):
    """Async key -> record store; what raises is a counted miss."""

    name: str

    @abstractmethod
    async def exists(self, keys: list[str]) -> int:
        """How many of ``keys``, from the first, are present."""

    @abstractmethod
    async def get(self, keys: list[str]) -> list[bytes | None]:
        """Each key's record (unverified), None where absent."""

    @abstractmethod
    async def put(self, keys: list[str], records: list[memoryview]) -> None:
        """Store records; a present key may keep its own (keys address content)."""

    @abstractmethod
    async def delete(self, keys: list[str]) -> None:
        """Remove keys (failed records)."""

    def failure_reason(self, exc: Exception) -> str:
        """``down``, ``timeout``, ``full`` or ``error``."""
        if isinstance(exc, TimeoutError):
            return "timeout"
        if isinstance(exc, ConnectionError):
            return "down"
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return "full"
        return "error"

    async def close(self) -> None:
        """Release connections (none by default)."""
