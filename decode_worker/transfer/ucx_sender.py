"""Prefill side of the KV data plane: push a room's KV and first token to the decode worker that asked.

One link per decode peer, reused by every transfer to it: a listener endpoint (error handling on) for
control messages, whose failure tells us the peer is gone, and a worker-address endpoint without error
handling for payloads, the only kind that gets shared memory / CMA here (5-10 GB/s instead of TCP's ~1).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from decode_worker.core.tasks import TaskSet

from .ucx_channel import (
    Endpoint,
    acquire,
    as_buffer,
    close_endpoint,
    connect_bulk,
    connect_control,
    recv,
    release,
    send,
    send_quietly,
)
from .wire import MSG_SIZE, Kind, Msg, PeerAddress, Trailer, TransferError

logger = logging.getLogger(__name__)

ABORT_GRACE_S = 1.0
"""After giving up on a transfer, how long to wait for the receiver to confirm it stopped reading."""

T = TypeVar("T")


@dataclass(eq=False)
class _Link:
    """Both endpoints to one decode peer; ``inboxes`` routes its replies to the waiting sends."""

    ctrl: Endpoint
    bulk: Endpoint
    inboxes: dict[int, asyncio.Queue[Msg]] = field(default_factory=dict)
    lost: bool = False


class KVSender:
    """Sends rooms to any number of decode peers; concurrent sends share one link per peer."""

    def __init__(self) -> None:
        self._links: dict[tuple[str, int, bytes], asyncio.Task[_Link]] = {}
        self._xfers = itertools.count(1)
        self._tasks = TaskSet()
        self._closed = False

    @classmethod
    async def start(cls) -> KVSender:
        acquire()
        return cls()

    async def send(self, push_address: bytes, room: int, payload: torch.Tensor, trailer: Trailer,
                   deadline_s: float) -> None:
        """Push the contiguous ``payload`` and ``trailer`` for ``room`` to the receiver that granted ``push_address``.

        Returns once the receiver holds every byte; raises ``TransferError`` otherwise. UCX may read
        ``payload`` until this returns or raises (after a deadline, for at most ``ABORT_GRACE_S`` more while
        the receiver confirms it stopped).
        """
        if self._closed:
            raise RuntimeError("sender is closed")
        buf = as_buffer(payload)
        deadline = asyncio.get_running_loop().time() + deadline_s
        try:
            peer = PeerAddress.unpack(push_address)
        except (ValueError, UnicodeDecodeError) as e:
            raise TransferError(room, "peer_lost", f"cannot connect: {e}") from e
        link = await self._link(peer, room, deadline)
        xfer = next(self._xfers)
        inbox = link.inboxes[xfer] = asyncio.Queue()
        if link.lost:  # lost after _link() handed it out: nobody will answer
            link.inboxes.pop(xfer)
            raise TransferError(room, "peer_lost", "connection to the receiver lost")
        offer = Msg(Kind.OFFER, room, xfer, nbytes=buf.nbytes, tag=peer.tag, trailer=trailer)
        if buf.nbytes:  # first: its receive is already posted, the OFFER only has to arrive by the time it lands
            self._tasks.spawn(_send_payload(link.bulk, buf, offer.tag))
        self._tasks.spawn(send_quietly(link.ctrl, offer.pack()))  # a lost peer shows up as its verdict
        try:
            verdict = await _before(deadline, inbox.get())
        except asyncio.TimeoutError:
            verdict = await self._abort(link, offer, inbox, "timeout")
        except asyncio.CancelledError:
            await asyncio.shield(self._abort(link, offer, inbox, "cancelled"))
            raise
        finally:
            link.inboxes.pop(xfer, None)
        if verdict.kind is not Kind.DONE:
            raise TransferError(room, verdict.reason or "peer_lost")

    async def close(self) -> None:
        """Drop every link; sends still waiting fail with ``peer_lost``."""
        if self._closed:
            return
        self._closed = True
        for task in self._links.values():
            if not task.done():
                task.cancel()
            elif not task.cancelled() and task.exception() is None:
                _close_link(task.result())
        # Readers notice their closed endpoint; a payload toward a dead peer never completes.
        await self._tasks.wait(timeout=0.2)
        self._links.clear()
        release()

    async def _abort(self, link: _Link, offer: Msg, inbox: asyncio.Queue[Msg], reason: str) -> Msg:
        """Tell the receiver we give up and wait for its verdict: after it, nothing reads our payload."""
        if not link.lost:
            self._tasks.spawn(send_quietly(link.ctrl, Msg(Kind.ABORT, offer.room, offer.xfer, reason=reason).pack()))
            try:
                return await asyncio.wait_for(inbox.get(), ABORT_GRACE_S)
            except asyncio.TimeoutError:
                pass
        return Msg(Kind.REJECT, offer.room, offer.xfer, reason=reason)

    async def _link(self, peer: PeerAddress, room: int, deadline: float) -> _Link:
        task = self._links.get(peer.receiver)
        if task is not None and task.done() and not task.cancelled() and task.exception() is None:
            return task.result()  # the common case, without a trip through the loop
        if task is None or task.done():
            task = self._links[peer.receiver] = asyncio.ensure_future(self._connect(peer))
        try:
            return await _before(deadline, asyncio.shield(task))
        except asyncio.TimeoutError:
            raise TransferError(room, "timeout", "connecting to the receiver") from None
        except Exception as e:  # unreachable or malformed address, refused connection
            raise TransferError(room, "peer_lost", f"cannot connect: {e!r}") from e

    async def _connect(self, peer: PeerAddress) -> _Link:
        ctrl = await connect_control(peer.host, peer.port)
        try:
            bulk = await connect_bulk(peer.worker)
        except BaseException:
            close_endpoint(ctrl)
            raise
        link = _Link(ctrl, bulk)
        self._tasks.spawn(self._read(peer.receiver, link))
        return link

    async def _read(self, receiver: tuple[str, int, bytes], link: _Link) -> None:
        """Route the peer's replies to their sends until the control endpoint fails, then forget the link."""
        try:
            while True:
                buf = bytearray(MSG_SIZE)
                await recv(link.ctrl, buf)
                msg = Msg.unpack(buf)
                if (inbox := link.inboxes.get(msg.xfer)) is not None:
                    inbox.put_nowait(msg)
        except Exception as e:  # ucxx raises its own error types when the peer closes or dies
            logger.debug("KV receiver connection ended: %r", e)
        finally:
            link.lost = True
            self._links.pop(receiver, None)  # the next send to this peer connects afresh
            for xfer, inbox in link.inboxes.items():
                inbox.put_nowait(Msg(Kind.REJECT, 0, xfer, reason="peer_lost"))
            _close_link(link)



def _close_link(link: _Link) -> None:
    close_endpoint(link.ctrl)
    close_endpoint(link.bulk)


async def _before(deadline: float, aw: Awaitable[T]) -> T:
    return await asyncio.wait_for(aw, max(deadline - asyncio.get_running_loop().time(), 0))


async def _send_payload(bulk: Endpoint, buf, tag: int) -> None:
    try:
        await send(bulk, buf, tag)
    except Exception as e:  # the receiver's verdict decides the transfer; this only explains it
        logger.warning("KV payload send failed: %r", e)

