"""The admitted requests waiting for their KV; ``poll`` says what became of each."""
from __future__ import annotations

import time
from collections.abc import Iterator

from decode_worker.cache.prefix_cache import PrefixCache
from decode_worker.core.lifecycle import ReqState
from decode_worker.core.request import Prefilled, RequestError
from decode_worker.metrics import Metrics
from decode_worker.scheduler.queues import Queues
from decode_worker.scheduler.req import Req
from decode_worker.scheduler.telemetry import record_loaded

S = ReqState
MAX_LOAD_RETRIES = 2


class Loading:
    def __init__(self, cache: PrefixCache, queues: Queues, metrics: Metrics, *, page_size: int,
                 load_back_timeout_s: float):
        self.cache = cache
        self.queues = queues
        self.metrics = metrics
        self.page_size = page_size
        self.load_back_timeout_s = load_back_timeout_s

    def poll(self) -> Iterator[tuple[Req, Prefilled | RequestError]]:
        """Move landed load-backs on; yield each received first token, and each request that must fail."""
        now = time.monotonic()
        for req in list(self.queues.loading):
            if req.transfer.in_flight():
                continue
            if not req.handle.ready():
                if now - req.transfer.since > self.load_back_timeout_s:
                    yield req, RequestError("L2->L1 load-back missed its deadline", 504, "timeout")
                continue
            if not all(op.ok for op in req.handle.waits):
                if (error := self._after_failed_load(req)) is not None:
                    yield req, error
                continue
            record_loaded(self.metrics, req)
            if req.state is S.TRANSFERRING:
                yield req, self._received(req)
            else:
                req.take_pages()
                req.transfer, req.seq.num_computed = None, req.prefix_pages * self.page_size
                self.queues.move(req, S.EXTENDING)

    def _received(self, req: Req) -> Prefilled | RequestError:
        """Prefill's first token, its pages taken and cached; or why the request fails."""
        transfer = req.transfer
        task = transfer.task
        if task.cancelled():
            return req.aborted or RequestError("KV transfer cancelled", 499, "aborted")
        if (err := task.exception()) is not None:
            return err if isinstance(err, RequestError) else RequestError(f"KV transfer failed: {err}", 502,
                                                                          "transfer_error")
        if req.aborted is not None:  # aborted once the transfer could no longer be cancelled
            return req.aborted
        req.take_pages()
        req.own_since = transfer.receive.own_since
        req.transfer, req.seq.num_computed = None, len(req.seq.prompt_ids)
        req.cache_computed(self.cache, self.page_size)
        return Prefilled(*task.result())

    def _after_failed_load(self, req: Req) -> RequestError | None:
        """Match again after a failed load-back (a few times); a received prompt fails."""
        if req.state is S.TRANSFERRING:
            return RequestError("restoring the cached prefix from L2 failed", 503, "unavailable")
        self.cache.release(req.handle)
        req.handle, req.transfer = None, None
        req.retries += 1
        if req.retries > MAX_LOAD_RETRIES:
            return RequestError("restoring the cached prefix from L2 failed repeatedly", 503, "unavailable")
        self.queues.move(req, S.QUEUED, front=True)
        return None
