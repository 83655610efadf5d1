"""Decode side of PD: ask prefill for the delta KV, receive it over UCX into the request's pages.

Order matters: the receive is posted (``expect``) before the handshake, so prefill's push always finds it;
the handshake carries the push address of that receive.
The receive's future settles only when nothing writes into the staging buffer any more, so every exit
path waits for it before the pages can be reused.
"""
from __future__ import annotations

import asyncio
import base64
import time
from typing import TYPE_CHECKING

import httpx
import torch
from decode_worker_kernels.page_copy import scatter_pages

from decode_worker.config import ServerConfig
from decode_worker.core.request import RequestError
from decode_worker.metrics import Metrics
from decode_worker.pd.handshake import HANDSHAKE_PATH, PD_TOKEN_HEADER, prompt_digest
from decode_worker.transfer.staging import StagingPool, run_page_copy
from decode_worker.transfer.ucx_receiver import KVReceiver
from decode_worker.transfer.wire import TransferError

if TYPE_CHECKING:
    from decode_worker.cache.pool import KVPool
    from decode_worker.scheduler.req import Req

_HANDSHAKE_REASONS = {401: "unauthorized", 404: "unknown_room", 409: "mismatch"}
HANDSHAKE_KEEPALIVE_S = 1.0
"""How long an idle connection to a prefill worker is kept for the next handshake; well under the server's."""


def handshake_client(timeout_s: float) -> httpx.AsyncClient:
    """HTTP client for handshakes. A pooled connection reused just as prefill closes it as idle fails a healthy
    peer's handshake before prefill reads it (httpx and uvicorn both keep idle connections 5 s), so ours are
    dropped long before the server's."""
    return httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(
        max_connections=100, max_keepalive_connections=20, keepalive_expiry=HANDSHAKE_KEEPALIVE_S))


class DeltaKVFetcher:
    """The decode role's prompt source (``scheduler.roles.PromptSource``): a fresh request's prompt KV comes
    from its prefill peer."""

    def __init__(self, config: ServerConfig, pool: KVPool, receiver: KVReceiver, metrics: Metrics):
        self.config = config
        self.pool = pool
        self.receiver = receiver
        self.metrics = metrics
        self.http = handshake_client(config.handshake_timeout_s)
        self.staging = StagingPool()  # received KV lands in host memory, then is scattered into the pool

    async def close(self) -> None:
        await self.http.aclose()

    def _fail(self, reason: str, message: str, status: int = 502) -> RequestError:
        self.metrics.transfer_failures.labels(reason).inc()
        return RequestError(message, status, "kv_transfer_error")

    def receives(self, req: Req) -> bool:
        """Every fresh prompt comes from prefill; a retracted request recomputes what it lost here."""
        return not req.seq.output_ids

    async def receive(self, req: Req, delta_pages: torch.Tensor) -> tuple[int, float]:
        """Receive KV of prompt tokens [prefix, prompt_len) into ``delta_pages``; returns prefill's first token."""
        boot = req.inp.bootstrap
        layout = self.pool.layout
        prompt = req.seq.prompt_ids
        prefix = req.prefix_pages * layout.page_size
        with self.staging.borrow(layout.pages_shape(delta_pages.numel()), layout.dtype) as staging:
            received = self.receiver.expect(boot.room, staging.nbytes, staging,
                                            self.config.handshake_timeout_s + self.config.transfer_timeout_s)
            try:
                asked = time.monotonic()
                await self._handshake(boot, prefix, prompt)  # answers once prefill holds the room's KV
                started = time.monotonic()
                self.metrics.kv_handshake_seconds.observe(started - asked)
                self.receiver.set_deadline(boot.room, self.config.transfer_timeout_s)  # the push's own deadline
                trailer = await received
            except TransferError as e:
                raise self._fail(e.reason, f"KV transfer from prefill {boot.host}:{boot.port} failed: {e.reason}"
                                           + (f" ({e.detail})" if e.detail else ""), 504 if e.reason == "timeout" else 502) from e
            finally:
                if not received.done():
                    self.receiver.cancel(boot.room)
                try:  # the buffer may be reused only once the receiver let go of it
                    await asyncio.shield(received)
                except (TransferError, asyncio.CancelledError):
                    pass
            await run_page_copy(staging.nbytes, scatter_pages, staging, self.pool.buffer, delta_pages)
        self.metrics.kv_received_tokens.inc(len(prompt) - prefix)
        self.metrics.kv_received_bytes.inc(staging.nbytes)
        self.metrics.kv_transfer.observe(time.monotonic() - started)
        return trailer.first_token, trailer.logprob

    def _auth_headers(self) -> dict[str, str]:
        """The pair's PD token in its header (never in the body), and our API key: the prefill worker of one
        deployment shares it (one sglang-router --api-key serves all workers)."""
        headers = {PD_TOKEN_HEADER: self.config.pd_token} if self.config.pd_token else {}
        if self.config.api_key:
            headers["Authorization"] = f"Bearer {self.config.api_key}"
        return headers

    async def _handshake(self, boot, prefix: int, prompt: list[int]) -> None:
        body = {
            "room": boot.room,
            "decode_prefix_len": prefix,
            "prompt_len": len(prompt),
            "prompt_digest": prompt_digest(prompt),
            "ucx_address": base64.b64encode(self.receiver.push_address(boot.room)).decode(),
            "layout": self.pool.layout.describe(),
        }
        url = f"http://{boot.host}:{boot.port}{HANDSHAKE_PATH}"
        try:
            resp = await self.http.post(url, json=body, headers=self._auth_headers())
        except httpx.TimeoutException as e:
            raise self._fail("timeout", f"prefill handshake at {url} timed out", 504) from e
        except httpx.HTTPError as e:
            raise self._fail("handshake_unreachable", f"prefill handshake at {url} failed: {e!r}") from e
        if resp.status_code != 200:
            try:
                detail = resp.json()["error"]["message"]
            except Exception:
                detail = resp.text[:300]
            reason = _HANDSHAKE_REASONS.get(resp.status_code, "handshake_rejected")
            raise self._fail(reason, f"prefill rejected the handshake ({resp.status_code}): {detail}")
