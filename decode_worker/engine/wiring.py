"""Cache parts and the PD data plane built from the flags."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

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
    from decode_worker.pd.sglang_peer import SGLangPrefillSource

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelFacts:
    """What the PD half needs of the loaded model and its cache."""

    name: str  # the served model name: an SGLang prefill must serve the same
    vocab_size: int  # prefill's first token must be below it
    hidden_size: int  # SGLang's aux slot holds a hidden state of this size
    free_pages: Callable[[np.ndarray], None]  # the cache's: fenced L1 pages go back through it


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


def open_pd(cfg: ServerConfig, pool: KVPool, metrics: Metrics, model: ModelFacts,
            ) -> tuple[DeltaKVFetcher | SGLangPrefillSource | None, KVHandoff | None]:
    """The role's PD half over a NIXL agent registering ``pool`` (colocated: None, None)."""
    if cfg.role not in ("decode", "prefill"):
        return None, None
    from decode_worker.transfer.agent import KVAgent

    for warning in unused_ucx_flags(cfg):
        log.warning(warning)
    agent = KVAgent(pool.buffer, cfg.role, pool.shared)
    if cfg.role == "decode" and cfg.pd_peer_protocol == "sglang":
        from decode_worker.pd.sglang_peer import SGLangPrefillSource

        return SGLangPrefillSource(cfg, pool, agent, metrics, vocab_size=model.vocab_size,
                                   hidden_size=model.hidden_size, model_name=model.name,
                                   free_pages=model.free_pages), None
    if cfg.role == "decode":
        from decode_worker.pd.decode import DeltaKVFetcher

        return DeltaKVFetcher(cfg, pool, agent, metrics, model.vocab_size), None
    from decode_worker.pd.prefill import KVHandoff

    return None, KVHandoff(cfg, pool, agent, metrics)
