"""The L3 tier: prefetch into L2 pages, backup out of them; a store failure is a counted miss."""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from decode_worker.cache.pool import KVLayout, KVPool, PageIds, page_ids
from decode_worker.cache.stats import StorageStats
from decode_worker.cache.storage.base import (
    CORRUPT,
    HEADER_BYTES,
    SHORT,
    RecordError,
    StoreBackend,
    decode_record,
    seal_record,
)
from decode_worker.cache.storage.prefetch_policy import PrefetchPolicy
from decode_worker.core.tasks import TaskSet

log = logging.getLogger(__name__)

MISS = "miss"  # not a failure: the page is simply not stored
UNAVAILABLE = "unavailable"  # skipped while the circuit is open
QUEUE_FULL = "queue_full"  # backup dropped: too many bytes already waiting
_TRIPS = ("down", "timeout", "error")  # reasons that open the circuit; a full store still serves reads
_FAILED = object()


@dataclass(eq=False)
class _BackupJob:
    keys: list[str]
    records: list[np.ndarray]  # one record buffer per page, its payload copied out of L2 when the job was queued
    nbytes: int


def _host_bytes(pool: KVPool) -> np.ndarray:
    return pool.buffer.view(torch.uint8).numpy().reshape(pool.num_pages, -1)


class Prefetch:
    """An L3 -> L2 prefetch; ``arrived`` (leading pages verified) only grows, and nothing is written after
    ``stop()``."""

    def __init__(self, keys: list[str], fetch: Callable[[Prefetch], Coroutine]):
        self.keys = keys
        self.arrived = 0
        self.stopped = False
        self._task = asyncio.get_running_loop().create_task(fetch(self))

    @property
    def done(self) -> bool:
        return self.stopped or self._task.done()

    async def wait(self, timeout_s: float | None) -> int:
        """Until done or ``timeout_s``; returns pages arrived."""
        if not self._task.done() and (timeout_s is None or timeout_s > 0):
            await asyncio.wait([self._task], timeout=timeout_s)
        return self.arrived

    def stop(self) -> int:
        """Stop; returns the final count (no page past it is written)."""
        self.stopped = True
        self._task.cancel()
        return self.arrived


class StorageTier:
    """A store backend, called with page keys and L2 page ids."""

    def __init__(
        self,
        backend: StoreBackend,
        layout: KVLayout,
        policy: PrefetchPolicy | None = None,
        *,
        op_timeout_s: float = 2.0,
        down_for_s: float = 5.0,
        batch_pages: int = 4,
        backup_queue_bytes: int = 256 << 20,
    ):
        self.backend = backend
        self.layout = layout
        self.fingerprint = layout.fingerprint()
        self.page_bytes = layout.page_bytes
        self.policy = policy or PrefetchPolicy()
        self.op_timeout_s = op_timeout_s
        self.down_for_s = down_for_s
        self.batch_pages = batch_pages  # pages per store call: fewer round trips, arrival still page by page
        self.backup_queue_bytes = backup_queue_bytes
        self._spare: list[np.ndarray] = []  # record buffers of stored jobs, reused: fresh memory costs page faults
        self.failures: Counter[tuple[str, str]] = Counter()
        self.prefetched_pages = 0
        self.backed_up_pages = 0
        self._down_until = 0.0
        self._queue: asyncio.Queue[_BackupJob] = asyncio.Queue()
        self._queued_bytes = 0
        self._worker: asyncio.Task | None = None
        self._side_tasks = TaskSet()

    # -- the calls the cache makes ---------------------------------------------------------------------------------

    async def exists(self, keys: list[str]) -> int:
        """Leading pages of ``keys`` stored, unverified (0 on failure)."""
        if not keys:
            return 0
        found = await self._call("exists", self.backend.exists(keys))
        return 0 if found is _FAILED else found

    def start_prefetch(self, keys: list[str], host_pool: KVPool, host_pages: PageIds) -> Prefetch:
        host_pages = self._check(keys, host_pool, host_pages)
        return Prefetch(keys, lambda op: self._fetch(op, host_pool, host_pages))

    async def prefetch(
        self, keys: list[str], host_pool: KVPool, host_pages: PageIds, deadline_s: float | None
    ) -> int:
        """Fetch until done or ``deadline_s``, then stop; returns leading pages arrived."""
        op = self.start_prefetch(keys, host_pool, host_pages)
        await op.wait(deadline_s)
        return op.stop()

    def prefetch_deadline_s(self, tokens: int) -> float:
        return self.policy.deadline_s(tokens)

    def backup(self, keys: list[str], host_pool: KVPool, host_pages: PageIds) -> int:
        """Copy L2 pages out now, store them later; returns pages queued (0: dropped)."""
        host_pages = self._check(keys, host_pool, host_pages)
        if not keys:
            return 0
        if self.is_down:
            self.failures["backup", UNAVAILABLE] += 1
            return 0
        nbytes = len(keys) * self.page_bytes
        if self._queued_bytes + nbytes > self.backup_queue_bytes:
            self.failures["backup", QUEUE_FULL] += 1
            return 0
        host = _host_bytes(host_pool)
        records = []
        for page in host_pages.tolist():
            record = self._spare.pop() if self._spare else np.empty(HEADER_BYTES + self.page_bytes, np.uint8)
            np.copyto(record[HEADER_BYTES:], host[page])
            records.append(record)
        self._queue.put_nowait(_BackupJob(list(keys), records, nbytes))
        self._queued_bytes += nbytes
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._backup_worker())
        return len(keys)

    async def flush(self) -> None:
        await self._queue.join()

    async def close(self, flush_timeout_s: float = 5.0) -> None:
        """Flush up to ``flush_timeout_s``, then release the backend."""
        try:
            await asyncio.wait_for(self.flush(), flush_timeout_s)
        except asyncio.TimeoutError:
            log.warning("L3: %d queued backup bytes dropped at shutdown", self._queued_bytes)
        tasks = [t for t in (self._worker, *self._side_tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.backend.close()

    @property
    def is_down(self) -> bool:
        return time.monotonic() < self._down_until

    def stats(self) -> StorageStats:
        failures: dict[str, dict[str, int]] = {}
        for (op, reason), n in sorted(self.failures.items()):
            failures.setdefault(op, {})[reason] = n
        ps = self.layout.page_size
        return StorageStats(
            backend=self.backend.name,
            down=self.is_down,
            prefetched_tokens=self.prefetched_pages * ps,
            backed_up_tokens=self.backed_up_pages * ps,
            backup_queue_bytes=self._queued_bytes,
            failures=failures,
        )

    # -- internals --------------------------------------------------------------------------------------------------

    def _check(self, keys: list[str], host_pool: KVPool, host_pages: PageIds) -> np.ndarray:
        if host_pool.layout != self.layout or host_pool.buffer.device.type != "cpu":
            raise ValueError(f"L3 pages move to and from a host pool of layout {self.layout}")
        host_pages = page_ids(host_pages)
        if len(host_pages) != len(keys):
            raise ValueError(f"{len(keys)} keys for {len(host_pages)} host pages")
        return host_pages

    async def _call(self, op: str, coro: Coroutine) -> Any:
        """A store call under the deadline and circuit; a failure is counted: _FAILED."""
        if self.is_down:
            coro.close()
            self.failures[op, UNAVAILABLE] += 1
            return _FAILED
        try:
            return await asyncio.wait_for(coro, self.op_timeout_s)
        except asyncio.TimeoutError:
            reason = "timeout"
        except Exception as exc:  # noqa: BLE001 - a store failure must never reach a request
            reason = self.backend.failure_reason(exc)
            log.debug("L3 %s failed: %r", op, exc)
        self.failures[op, reason] += 1
        if reason in _TRIPS:
            if not self.is_down:
                log.warning("L3 %s store: %s failed (%s); skipping it for %.1fs",
                            self.backend.name, op, reason, self.down_for_s)
            self._down_until = time.monotonic() + self.down_for_s
        return _FAILED

    async def _fetch(self, op: Prefetch, host_pool: KVPool, host_pages: PageIds) -> None:
        try:
            await self._fetch_pages(op, host_pool, host_pages)
        except Exception:  # noqa: BLE001 - nobody awaits this task for its errors: count them here
            log.exception("L3 prefetch failed")
            self.failures["prefetch", "error"] += 1

    async def _fetch_pages(self, op: Prefetch, host_pool: KVPool, host_pages: PageIds) -> None:
        host = _host_bytes(host_pool)
        pages = host_pages.tolist()
        for start in range(0, len(op.keys), self.batch_pages):
            keys = op.keys[start : start + self.batch_pages]
            records = await self._call("prefetch", self.backend.get(keys))
            if records is _FAILED or op.stopped:
                return
            payloads = await asyncio.to_thread(self._verify, keys, records)
            for key, payload in zip(keys, payloads):
                if op.stopped:  # the caller has freed or committed the pages: write nothing more
                    return
                if isinstance(payload, str):
                    self._reject("prefetch", key, payload)
                    return
                np.copyto(host[pages[op.arrived]], np.frombuffer(payload, dtype=np.uint8))
                op.arrived += 1
                self.prefetched_pages += 1

    def _verify(self, keys: list[str], records: list[bytes | None]) -> list[memoryview | str]:
        """Payloads of the leading records that verify, then why the next fails."""
        out: list[memoryview | str] = []
        for key, record in zip(keys, records):
            if record is None:
                out.append(MISS)
                break
            try:
                out.append(decode_record(record, key, self.fingerprint, self.page_bytes))
            except RecordError as err:
                log.warning("L3 page %s rejected: %s", key, err)
                out.append(err.reason)
                break
        return out

    def _reject(self, op: str, key: str, reason: str) -> None:
        """Count an unusable page; delete a damaged one."""
        if reason == MISS:
            return
        self.failures[op, reason] += 1
        if reason in (SHORT, CORRUPT):  # a foreign page belongs to someone else: leave it
            self._side_tasks.spawn(self._call("delete", self.backend.delete([key])))

    async def _backup_worker(self) -> None:
        while True:
            job = await self._queue.get()
            try:
                await self._store(job)
            except Exception:  # noqa: BLE001 - e.g. a bug in encoding: count it, keep the worker alive
                log.exception("L3 backup failed")
                self.failures["backup", "error"] += 1
            finally:
                self._queued_bytes -= job.nbytes
                self._queue.task_done()

    async def _store(self, job: _BackupJob) -> None:
        for start in range(0, len(job.keys), self.batch_pages):
            keys = job.keys[start : start + self.batch_pages]
            present = await self._call("backup", self.backend.exists(keys))  # another pod may have stored them
            if present is _FAILED:
                return
            keys, records = keys[present:], job.records[start + present : start + len(keys)]
            if not keys:
                continue
            await asyncio.to_thread(self._seal, keys, records)
            if await self._call("backup", self.backend.put(keys, [memoryview(r) for r in records])) is _FAILED:
                return  # the buffers are not reused: a put that timed out may still be reading them in its thread
            self.backed_up_pages += len(keys)
        room = self.backup_queue_bytes // self.page_bytes - len(self._spare)
        self._spare.extend(job.records[: max(room, 0)])

    def _seal(self, keys: list[str], records: list[np.ndarray]) -> None:
        for key, record in zip(keys, records):
            seal_record(record, key, self.fingerprint)
