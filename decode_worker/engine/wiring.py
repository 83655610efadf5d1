"""Cache parts built from the server's flags (the cache package itself knows nothing of flags)."""
from __future__ import annotations

from decode_worker.cache.pool import KVLayout
from decode_worker.cache.storage import (
    FileStore,
    PrefetchPolicy,
    StorageTier,
    StoreBackend,
    default_folder,
)
from decode_worker.config import ServerConfig


def open_storage(cfg: ServerConfig, layout: KVLayout) -> StorageTier | None:
    """The StorageTier the flags ask for, or None for ``--hicache-storage-backend none``."""
    if cfg.hicache_storage_backend == "none":
        return None
    if cfg.hicache_storage_backend == "redis":
        from decode_worker.cache.storage.redis_store import (
            RedisStore,  # only redis deployments import the client
        )

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
