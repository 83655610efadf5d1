"""A KV read's two rules: bytes count only if copied before the deadline; pages stay ours until nothing writes them."""
from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar


async def run_to_the_end(work: asyncio.Future, limit_s: float | None = None):
    """Await ``work``'s end even if cancelled meanwhile (then raise ``CancelledError``); past ``limit_s``, raise
    ``TimeoutError`` while it still writes."""
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
    """A copy or post that must run wholly before ``deadline``: it starts only in time and undropped, and stamps
    ``ended`` after its last byte."""

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
        """Stop an unstarted job from ever starting; True when it never will."""
        with self._lock:
            if not self.started:
                self.dropped = True
            return self.dropped

    def missed(self) -> str:
        """Why the result must not be used; "" when it may."""
        if self.dropped:
            return "the read was due to start after its deadline"
        if self.ended > self.deadline:
            return "the copy ended after its deadline: its bytes are not used"
        return ""
