"""The two rules a KV read lives by: bytes count only if copied before the deadline (while the peer held them),
and pages stay ours until nothing writes into them any more."""
from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar


async def run_to_the_end(work: asyncio.Future, limit_s: float | None = None):
    """Await ``work`` to its end even if cancelled meanwhile (then raise ``CancelledError``). With ``limit_s``,
    raise ``TimeoutError`` once it ran that long: it goes on, and what it writes must be treated as never ending."""
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
    """One copy or post that must start and end before ``deadline`` (``time.monotonic()``): it starts only if not
    dropped and in time, and stamps ``ended`` after its last byte, so a stamp within the deadline proves it."""

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
