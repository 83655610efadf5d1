"""Prefill side of PD: keep each finished prompt's KV under a lease and push it to the decode peer that asks.

A request that reaches its first token is held by room (its pages stay locked) until the decode side's
handshake arrives or the lease expires; either way its pages then go into prefill's own radix cache.
"""
from __future__ import annotations

import asyncio
import base64
import hmac
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from decode_worker_kernels.page_copy import gather_pages

from decode_worker.core.request import RequestError
from decode_worker.core.tasks import TaskSet
from decode_worker.metrics import Metrics
from decode_worker.pd.handshake import PD_TOKEN_HEADER, HandshakeBody, prompt_digest
from decode_worker.transfer.staging import StagingPool, run_page_copy
from decode_worker.transfer.ucx_sender import KVSender
from decode_worker.transfer.wire import Trailer, TransferError

if TYPE_CHECKING:
    from decode_worker.cache.pool import KVPool
    from decode_worker.config import ServerConfig
    from decode_worker.scheduler.req import Req
    from decode_worker.scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)


def check_pd_token(expected: str, given: str | None) -> None:
    """The handshake's X-PD-Token header against our --pd-token, compared in constant time.

    A token on one side only is refused as well as a wrong one: it means the pair was configured apart, and
    either way the message says which side lacks it.
    """
    if not expected and not given:
        return
    if not expected:
        raise RequestError(f"this prefill worker has no --pd-token but the handshake carries {PD_TOKEN_HEADER}: "
                           "give both workers the same --pd-token, or neither", 401, "unauthorized")
    if not given:
        raise RequestError(f"missing {PD_TOKEN_HEADER} header: this prefill worker has a --pd-token; give the "
                           "decode worker the same one", 401, "unauthorized")
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise RequestError(f"{PD_TOKEN_HEADER} does not match this prefill worker's --pd-token", 401, "unauthorized")


@dataclass
class _Lease:
    req: Req
    expires: float


@dataclass
class KVHandoff:
    """The prefill role's end of a prompt (``scheduler.roles.PromptDone``): a PD request's KV is held under a
    lease for its decode peer and pushed when the peer's handshake comes."""

    config: ServerConfig
    pool: KVPool
    sender: KVSender
    metrics: Metrics
    scheduler: Scheduler | None = None
    staging: StagingPool | None = None  # on the pool's device, where pages are gathered
    leases: dict[int, _Lease] = field(default_factory=dict)
    _arrived: dict[int, asyncio.Event] = field(default_factory=dict)
    _tasks: TaskSet = field(default_factory=TaskSet)

    def __post_init__(self) -> None:
        if self.staging is None:
            self.staging = StagingPool(self.pool.buffer.device)

    def hold(self, req: Req) -> bool:
        """After the first token: hold a PD request's KV for its decode peer."""
        if req.inp.bootstrap is None:
            return False  # a plain request on a prefill worker is served to the end
        room = req.inp.bootstrap.room
        if (old := self.leases.get(room)) is not None:  # a router reusing a room: the newer request wins
            self.scheduler.release_held(old.req)
        self.leases[room] = _Lease(req, time.monotonic() + self.config.kv_lease_s)
        self._arrived.setdefault(room, asyncio.Event()).set()
        return True

    def expire(self) -> None:
        """Free held KV whose decode peer never came."""
        now = time.monotonic()
        for room, lease in list(self.leases.items()):
            if lease.expires < now:
                log.warning("KV lease of room %d expired without a handshake", room)
                self._drop(room)
                self.scheduler.release_held(lease.req)

    def _drop(self, room: int) -> _Lease | None:
        self._arrived.pop(room, None)
        return self.leases.pop(room, None)

    async def handshake(self, body: HandshakeBody) -> dict:
        """The caller has checked the PD token (``check_pd_token``)."""
        layout = self.pool.layout
        diff = layout.differences(body.layout)
        if diff:
            raise RequestError("KV layout mismatch: " + "; ".join(diff), 409, "layout_mismatch")
        req = (await self._wait_for_room(body.room)).req
        try:
            return await self._start_push(body, req)
        except BaseException:  # a rejected, failed or cancelled hand-off frees the KV it held
            self.scheduler.release_held(req)
            raise

    async def _start_push(self, body: HandshakeBody, req: Req) -> dict:
        """Check the decode side's view of the prompt, then push its delta KV in the background."""
        layout = self.pool.layout
        prompt = req.seq.prompt_ids
        if body.prompt_len != len(prompt) or body.prompt_digest != prompt_digest(prompt):
            raise RequestError(f"prompt mismatch for room {body.room}: decode has {body.prompt_len} tokens "
                               f"(digest {body.prompt_digest}), prefill has {len(prompt)} (digest "
                               f"{prompt_digest(prompt)})", 409, "digest_mismatch")
        ps = layout.page_size
        if body.decode_prefix_len % ps or not 0 <= body.decode_prefix_len <= len(prompt):
            raise RequestError(f"decode_prefix_len {body.decode_prefix_len} must be a multiple of the page size "
                               f"{ps} within the {len(prompt)}-token prompt")
        pages = torch.tensor(req.seq.pages[body.decode_prefix_len // ps : -(-len(prompt) // ps)], dtype=torch.int64)
        trailer = Trailer(req.seq.output_ids[0], req.seq.output_logprobs[0])
        address = base64.b64decode(body.ucx_address)
        self._tasks.spawn(self._push(req, address, body.room, pages, trailer))
        return {"status": "sending", "room": body.room, "tokens": len(prompt) - body.decode_prefix_len,
                "nbytes": pages.numel() * layout.page_bytes}

    async def _wait_for_room(self, room: int) -> _Lease:
        """The decode side may ask before prefill has finished: wait for the room, up to the lease time."""
        event = self._arrived.setdefault(room, asyncio.Event())
        try:
            async with asyncio.timeout(self.config.kv_lease_s):
                await event.wait()
        except TimeoutError:
            self._arrived.pop(room, None)
            raise RequestError(f"unknown room {room}: no prefilled request with it arrived in time", 404, "unknown_room") from None
        lease = self._drop(room)
        if lease is None:
            raise RequestError(f"room {room} was already handed off or expired", 404, "unknown_room")
        return lease

    async def _push(self, req: Req, address: bytes, room: int, pages: torch.Tensor, trailer: Trailer) -> None:
        """Gather the pages into a staging buffer and send it; the held pages are released whatever happens."""
        layout = self.pool.layout
        try:
            with self.staging.borrow(layout.pages_shape(pages.numel()), layout.dtype) as staging:
                await run_page_copy(staging.nbytes, gather_pages, self.pool.buffer, pages, staging)
                await self.sender.send(address, room, staging, trailer, self.config.transfer_timeout_s)
        except TransferError as e:
            self.metrics.transfer_failures.labels(e.reason).inc()
            log.warning("push of room %d failed: %s", room, e)
        finally:
            self.scheduler.release_held(req)

    async def close(self) -> None:
        await self._tasks.wait(timeout=self.config.transfer_timeout_s)
        await self.sender.close()
