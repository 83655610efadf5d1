"""One queue per group of lifecycle states; ``move`` alone changes a request's state and queue."""
from __future__ import annotations

from collections import deque

from decode_worker.core.lifecycle import ReqState, check_transition
from decode_worker.scheduler.req import Req

S = ReqState


class Queues:
    def __init__(self) -> None:
        self.prealloc: deque[Req] = deque()  # QUEUED, MATCHING: FIFO admission
        self.loading: list[Req] = []  # LOADING, TRANSFERRING
        self.extend: deque[Req] = deque()  # EXTENDING; an extend batch leaves it when its results are applied
        self.running: list[Req] = []  # RUNNING
        self.retracted: deque[Req] = deque()  # RETRACTED: admitted before anything in prealloc
        self.held: dict[str, Req] = {}  # HELD, by request id
        self._by_state: dict[ReqState, deque[Req] | list[Req] | dict[str, Req]] = {
            S.QUEUED: self.prealloc, S.MATCHING: self.prealloc, S.LOADING: self.loading,
            S.TRANSFERRING: self.loading, S.EXTENDING: self.extend, S.RUNNING: self.running,
            S.RETRACTED: self.retracted, S.HELD: self.held,
        }  # the final states have no queue

    def add(self, req: Req) -> None:
        req.state = S.QUEUED
        self.prealloc.append(req)

    def move(self, req: Req, state: ReqState, *, front: bool = False) -> None:
        """Move ``req`` to ``state`` and its queue (``front``: at the head); an illegal move raises."""
        check_transition(req.state, state)
        old, new = self._by_state.get(req.state), self._by_state.get(state)
        if old is not new:
            if isinstance(old, dict):
                del old[req.rid]
            elif old is not None:
                old.remove(req)
            if isinstance(new, dict):
                new[req.rid] = req
            elif new is not None and front:
                new.insert(0, req)
            elif new is not None:
                new.append(req)
        req.state = state

    def admitted(self) -> int:
        """Requests holding a batch slot."""
        return len(self.loading) + len(self.extend) + len(self.running)

    def stats(self) -> dict:
        return {
            "queues": {"prealloc": len(self.prealloc), "transfer": len(self.loading), "extend": len(self.extend),
                       "retracted": len(self.retracted)},
            "running": len(self.running),
        }
