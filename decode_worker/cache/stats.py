"""What the cache reports: pages per tier and state, token counters, the L3 tier's figures. ``to_dict()`` is
the ``cache`` object of ``/server_info``: its keys and nesting are API.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class TierPages:
    """Pages of one tier by state: free + used + evictable + locked = total. ``used``: allocated but not
    evictable (request pages, drains, L2 copies of L1 nodes, prefetch pages); ``locked``: tree pages held."""

    total: int
    free: int
    used: int
    evictable: int
    locked: int

    STATES = ("free", "used", "evictable", "locked")  # what the cache_pages metric exports (not ``total``)

    def by_state(self) -> dict[str, int]:
        return {s: getattr(self, s) for s in self.STATES}


@dataclass(frozen=True)
class StorageStats:
    """The L3 tier: its backend, whether its circuit is open, token counters and failures per op and reason."""

    backend: str
    down: bool
    prefetched_tokens: int
    backed_up_tokens: int
    backup_queue_bytes: int
    failures: dict[str, dict[str, int]] = field(default_factory=dict)


@dataclass
class CacheCounters:
    """Monotonic token counters per tier; the cache updates them in place, ``stats()`` hands out a copy."""

    cached_device: int = 0  # prompt tokens served from L1
    cached_host: int = 0  # prompt tokens restored from L2
    evicted_device: int = 0
    evicted_host: int = 0
    backed_up: int = 0  # L1 -> L2
    loaded_back: int = 0  # L2 -> L1

    def to_dict(self) -> dict:
        return {
            "cached": {"device": self.cached_device, "host": self.cached_host},
            "evicted": {"device": self.evicted_device, "host": self.evicted_host},
            "backed_up": {"host": self.backed_up},
            "loaded_back": self.loaded_back,
        }


@dataclass(frozen=True)
class CacheStats:
    """One snapshot: L1 pages, L2 pages and L3 figures (None without that tier)."""

    device: TierPages
    tokens: CacheCounters
    host: TierPages | None = None
    storage: StorageStats | None = None

    def tiers(self) -> dict[str, TierPages]:
        """The page tiers present, L1 first."""
        return {"device": self.device} | ({"host": self.host} if self.host is not None else {})

    def to_dict(self) -> dict:
        """The ``/server_info`` ``cache`` object: device, host (with an L2), storage (with an L3), tokens."""
        out: dict = {name: asdict(pages) for name, pages in self.tiers().items()}
        if self.storage is not None:
            out["storage"] = asdict(self.storage)
        out["tokens"] = self.tokens.to_dict()
        return out
