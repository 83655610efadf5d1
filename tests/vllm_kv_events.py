"""vLLM's KV event message types as msgspec structs, written from the layout current vLLM documents, in both of
its encodings: ``array`` (events ``array_like``, vLLM before 0.24) and ``map`` (each event a map tagged by
``type``, vLLM since 0.24). The batch is ``array_like`` in both. A consumer built on these types decodes a
worker's payload exactly as one built on vLLM's own would: a missing or mistyped field fails the decode."""
from __future__ import annotations

import msgspec


class ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    """An event of the ``array`` encoding: the tag, then its fields in order."""


class ArrayBlockStored(ArrayEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class ArrayBlockRemoved(ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class ArrayAllBlocksCleared(ArrayEvent, tag="AllBlocksCleared"):
    pass


class MapEvent(msgspec.Struct, omit_defaults=True, tag=True):
    """An event of the ``map`` encoding: ``{"type": tag, field: value, ...}``; fields it does not know are
    skipped, as vLLM's newer optional ones (``event_version``, ``group_idx``, ...) would be."""


class MapBlockStored(MapEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None


class MapBlockRemoved(MapEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class MapAllBlocksCleared(MapEvent, tag="AllBlocksCleared"):
    pass


class ArrayBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared]
    data_parallel_rank: int | None = None


class MapBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[MapBlockStored | MapBlockRemoved | MapAllBlocksCleared]
    data_parallel_rank: int | None = None


DECODERS = {"array": msgspec.msgpack.Decoder(ArrayBatch), "map": msgspec.msgpack.Decoder(MapBatch)}
STORED = (ArrayBlockStored, MapBlockStored)
REMOVED = (ArrayBlockRemoved, MapBlockRemoved)
CLEARED = (ArrayAllBlocksCleared, MapAllBlocksCleared)


def decode(payload: bytes, encoding: str) -> ArrayBatch | MapBatch:
    """One message's payload, decoded as a consumer of ``encoding`` would; ``msgspec.ValidationError`` if it is
    not that encoding's layout."""
    return DECODERS[encoding].decode(payload)
