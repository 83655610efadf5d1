"""Tasks an object must outlive (the loop holds them only weakly), and runs callers share."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any


class TaskSet:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def __iter__(self) -> Iterator[asyncio.Task]:
        return iter(list(self._tasks))

    def __len__(self) -> int:
        return len(self._tasks)

    async def wait(self, timeout: float) -> None:
        """Let running tasks end, for up to ``timeout`` seconds; the caller cancels the rest."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout)


class SharedRun:
    """At most one run at a time: callers during a run, or within ``reuse_s`` of its end, share its outcome, bounding
    what an uncounted route such as ``/health_generate`` costs."""

    def __init__(self, reuse_s: float) -> None:
        self.reuse_s = reuse_s
        self._task: asyncio.Task | None = None
        self._ended_at = float("-inf")

    async def __call__(self, run: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
        task = self._task
        if task is None or (task.done() and time.monotonic() - self._ended_at >= self.reuse_s):
            task = self._task = asyncio.ensure_future(self._timed(run))
            task.add_done_callback(_retrieve)
        return await asyncio.shield(task)  # a caller that leaves does not cancel the others' run

    async def _timed(self, run: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
        """The end time is set before the task is done (a done-callback would leave a window in which a caller sees
        a finished run with the previous end time, and starts another)."""
        try:
            return await run()
        finally:
            self._ended_at = time.monotonic()


def _retrieve(task: asyncio.Task) -> None:
    """A failure nobody awaited any more is not logged as never retrieved."""
    if not task.cancelled():
        task.exception()
