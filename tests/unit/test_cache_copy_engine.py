"""The copy engine on its own (two CPU buffers, page ids, no nodes, no cache): copies land where they are sent, as
futures; a load-back runs ahead of queued backups unless one of them touches its pages."""
from __future__ import annotations

import threading

import numpy as np
import torch

from decode_worker.cache import copy_engine
from decode_worker.cache.copy_engine import CopyEngine, CopyJob, CopyQueue, PageCopier


def test_load_and_backup_move_pages_in_submission_order():
    device, host = torch.zeros(6, 3), torch.arange(18, dtype=torch.float32).view(6, 3)
    engine: PageCopier = CopyEngine(device, host)
    try:
        first = engine.load(np.array([1, 2]), np.array([4, 5]))  # L2 1, 2 -> L1 4, 5
        second = engine.backup(np.array([4]), np.array([0]))  # reads what the load wrote: it runs after it
        second.result(timeout=5)
        assert first.done()
        assert torch.equal(device[4:6], host[1:3]) and torch.equal(host[0], host[1])
    finally:
        engine.close()


def job(kind: str, device: list[int], host: list[int]) -> CopyJob:
    return CopyJob(kind, np.array(device, dtype=np.int64), np.array(host, dtype=np.int64))


def drain(queue: CopyQueue) -> list[CopyJob]:
    out = []
    while (j := queue.pop()) is not None:
        out.append(j)
    return out


def queued(*jobs: CopyJob) -> CopyQueue:
    queue = CopyQueue(device_pages=16, host_pages=16)
    for j in jobs:
        queue.push(j)
    return queue


def test_a_load_runs_ahead_of_backups_that_touch_none_of_its_pages():
    b1, b2 = job("backup", [1, 2], [1, 2]), job("backup", [3], [3])
    l1, l2 = job("load", [8, 9], [5, 6]), job("load", [10], [7])
    queue = queued(b1, b2, l1, l2)
    assert queue.order() == [l1, l2, b1, b2]  # loads first, each kind first-in first-out
    assert drain(queue) == [l1, l2, b1, b2] and len(queue) == 0


def test_a_load_of_l2_pages_a_queued_backup_writes_runs_after_that_backup():
    """A write_back demotion still queued: the load-back of its pages reads them only once they are written (the
    backups before it run first too: backups keep their order)."""
    b1, demotion, b3 = job("backup", [1], [1]), job("backup", [2, 3], [4, 5]), job("backup", [6], [6])
    load = job("load", [9, 10], [5, 7])
    queue = queued(b1, demotion, b3, load)
    assert queue.order() == [b1, demotion, load, b3]
    assert drain(queue) == [b1, demotion, load, b3]


def test_a_load_into_l1_pages_a_queued_backup_reads_runs_after_that_backup():
    backup, load = job("backup", [4, 5], [1, 2]), job("load", [5], [9])
    assert drain(queued(backup, load)) == [backup, load]


def test_a_backup_queued_after_a_load_never_overtakes_it():
    load, backup = job("load", [4], [9]), job("backup", [4], [1])  # the backup reads what the load writes
    assert drain(queued(load, backup)) == [load, backup]


class HeldEngine(CopyEngine):
    """Records the order copies run in; the first copy waits until the test opens ``gate``."""

    def __init__(self, device: torch.Tensor, host: torch.Tensor):
        super().__init__(device, host)
        self.gate, self.started = threading.Event(), threading.Event()
        self.ran: list[tuple[int, ...]] = []

    def _copy(self, src, dst, src_pages, dst_pages, after=None) -> None:
        self.started.set()
        assert self.gate.wait(5), "gate never opened"
        self.ran.append(tuple(np.asarray(dst_pages).tolist()))
        super()._copy(src, dst, src_pages, dst_pages, after)


def test_the_engine_runs_a_load_back_next_while_backups_wait():
    device, host = torch.arange(24, dtype=torch.float32).view(8, 3), torch.zeros(8, 3)
    engine = HeldEngine(device, host)
    try:
        running = engine.backup(np.array([0]), np.array([0]))
        assert engine.started.wait(5)  # on the copy thread, held
        backups = [engine.backup(np.array([i]), np.array([i])) for i in (1, 2, 3)]
        demoted = engine.backup(np.array([4]), np.array([4]))
        load = engine.load(np.array([5]), np.array([6]))  # touches no queued backup's pages
        load_demoted = engine.load(np.array([4]), np.array([7]))  # reads what the last backup writes
        engine.gate.set()
        for f in (running, *backups, demoted, load, load_demoted):
            f.result(timeout=5)
        assert engine.ran == [(0,), (6,), (1,), (2,), (3,), (4,), (7,)]
        assert torch.equal(device[7], device[4])  # the load-back read the finished backup
    finally:
        engine.close()


def test_close_cancels_the_copies_still_queued():
    device, host = torch.zeros(4, 3), torch.zeros(4, 3)
    engine = HeldEngine(device, host)
    running = engine.backup(np.array([0]), np.array([0]))
    assert engine.started.wait(5)
    queued_copy = engine.load(np.array([1]), np.array([1]))
    engine.gate.set()
    engine.close()
    assert running.result(timeout=5) is None and (queued_copy.cancelled() or queued_copy.done())


def test_a_load_back_hands_the_copy_thread_the_interpreter_lock_and_a_backup_does_not(monkeypatch):
    """The caller (the event loop) goes on with Python work after queuing a copy, holding the interpreter lock: the
    copy thread would start a load-back only when the caller next blocks, or after the switch interval. A
    load-back yields once right after it is queued; a backup, off the critical path, does not."""
    calls: list[tuple[str, float]] = []
    monkeypatch.setattr(copy_engine.time, "sleep", lambda s: calls.append(("sleep", s)))
    device, host = torch.zeros(4, 3), torch.ones(4, 3)
    engine = CopyEngine(device, host)
    submit = engine._submit
    monkeypatch.setattr(engine, "_submit", lambda job: calls.append(("queued", job.kind)) or submit(job))
    try:
        engine.backup(np.array([0]), np.array([0])).result(timeout=5)
        engine.load(np.array([1]), np.array([2])).result(timeout=5)
    finally:
        engine.close()
    assert calls == [("queued", "backup"), ("queued", "load"), ("sleep", 0)]
