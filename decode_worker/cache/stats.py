"""What the cache reports; ``to_dict()`` is ``/server_info``'s ``cache`` object, whose shape is API."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class TierPages:
    """One tier's pages: free + used + evictable + locked = total (docs/architecture.md says what each holds)."""

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
    """The L3 tier's backend, circuit, token counters and failures."""

    backend: str
    down: bool
    prefetched_tokens: int
    backed_up_tokens: int
    backup_queue_bytes: int
    failures: dict[str, dict[str, int]] = field(default_factory=dict)


@dataclass
class CacheCounters:
    """Monotonic token counters; ``stats()`` hands out a copy."""

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
    """One snapshot (None for a tier not present)."""

    device: TierPages
    tokens: CacheCounters
    host: TierPages | None = None
    storage: StorageStats | None = None

    def tiers(self) -> dict[str, TierPages]:
        return {"device": self.device} | ({"host": self.host} if self.host is not None else {})

    def to_dict(self) -> dict:
        out: dict = {name: asdict(pages) for name, pages in self.tiers().items()}
        if self.storage is not None:
            out["storage"] = asdict(self.storage)
        out["tokens"] = self.tokens.to_dict()
        return out
