"""Each flag's choices, defined once as a ``StrEnum`` (a member equals its flag value)."""
from __future__ import annotations

from enum import StrEnum
from typing import TypeVar

P = TypeVar("P", bound=StrEnum)


def parse_policy(cls: type[P], value: str, what: str) -> P:
    """``cls(value)``; ValueError naming ``what``, the value and the choices."""
    try:
        return cls(value)
    except ValueError:
        raise ValueError(f"{what} {value!r} not in {tuple(m.value for m in cls)}") from None


class Role(StrEnum):
    COLOCATED = "colocated"  # prompt to last token in one process
    PREFILL = "prefill"  # computes the prompt, hands its KV to a decode peer
    DECODE = "decode"  # receives the prompt's KV, decodes


class WritePolicy(StrEnum):
    """When L1 pages are copied to L2."""

    WRITE_THROUGH = "write_through"  # when inserted
    WRITE_THROUGH_SELECTIVE = "write_through_selective"  # on their second hit
    WRITE_BACK = "write_back"  # when evicted from L1


class EvictionPolicy(StrEnum):
    """Which unlocked leaves L1 demotion and L2 eviction give up first."""

    SLRU = "slru"  # never-hit nodes before hit ones, LRU within each; exactly the pages needed (splits the last)
    LRU = "lru"  # least recently used whole leaves
    LFU = "lfu"  # least hit whole leaves, then least recently used


class StorageBackup(StrEnum):
    """Which L2 pages are also backed up to L3."""

    ALL = "all"
    HIT_TWICE = "hit_twice"


class StorageBackend(StrEnum):
    NONE = "none"
    FILE = "file"
    REDIS = "redis"


class PrefetchMode(StrEnum):
    """How long a queued request waits for its L3 prefetch."""

    BEST_EFFORT = "best_effort"  # never
    WAIT_COMPLETE = "wait_complete"  # for every page, up to a hard cap
    TIMEOUT = "timeout"  # up to a deadline that grows with the pages fetched
