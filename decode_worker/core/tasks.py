"""Background tasks an object starts and must outlive: the loop keeps only weak references to tasks, so one
that nobody holds can be garbage-collected mid-flight; a ``TaskSet`` holds them until they end."""
from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
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
        """Let the running tasks end, for up to ``timeout`` seconds (the caller cancels what is left, if it must)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout)
