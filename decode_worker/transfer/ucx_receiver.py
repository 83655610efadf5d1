"""Decode side of the KV data plane: receive each room's delta KV straight into the pages given for it.

Senders connect to our listener (endpoint error handling on, so a dead sender is noticed) for control
messages, and push payloads over a worker-address endpoint without error handling (shared memory / CMA
here, RDMA on InfiniBand). Each room's payload comes under a tag granted by ``expect()``, whose receive is
posted at once: the payload lands as soon as it arrives, whether or not the sender's OFFER was read yet.

A posted UCX receive cannot be cancelled on its own, only by closing the endpoint it was posted through.
So each receive is posted through its own "slot": an endpoint to our own worker. Tag matching is
worker-wide, so the payload still matches; closing the slot cancels exactly that receive. Slots are
pooled because creating one costs ~10 ms in thread progress mode.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from decode_worker.core.tasks import TaskSet

from .ucx_channel import (
    Endpoint,
    acquire,
    as_buffer,
    close_endpoint,
    connect_bulk,
    is_truncation,
    listen,
    recv,
    release,
    send_quietly,
    worker_address,
)
from .wire import MSG_SIZE, Kind, Msg, PeerAddress, Trailer, TransferError

logger = logging.getLogger(__name__)

DRAIN_S = 1.0
"""After a room fails mid-receive, how long a transfer already in flight may take to finish landing."""
LATE_OFFER_S = 60.0
"""How long a failed room whose payload came first waits for its OFFER; a sender that died meanwhile never sends it."""


@dataclass(eq=False)
class _Peer:
    """One sender's control connection; losing it fails every room it claimed."""

    ep: Endpoint
    rooms: set[int] = field(default_factory=set)


@dataclass(eq=False)
class _Room:
    room: int
    tag: int  # the payload's tag, granted here and never reused
    nbytes: int
    buf: object  # the first nbytes of the caller's tensor, flat: UCX writes here, no copy
    result: asyncio.Future[Trailer]
    timer: asyncio.TimerHandle | None = None
    peer: _Peer | None = None  # the sender whose OFFER claimed the room
    offer: Msg | None = None
    receiving: asyncio.Task | None = None
    slot: Endpoint | None = None  # holds the posted receive while it may still be cancelled
    landed: bool = False  # every payload byte is in buf
    consumed: bool = False  # the payload met our receive: it landed, or UCX truncated it
    error: TransferError | None = None  # set once the room is failing


class KVReceiver:
    """Owns the control listener; ``expect()`` a room before the handshake, then await its result.

    The future of ``expect()`` settles once nothing writes into the room's buffer any more, so the caller
    frees the pages exactly then: with the ``Trailer`` when all bytes landed, with ``TransferError``
    otherwise. It fails by the deadline, or up to ``DRAIN_S`` later if a payload was already landing; a
    sender still writing after that (alive but stalled mid-payload) is the one case where the buffer is
    handed back while UCX may still write, and it is logged.
    """

    def __init__(self, host: str):
        self.host = host
        self.port = 0
        self._worker = worker_address()
        self._listener = None
        self._rooms: dict[int, _Room] = {}
        self._tags = itertools.count((int.from_bytes(os.urandom(4), "little") << 32) + 1)
        self._consumed_early: dict[int, str] = {}  # tag -> failure, of failed rooms whose payload came before the OFFER
        self._peers: list[_Peer] = []
        self._slots: list[Endpoint] = []
        self._drain: Endpoint | None = None  # where payloads we refuse are truncated away
        self._tasks = TaskSet()
        self._closed = False

    @classmethod
    async def start(cls, host: str = "127.0.0.1", port: int = 0, spare_slots: int = 4) -> KVReceiver:
        """Listen on ``port`` (0: any); ``host`` is the address senders are told to connect to."""
        acquire()
        self = cls(host)
        self._listener = listen(self._serve, port)
        self.port = self._listener.port
        self._drain = await connect_bulk(self._worker)
        for _ in range(spare_slots):
            self._slots.append(await connect_bulk(self._worker))
        return self

    def push_address(self, room: int) -> bytes:
        """Opaque address for the handshake of an expected ``room``: our listener, our UCX worker address and
        the room's payload tag."""
        return PeerAddress(self.host, self.port, self._worker, self._rooms[room].tag).pack()

    def expect(self, room: int, nbytes: int, into: torch.Tensor, deadline_s: float) -> asyncio.Future[Trailer]:
        """Accept ``nbytes`` for ``room`` into the first bytes of the contiguous tensor ``into``, and post its
        receive; hand ``push_address(room)`` to the sender.

        Abort with ``cancel(room)`` and keep awaiting (shield it from task cancellation): cancelling the
        future itself also releases the room, but then nothing tells when the buffer is free.
        """
        if self._closed:
            raise RuntimeError("receiver is closed")
        if room in self._rooms:
            raise ValueError(f"room {room} is already expected")
        loop = asyncio.get_running_loop()
        r = _Room(room, next(self._tags), nbytes, as_buffer(into, nbytes), loop.create_future())
        r.timer = loop.call_later(deadline_s, self._fail, r, "timeout")
        r.result.add_done_callback(lambda f: f.cancelled() and self._fail(r, "cancelled"))
        self._rooms[room] = r
        if nbytes:
            r.receiving = self._tasks.spawn(self._receive(r))
        return r.result

    def set_deadline(self, room: int, deadline_s: float) -> None:
        """Fail ``room`` with ``timeout`` ``deadline_s`` from now instead of at its ``expect()`` deadline, unless
        it settles first: the transfer's own deadline starts when the sender accepted it, so a sender that
        accepted and then went silent is given up on after that deadline, not the handshake's too."""
        r = self._rooms.get(room)
        if r is not None and r.error is None:  # a failing room's timer is its drain grace: leave it
            r.timer.cancel()
            r.timer = asyncio.get_running_loop().call_later(deadline_s, self._fail, r, "timeout")

    def cancel(self, room: int) -> None:
        """Give up on ``room``: its future fails with reason ``cancelled`` once its buffer is free."""
        if (r := self._rooms.get(room)) is not None:
            self._fail(r, "cancelled")

    async def close(self) -> None:
        """Fail every room, wait until their buffers are free, drop all connections."""
        if self._closed:
            return
        self._closed = True
        rooms = list(self._rooms.values())
        for r in rooms:
            self._fail(r, "cancelled")
        if rooms:
            await asyncio.wait([r.result for r in rooms], timeout=DRAIN_S + 1)
        for ep in [p.ep for p in self._peers] + self._slots + [self._drain]:
            close_endpoint(ep)  # also cancels pending truncations
        self._slots.clear()
        await self._tasks.wait(timeout=1)
        for _ in range(100):  # connection handlers return once their endpoint is closed
            if not self._listener.active_clients:
                break
            await asyncio.sleep(0.01)
        self._listener.close()
        self._listener = self._drain = None
        release()

    # -- control connections ------------------------------------------------------------------------

    async def _serve(self, ep: Endpoint) -> None:
        peer = _Peer(ep)
        self._peers.append(peer)
        try:
            while True:
                buf = bytearray(MSG_SIZE)
                await recv(ep, buf)
                self._on_message(peer, Msg.unpack(buf))
        except Exception as e:  # ucxx raises its own error types when the peer closes or dies
            logger.debug("KV sender connection ended: %r", e)
        finally:
            self._peers.remove(peer)
            for room in list(peer.rooms):
                self._fail(self._rooms[room], "peer_lost")
            close_endpoint(ep)

    def _on_message(self, peer: _Peer, msg: Msg) -> None:
        r = self._rooms.get(msg.room)
        if msg.kind is Kind.OFFER:
            self._on_offer(peer, r, msg)
        elif msg.kind is Kind.ABORT:
            if r is not None and r.peer is peer and r.offer.xfer == msg.xfer:
                self._fail(r, msg.reason or "cancelled", "the sender aborted")  # the verdict follows
            else:
                self._reply(peer, msg, Kind.REJECT, msg.reason or "cancelled")

    def _on_offer(self, peer: _Peer, r: _Room | None, msg: Msg) -> None:
        if (reason := self._consumed_early.pop(msg.tag, None)) is not None:
            self._reply(peer, msg, Kind.REJECT, reason)
            return
        if r is None or r.peer is not None or r.error is not None or msg.tag != r.tag:
            self._refuse(peer, msg, "unknown_room")
            return
        r.peer, r.offer = peer, msg
        peer.rooms.add(r.room)
        if msg.nbytes != r.nbytes:  # the receive posted for it drains the payload, see _receive
            self._fail(r, "size_mismatch", f"offered {msg.nbytes} bytes, expected {r.nbytes}")
        elif r.nbytes == 0 or r.landed:
            self._settle(r)

    # -- one room -----------------------------------------------------------------------------------

    async def _receive(self, r: _Room) -> None:
        """Post the room's receive; settle once it landed and the OFFER is in, or once it failed."""
        try:
            slot = self._slots.pop() if self._slots else await connect_bulk(self._worker)
        except Exception as e:
            self._fail(r, "peer_lost", f"no receive slot: {e!r}")
            return
        if r.error is None:  # else failed before anything was posted: the slot is still clean
            r.slot = slot
            try:
                await recv(slot, r.buf, r.tag)
                r.landed = r.consumed = True
            except Exception as e:  # cancelled by _fail(), the payload was too long, or the transport failed
                r.consumed = is_truncation(e)
                self._fail(r, "size_mismatch" if r.consumed else "peer_lost", f"receive failed: {e!r}")
            if r.slot is not slot:  # _fail() closed it to cancel the receive
                slot = None
            r.slot = None
        if slot is not None:
            (close_endpoint if self._closed else self._slots.append)(slot)
        if r.error is None:
            if r.offer is not None:
                self._settle(r)
            return  # the OFFER settles the room when it comes
        if not r.consumed and r.offer is not None and r.error.reason != "peer_lost":
            self._tasks.spawn(self._truncate(r.tag))  # the payload still comes; take it off the sender
        self._settle(r)

    def _fail(self, r: _Room, reason: str, detail: str = "") -> None:
        if r.error is not None or self._rooms.get(r.room) is not r:
            return
        r.error = TransferError(r.room, reason, detail)
        if r.receiving is None or r.receiving.done():
            self._settle(r)
            return
        close_endpoint(r.slot)  # cancels the receive unless its data is already landing
        r.slot = None
        r.timer.cancel()
        r.timer = asyncio.get_running_loop().call_later(DRAIN_S, self._abandon, r)

    def _abandon(self, r: _Room) -> None:
        logger.warning("room %d: payload still landing %.1f s after %s; releasing its buffer anyway",
                       r.room, DRAIN_S, r.error.reason)
        self._settle(r)

    def _settle(self, r: _Room) -> None:
        if self._rooms.get(r.room) is not r:
            return
        del self._rooms[r.room]
        r.timer.cancel()
        if r.error is not None and r.consumed and r.offer is None:
            self._consumed_early[r.tag] = r.error.reason  # its late OFFER is told why, and nothing is drained
            asyncio.get_running_loop().call_later(LATE_OFFER_S, self._consumed_early.pop, r.tag, None)
        if not r.result.done():  # first, so the waiting request resumes before the verdict's send is posted
            if r.error is None:
                r.result.set_result(r.offer.trailer)
            else:
                r.result.set_exception(r.error)
        if r.peer is not None:
            r.peer.rooms.discard(r.room)
            self._reply(r.peer, r.offer, Kind.REJECT if r.error else Kind.DONE, r.error.reason if r.error else "")

    def _refuse(self, peer: _Peer, offer: Msg, reason: str) -> None:
        self._reply(peer, offer, Kind.REJECT, reason)
        if offer.nbytes:
            self._tasks.spawn(self._truncate(offer.tag))

    async def _truncate(self, tag: int) -> None:
        """Match a payload we will not keep with a 1-byte receive: UCX drops it, the sender is released."""
        try:
            await recv(self._drain, np.empty(1, np.uint8), tag)
        except Exception as e:  # truncation is the expected outcome; a closed receiver cancels it
            logger.debug("refused payload drained: %r", e)

    # -- plumbing -----------------------------------------------------------------------------------

    def _reply(self, peer: _Peer, to: Msg, kind: Kind, reason: str = "") -> None:
        self._tasks.spawn(send_quietly(peer.ep, Msg(kind, to.room, to.xfer, reason=reason).pack()))

