"""L1 <-> L2 page copies on one thread, off the event loop, load-backs first (docs/architecture.md)."""
from __future__ import annotations

import copy
import threading
import time
from collections import deque
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass, field
from math import prod
from typing import Protocol

import numpy as np
import torch
from decode_worker_kernels.page_copy import gather_pages, scatter_pages

from decode_worker.cache.pool import PageIds
from decode_worker.core.host_memory import pin_in_place
from decode_worker.core.threads import started_pool

STAGING_BYTES = 64 << 20  # both slots together; a copy larger than a slot goes through in chunks


class PageCopier(Protocol):
    """Copies by page ids, each a future; those touching the same pages run in order."""

    def load(self, host_pages: PageIds, device_pages: PageIds) -> Future: ...

    def backup(self, device_pages: PageIds, host_pages: PageIds) -> Future: ...

    def close(self) -> None: ...


@dataclass(eq=False)
class CopyJob:
    """``kind``: "load" (host -> device) or "backup" (device -> host)."""

    kind: str
    device_pages: np.ndarray
    host_pages: np.ndarray
    after: torch.cuda.Event | None = None  # the caller's stream work it must follow
    future: Future = field(default_factory=Future)
    seq: int = 0  # submission order, set by the queue


class CopyQueue:
    """Copies not yet started, in run order: a load ahead of older backups that do not touch its pages.
    Not thread-safe."""

    def __init__(self, device_pages: int, host_pages: int):
        self.loads: deque[CopyJob] = deque()
        self.backups: deque[CopyJob] = deque()
        self._submitted = 0
        self._host_written = np.zeros(host_pages, dtype=np.int32)  # per L2 page: queued backups writing it
        self._device_read = np.zeros(device_pages, dtype=np.int32)  # per L1 page: queued backups reading it

    def __len__(self) -> int:
        return len(self.loads) + len(self.backups)

    def push(self, job: CopyJob) -> None:
        job.seq, self._submitted = self._submitted, self._submitted + 1
        if job.kind == "load":
            self.loads.append(job)
        else:
            self.backups.append(job)
            self._count(job, 1)

    def pop(self) -> CopyJob | None:
        if self.loads and not self.waits_for_backup(self.loads[0]):
            return self.loads.popleft()
        if self.backups:
            job = self.backups.popleft()
            self._count(job, -1)
            return job
        return None

    def waits_for_backup(self, load: CopyJob) -> bool:
        """An older backup writes host pages ``load`` reads or reads device pages it writes."""
        if not (self._host_written[load.host_pages].any() or self._device_read[load.device_pages].any()):
            return False  # the usual case, in one look per page; else find whether an older backup is the one
        for backup in self.backups:
            if backup.seq > load.seq:
                return False
            if np.isin(load.host_pages, backup.host_pages).any() or np.isin(load.device_pages,
                                                                            backup.device_pages).any():
                return True
        return False

    def order(self) -> list[CopyJob]:
        """The queued copies in ``pop`` order, popping none."""
        plan = copy.copy(self)
        plan.loads, plan.backups = deque(self.loads), deque(self.backups)
        plan._host_written, plan._device_read = self._host_written.copy(), self._device_read.copy()
        return list(iter(plan.pop, None))

    def take_all(self) -> list[CopyJob]:
        jobs = [*self.loads, *self.backups]
        self.loads.clear()
        self.backups.clear()
        self._host_written[:] = 0
        self._device_read[:] = 0
        return jobs

    def _count(self, job: CopyJob, step: int) -> None:
        self._host_written[job.host_pages] += step  # a copy's pages are distinct: one count each
        self._device_read[job.device_pages] += step


class CopyEngine:
    """``PageCopier`` on one thread, running copies in ``CopyQueue`` order."""

    def __init__(self, device_buffer: torch.Tensor, host_buffer: torch.Tensor, staging_bytes: int = STAGING_BYTES):
        self.device_buffer = device_buffer
        self.host_buffer = host_buffer
        self._stream = torch.cuda.Stream(device_buffer.device) if device_buffer.is_cuda else None
        direct = self._stream is None or host_buffer.is_pinned()  # a pageable L2 pool cannot take async DMA
        self.staging = None if direct else Staging(device_buffer, staging_bytes, self._stream)
        self.pending = CopyQueue(device_buffer.shape[0], host_buffer.shape[0])
        self._lock = threading.Lock()
        self._executor = started_pool(1, "kv-copy")

    def load(self, host_pages: PageIds, device_pages: PageIds) -> Future:
        """L2 -> L1; then yields the interpreter lock once, so the copy thread starts it now."""
        future = self._submit(self._job("load", device_pages, host_pages))
        time.sleep(0)
        return future

    def backup(self, device_pages: PageIds, host_pages: PageIds) -> Future:
        return self._submit(self._job("backup", device_pages, host_pages))

    def _job(self, kind: str, device_pages: PageIds, host_pages: PageIds) -> CopyJob:
        device_pages, host_pages = (np.asarray(p, dtype=np.int64) for p in (device_pages, host_pages))
        return CopyJob(kind, device_pages, host_pages, self._caller_event())

    def _submit(self, job: CopyJob) -> Future:
        with self._lock:
            self.pending.push(job)
        self._executor.submit(self._run_next)
        return job.future

    def _run_next(self) -> None:
        with self._lock:
            job = self.pending.pop()
        if job is not None:
            self.run_job(job)

    def run_job(self, job: CopyJob) -> None:
        """Run one copy unless cancelled; settle its future."""
        if not job.future.set_running_or_notify_cancel():
            return
        if job.kind == "load":
            args = (self.host_buffer, self.device_buffer, job.host_pages, job.device_pages)
        else:
            args = (self.device_buffer, self.host_buffer, job.device_pages, job.host_pages)
        try:
            self._copy(*args, job.after)
        except BaseException as exc:  # noqa: BLE001 - the future carries it to the cache
            job.future.set_exception(exc)
        else:
            job.future.set_result(None)

    def _caller_event(self) -> torch.cuda.Event | None:
        """The caller's stream work the copy must follow."""
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def close(self) -> None:
        """Finish the copy running, cancel those still queued."""
        self._executor.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            jobs = self.pending.take_all()
        for job in jobs:
            job.future.cancel()

    def _copy(self, src: torch.Tensor, dst: torch.Tensor, src_pages: PageIds, dst_pages: PageIds,
              after: torch.cuda.Event | None = None) -> None:
        # the cache hands over its numpy page ids: torch views of them, made here on the copy thread (no copy)
        if self._stream is None:
            copy_host_pages(src, dst, src_pages, dst_pages)
            return
        if after is not None:
            self._stream.wait_event(after)
        if self.staging is None:
            self._direct(src, dst, src_pages, dst_pages)
            return
        src_pages, dst_pages = torch.as_tensor(src_pages), torch.as_tensor(dst_pages)
        if src.is_cuda:
            self.staging.backup(src, dst, src_pages, dst_pages)
        else:
            self.staging.load(src, dst, src_pages, dst_pages)

    def _direct(self, src: torch.Tensor, dst: torch.Tensor, src_pages: PageIds, dst_pages: PageIds) -> None:
        with torch.cuda.stream(self._stream):
            copy_host_pages(src, dst, src_pages, dst_pages, non_blocking=True)
        done = torch.cuda.Event()
        done.record(self._stream)
        done.synchronize()


def copy_host_pages(src: torch.Tensor, dst: torch.Tensor, src_pages: PageIds, dst_pages: PageIds,
                    non_blocking: bool = False) -> None:
    """``dst[dst_pages] = src[src_pages]``, one copy per run of consecutive pages."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"page count mismatch: {len(src_pages)} source vs {len(dst_pages)} destination")
    s, d = np.asarray(src_pages, dtype=np.int64), np.asarray(dst_pages, dtype=np.int64)
    if not len(s):
        return
    # a run ends where either side stops being consecutive
    breaks = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    for lo, hi in zip(np.r_[0, breaks], np.r_[breaks, len(s)]):
        n = int(hi - lo)
        dst[int(d[lo]) : int(d[lo]) + n].copy_(src[int(s[lo]) : int(s[lo]) + n], non_blocking=non_blocking)


@dataclass
class _Slot:
    host: torch.Tensor  # flat bytes, page-locked
    device: torch.Tensor  # flat bytes on the device
    done: torch.cuda.Event | None  # recorded after the slot's last device-side use


class Staging:
    """Two pinned host slots paired with device memory, used in turn chunk by chunk (``stream=None``: in line)."""

    def __init__(self, device_buffer: torch.Tensor, nbytes: int, stream: torch.cuda.Stream | None):
        self.page_bytes = prod(device_buffer.shape[1:]) * device_buffer.element_size()
        self.pages_per_slot = max(1, nbytes // 2 // self.page_bytes)
        self.stream = stream
        slot_bytes = self.pages_per_slot * self.page_bytes
        self.slots = [self._slot(slot_bytes, device_buffer.device) for _ in range(2)]

    def _slot(self, nbytes: int, device: torch.device) -> _Slot:
        host = torch.empty(nbytes, dtype=torch.uint8)  # owns its storage from byte 0, as pin_in_place needs
        pin_in_place(host, owner=self, cuda_available=self.stream is not None)
        done = torch.cuda.Event() if self.stream is not None else None
        return _Slot(host, torch.empty(nbytes, dtype=torch.uint8, device=device), done)

    def backup(self, src: torch.Tensor, dst: torch.Tensor, src_pages: torch.Tensor, dst_pages: torch.Tensor) -> None:
        """Device -> host: the device gathers a chunk as the host scatters the last."""
        waiting: list[tuple[torch.Tensor, _Slot, torch.Tensor]] = []
        for i, (s, d) in enumerate(self._chunks(src_pages, dst_pages)):
            slot = self.slots[i % 2]
            on_device, on_host = self._views(slot, src, s.numel())
            with self._on_stream():
                gather_pages(src, s.to(src.device), out=on_device)
                on_host.copy_(on_device, non_blocking=True)
                self._record(slot)
            waiting.append((on_host, slot, d))
            if len(waiting) == 2:
                self._scatter_on_host(*waiting.pop(0), dst)
        for entry in waiting:
            self._scatter_on_host(*entry, dst)

    def load(self, src: torch.Tensor, dst: torch.Tensor, src_pages: torch.Tensor, dst_pages: torch.Tensor) -> None:
        for i, (s, d) in enumerate(self._chunks(src_pages, dst_pages)):
            slot = self.slots[i % 2]
            self._wait(slot)  # its previous chunk has left the host memory
            on_device, on_host = self._views(slot, src, s.numel())
            gather_pages(src, s, out=on_host)
            with self._on_stream():
                on_device.copy_(on_host, non_blocking=True)
                scatter_pages(on_device, dst, d.to(dst.device))
                self._record(slot)
        for slot in self.slots:
            self._wait(slot)

    def _scatter_on_host(self, on_host: torch.Tensor, slot: _Slot, pages: torch.Tensor, dst: torch.Tensor) -> None:
        self._wait(slot)
        scatter_pages(on_host, dst, pages)

    def _chunks(self, src_pages: torch.Tensor, dst_pages: torch.Tensor):
        if src_pages.numel() != dst_pages.numel():
            raise ValueError(f"page count mismatch: {src_pages.numel()} source vs {dst_pages.numel()} destination")
        n = self.pages_per_slot
        return [(src_pages[i: i + n], dst_pages[i: i + n]) for i in range(0, src_pages.numel(), n)]

    def _views(self, slot: _Slot, like: torch.Tensor, pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (pages, *like.shape[1:])
        nbytes = pages * self.page_bytes
        return tuple(flat[:nbytes].view(like.dtype).view(shape) for flat in (slot.device, slot.host))

    def _on_stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    def _record(self, slot: _Slot) -> None:
        if slot.done is not None:
            slot.done.record(self.stream)

    @staticmethod
    def _wait(slot: _Slot) -> None:
        if slot.done is not None:
            slot.done.synchronize()
