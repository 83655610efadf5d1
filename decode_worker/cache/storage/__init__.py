"""L3 storage tier: page records in a folder or a Redis / Valkey server, behind the StorageTier the cache calls."""
from __future__ import annotations

import os
from pathlib import Path

from decode_worker.cache.pool import KVLayout
from decode_worker.cache.storage.base import RecordError, StoreBackend, decode_record, encode_record
from decode_worker.cache.storage.file_store import FileStore
from decode_worker.cache.storage.prefetch_policy import PrefetchPolicy
from decode_worker.cache.storage.tier import Prefetch, StorageTier
from decode_worker.config import ServerConfig

__all__ = [
    "FileStore", "Prefetch", "PrefetchPolicy", "RecordError", "StorageTier", "StoreBackend",
    "decode_record", "default_folder", "encode_record", "open_storage",
]


def default_folder() -> Path:
    """Where the file backend keeps pages when no --hicache-storage-url is given."""
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "decode-worker" / "kv"


def open_storage(cfg: ServerConfig, layout: KVLayout) -> StorageTier | None:
    """The StorageTier the flags ask for, or None for ``--hicache-storage-backend none``."""
    if cfg.hicache_storage_backend == "none":
        return None
    if cfg.hicache_storage_backend == "redis":
        from decode_worker.cache.storage.redis_store import RedisStore  # only redis deployments import the client

        backend: StoreBackend = RedisStore(cfg.hicache_storage_url)
    else:
        backend = FileStore(cfg.hicache_storage_url or default_folder(), int(cfg.hicache_storage_file_max_gb * 1e9))
    policy = PrefetchPolicy(
        cfg.hicache_storage_prefetch_policy,
        base_s=cfg.hicache_storage_prefetch_timeout_base_s,
        per_1k_tokens_s=cfg.hicache_storage_prefetch_timeout_per_1k_tokens_s,
        cap_s=cfg.hicache_storage_prefetch_timeout_cap_s,
    )
    return StorageTier(backend, layout, policy)
