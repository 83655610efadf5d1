"""The L3 tier: page records in a folder or on Redis / Valkey, behind ``StorageTier``."""
from __future__ import annotations

import os
from pathlib import Path

from decode_worker.cache.storage.base import (
    RecordError,
    StoreBackend,
    decode_record,
    encode_record,
)
from decode_worker.cache.storage.file_store import FileStore
from decode_worker.cache.storage.prefetch_policy import PrefetchPolicy
from decode_worker.cache.storage.tier import Prefetch, StorageTier

__all__ = [
    "FileStore", "Prefetch", "PrefetchPolicy", "RecordError", "StorageTier", "StoreBackend",
    "decode_record", "default_folder", "encode_record",
]


def default_folder() -> Path:
    """The file backend's folder without --hicache-storage-url."""
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "decode-worker" / "kv"
