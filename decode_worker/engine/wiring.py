"""Cache parts and the PD data plane built from the flags."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from decode_worker.cache.hicache import HierarchicalCache
from decode_worker.cache.kv_events import AllBlocksCleared, TreeEvents
from decode_worker.cache.pool import KVLayout, KVPool
from decode_worker.cache.storage import (
    FileStore,
    PrefetchPolicy,
    StorageTier,
    StoreBackend,
    default_folder,
)
from decode_worker.config import ServerConfig
from decode_worker.engine.kv_event_publisher import ZmqEventPublisher, binds
from decode_worker.metrics import Metrics

if TYPE_CHECKING:
    from decode_worker.pd.decode import DeltaKVFetcher
    from decode_worker.pd.prefill import KVHandoff

log = logging.getLogger(__name__)


def open_storage(cfg: ServerConfig, layout: KVLayout) -> StorageTier | None:
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


def open_kv_events(cfg: ServerConfig, cache: HierarchicalCache, metrics: Metrics) -> ZmqEventPublisher | None:
    """The ``--kv-events-config`` publisher, or None; it opens with ``AllBlocksCleared``."""
    settings = cfg.kv_events
    if settings is None:
        return None
    publisher = ZmqEventPublisher(**settings, on_drop=metrics.kv_events_dropped.inc)
    publisher.put(AllBlocksCleared())
    cache.tree.events = TreeEvents(cache.tree, publisher.put)
    log.info("KV events: %s %s, topic %r%s", "bound to" if binds(publisher.endpoint) else "connected to",
             publisher.endpoint, settings.get("topic", ""),
             f", replay on {publisher.replay_endpoint}" if publisher.replay_endpoint else "")
    return publisher


def unused_ucx_flags(cfg: ServerConfig) -> list[str]:
    """A line per UCX flag set: accepted, but NIXL replaced their data plane."""
    given = [(flag, value) for flag, value, default in (("--ucx-host", cfg.ucx_host, "127.0.0.1"),
                                                        ("--ucx-port", cfg.ucx_port, 0)) if value != default]
    return [f"{flag} {value} is not used: decode reads KV from prefill over NIXL, at the address in the prefill "
            "agent's metadata, and listens for none" for flag, value in given]


def open_pd(cfg: ServerConfig, pool: KVPool, metrics: Metrics,
            vocab_size: int) -> tuple[DeltaKVFetcher | None, KVHandoff | None]:
    """The role's PD half over a NIXL agent registering ``pool`` (colocated: None, None)."""
    if cfg.role not in ("decode", "prefill"):
        return None, None
    from decode_worker.transfer.agent import KVAgent

    for warning in unused_ucx_flags(cfg):
        log.warning(warning)
    agent = KVAgent(pool.buffer, cfg.role, pool.shared)
    if cfg.role == "decode":
        from decode_worker.pd.decode import DeltaKVFetcher

        return DeltaKVFetcher(cfg, pool, agent, metrics, vocab_size), None
    from decode_worker.pd.prefill import KVHandoff

    return None, KVHandoff(cfg, pool, agent, metrics)
