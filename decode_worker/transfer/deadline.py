"""Work that must end before a deadline, and waiting for work that cannot be stopped: the two rules a KV read
lives by (``transfer/agent.py``): bytes count only if copied while the peer held them, and pages stay ours until
nothing writes into them any more."""
from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar


async def run_to_the_end(work: asyncio.Future, limit_s: float | None = None):
    """Await ``work`` to its end even when cancelled meanwhile (then raise ``CancelledError`` after it). With
    ``limit_s``, raise ``TimeoutError`` if it has not ended after that long, cancelled or not: it goes on, and
    the caller must treat what it writes as never ending."""
    cancelled = False
    give_up = None if limit_s is None else time.monotonic() + limit_s
    while not work.done():
        try:
            left = None if give_up is None else give_up - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError
            await asyncio.wait_for(asyncio.shield(work), left)
        except asyncio.CancelledError:
            cancelled = True
        except TimeoutError:
            pass
    if cancelled:
        raise asyncio.CancelledError
    return work.result()


T = TypeVar("T")


@dataclass(eq=False)
class DeadlineJob:
    """One copy or post that must start and end before ``deadline`` (``time.monotonic()``). The copy thread
    starts it only if the loop has not dropped it and the deadline has not passed, and stamps ``ended`` after its
    last byte, so a result whose stamp is within the deadline proves the bytes were copied while the peer held
    them."""

    deadline: float
    started: bool = False
    dropped: bool = False
    ended: float = math.inf
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self, work: Callable[..., T], *args) -> T | None:
        with self._lock:
            if self.dropped or time.monotonic() >= self.deadline:
                self.dropped = True
                return None
            self.started = True
        try:
            return work(*args)
        finally:
            self.ended = time.monotonic()

    def drop(self) -> bool:
        """Keep a job that has not started from ever starting; True when it never will."""
        with self._lock:
            if not self.started:
                self.dropped = True
            return self.dropped

    def missed(self) -> str:
        """Why the job's result must not be used ("" when it may)."""
        if self.dropped:
            return "the read was due to start after its deadline"
        if self.ended > self.deadline:
            return "the copy ended after its deadline: its bytes are not used"
        return ""
