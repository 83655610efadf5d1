"""Per-request figures the scheduler reports as it goes (``metrics.py`` declares the families)."""
from __future__ import annotations

import logging
import time

from decode_worker.core.lifecycle import ReqState
from decode_worker.core.request import RequestError
from decode_worker.metrics import Metrics
from decode_worker.scheduler.req import Req

log = logging.getLogger("decode_worker.requests")


def record_token(metrics: Metrics, req: Req) -> None:
    """A token was emitted for ``req``."""
    now = time.monotonic()
    if req.first_token_sent:
        metrics.inter_token.observe(now - req.last_token_at)
    else:
        req.first_token_sent = True
        metrics.ttft.observe(now - req.stream.created_at)
        if req.own_since is not None:  # a PD request's first token leaves decode
            metrics.decode_own.observe(now - req.own_since)
    req.last_token_at = now
    metrics.output_tokens.inc()


def record_loaded(metrics: Metrics, req: Req) -> None:
    """``req``'s load-back landed: observe its L2 restore time since admission (none when it restored
    nothing or received its KV: the transfer is timed apart)."""
    if req.state is ReqState.LOADING and req.handle.restored_tokens:
        metrics.load_back_seconds.observe(time.monotonic() - req.transfer.since)


def record_close(metrics: Metrics, req: Req, outcome: str) -> None:
    """``req`` was answered: ``ok`` (finished, or held for its decode peer: a length finish) or an error."""
    metrics.requests.labels(outcome).inc()
    if outcome == "ok":
        metrics.e2e_latency.observe(time.monotonic() - req.stream.created_at)
        metrics.request_success.labels((req.seq.finish_reason or {"type": "length"})["type"]).inc()


def log_failure(req: Req, error: RequestError) -> None:
    """Log one line for a request ending without its answer (id, PD room, status, reason), so an error
    event in a 200 stream is never silent; info for a client that left, else warning."""
    room = req.inp.bootstrap.room if req.inp.bootstrap is not None else "-"
    level = logging.INFO if error.status == 499 else logging.WARNING
    log.log(level, "request %s failed: room %s, %d %s: %s (%d tokens out)", req.rid, room, error.status, error.kind,
            error, len(req.seq.output_ids))
