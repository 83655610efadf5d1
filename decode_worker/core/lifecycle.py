"""A request's life in the scheduler: its states, the legal moves, and what it found cached. The scheduler
moves a request between queues only through ``check_transition``, so state and queue agree.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class ReqState(Enum):
    """Where a request is, and its scheduler queue in brackets.

    QUEUED        waiting for a batch slot and L1 pages, FIFO; also after a prefetch or failed load-back [prealloc]
    MATCHING      queued while its L3 lookup and prefetch into L2 run [prealloc]
    LOADING       admitted (prefix locked, L1 pages allocated), waiting for its L2->L1 load-back [loading]
    TRANSFERRING  admitted, its prompt KV arriving from prefill (and any load-back) [loading]
    EXTENDING     its KV in place, waiting for or inside the extend of its uncomputed tokens [extend]
    RUNNING       in the decode batch [running]
    RETRACTED     L1 ran out: pages released (backed up to L2 where possible), waiting to resume [retracted]
    HELD          prefill role: answered, its KV pinned for the decode peer until handed off or expired [held]
    FINISHED      answered; its KV cached or freed
    ABORTED       ended with an error (client gone, deadline, failure, shutdown); everything it took freed"""

    QUEUED = "queued"
    MATCHING = "matching"
    LOADING = "loading"
    TRANSFERRING = "transferring"
    EXTENDING = "extending"
    RUNNING = "running"
    RETRACTED = "retracted"
    HELD = "held"
    FINISHED = "finished"
    ABORTED = "aborted"


S = ReqState
TRANSITIONS: dict[ReqState, frozenset[ReqState]] = {
    S.QUEUED: frozenset({S.MATCHING, S.LOADING, S.TRANSFERRING, S.ABORTED}),
    S.MATCHING: frozenset({S.QUEUED, S.ABORTED}),
    S.LOADING: frozenset({S.EXTENDING, S.QUEUED, S.ABORTED}),  # QUEUED: its load-back failed, match again
    S.TRANSFERRING: frozenset({S.RUNNING, S.FINISHED, S.ABORTED}),  # FINISHED: prefill's token was the last
    S.EXTENDING: frozenset({S.RUNNING, S.FINISHED, S.HELD, S.ABORTED}),
    S.RUNNING: frozenset({S.RETRACTED, S.FINISHED, S.ABORTED}),
    S.RETRACTED: frozenset({S.LOADING, S.ABORTED}),
    S.HELD: frozenset({S.FINISHED}),  # its client was answered when it was held: it can no longer fail
    S.FINISHED: frozenset(),
    S.ABORTED: frozenset(),
}
"""Every legal move; anything else is a scheduler bug."""


class IllegalTransition(RuntimeError):
    """A move the lifecycle does not allow: the scheduler lost track of a request."""


def check_transition(old: ReqState, new: ReqState) -> None:
    if new not in TRANSITIONS[old]:
        raise IllegalTransition(f"a request cannot go from {old.name} to {new.name}")


@dataclass(frozen=True)
class CacheHits:
    """Prompt tokens found cached per tier at first admission; every token event reports them."""

    device: int = 0  # already on L1
    host: int = 0  # restored from L2
    storage: int = 0  # restored from L2 after its lookahead prefetched them from L3

    def as_dict(self) -> dict[str, int]:
        return {"device": self.device, "host": self.host, "storage": self.storage}
