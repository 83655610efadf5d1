"""Per-request figures the scheduler reports."""
from __future__ import annotations

import logging
import time

from decode_worker.core.lifecycle import ReqState
from decode_worker.core.request import RequestError
from decode_worker.metrics import Metrics
from decode_worker.scheduler.req import Req

log = logging.getLogger("decode_worker.requests")


def record_token(metrics: Metrics, req: Req) -> None:
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
    """Observe an L2 restore's time since admission."""
    if req.state is ReqState.LOADING and req.handle.restored_tokens:
        metrics.load_back_seconds.observe(time.monotonic() - req.transfer.since)


def record_close(metrics: Metrics, req: Req, outcome: str) -> None:
    metrics.requests.labels(outcome).inc()
    if outcome == "ok":
        metrics.e2e_latency.observe(time.monotonic() - req.stream.created_at)
        metrics.request_success.labels((req.seq.finish_reason or {"type": "length"})["type"]).inc()


def log_failure(req: Req, error: RequestError) -> None:
    """One log line for a request ending in an error."""
    room = req.inp.bootstrap.room if req.inp.bootstrap is not None else "-"
    level = logging.INFO if error.status == 499 else logging.WARNING
    log.log(level, "request %s failed: room %s, %d %s: %s (%d tokens out)", req.rid, room, error.status, error.kind,
            error, len(req.seq.output_ids))
