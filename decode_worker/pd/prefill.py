"""Prefill side of PD: hold a prompt's KV by room until its decode peer is done with it."""
from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from decode_worker.core.request import RequestError
from decode_worker.metrics import Metrics
from decode_worker.pd.handshake import PD_TOKEN_HEADER, Answer, HandshakeBody, parse_release, prompt_digest
from decode_worker.transfer.agent import KVAgent

if TYPE_CHECKING:
    from decode_worker.cache.pool import KVPool
    from decode_worker.config import ServerConfig
    from decode_worker.scheduler.roles import HeldPrompt

log = logging.getLogger(__name__)


def check_pd_token(expected: str, given: str | None) -> None:
    """Check X-PD-Token against --pd-token in constant time (401, also when one side lacks it)."""
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


RELEASE_POLL_S = 0.001
"""How often notifications are read while a hand-off awaits its release (reading them also drives our progress)."""


@dataclass
class _Lease:
    held: HeldPrompt
    expires: float
    room: int = 0


@dataclass
class KVHandoff:
    """The prefill role's ``PromptDone``: KV held under a lease until released."""

    config: ServerConfig
    pool: KVPool
    agent: KVAgent
    metrics: Metrics
    leases: dict[int, _Lease] = field(default_factory=dict)  # room -> held KV no handshake asked for yet
    handed: dict[int, _Lease] = field(default_factory=dict)  # lease id -> KV answered, until decode releases it
    abandoned: dict[int, float] = field(default_factory=dict)  # room -> until when: its decode peer gave up waiting
    asked_since: dict[int, float] = field(default_factory=dict)  # room -> when a peer first asked for it, not yet here
    _arrived: dict[int, asyncio.Event] = field(default_factory=dict)
    _lease_ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    _watcher: asyncio.Task | None = None

    def hold(self, held: HeldPrompt) -> bool:
        """Hold a PD request's KV for its decode peer."""
        if held.prompt.bootstrap is None:
            return False  # a plain request on a prefill worker is served to the end
        room = held.prompt.bootstrap.room
        if self.abandoned.pop(room, None) is not None:  # nobody will ask: answer the client, then free the KV
            log.info("decode peer of room %d gave up before prefill finished: its KV is freed now", room)
            asyncio.get_running_loop().call_soon(held.release)
            return True
        if (old := self.leases.get(room)) is not None:  # a router reusing a room: the newer request wins
            old.held.release()
        self.leases[room] = _Lease(held, time.monotonic() + self.config.kv_lease_s, room)
        self._arrived.setdefault(room, asyncio.Event()).set()
        return True

    def expire(self) -> None:
        """Free holds whose peer never came and hand-offs never released; forget rooms asked for that never came."""
        now = time.monotonic()
        for room, since in list(self.asked_since.items()):
            if since + self.config.kv_lease_s < now:  # a peer that stopped asking between two polls
                del self.asked_since[room]
                if room not in self.leases:
                    self._arrived.pop(room, None)
        for room, until in list(self.abandoned.items()):
            if until < now:
                del self.abandoned[room]
        for room, lease in list(self.leases.items()):
            if lease.expires < now:
                log.warning("KV lease of room %d expired without a handshake", room)
                self._drop(room)
                lease.held.release()
        for lease_id, lease in list(self.handed.items()):
            if lease.expires < now:
                log.warning("KV of room %d handed off but never released by its decode peer", lease.room)
                self.metrics.transfer_failures.labels("timeout").inc()
                self._release(lease.room, lease_id)

    def _drop(self, room: int) -> _Lease | None:
        self._arrived.pop(room, None)
        return self.leases.pop(room, None)

    async def handshake(self, body: HandshakeBody) -> dict | None:
        """Answer once we hold the room's KV (PD token already checked); None: not yet, after the peer's ``wait_s``."""
        asked = time.monotonic()
        diff = self.pool.layout.differences(body.layout)
        if diff:
            raise RequestError("KV layout mismatch: " + "; ".join(diff), 409, "layout_mismatch")
        try:
            lease = await self._wait_for_room(body.room, body.wait_s)
        except asyncio.CancelledError:
            self._abandon(body.room)
            raise
        if lease is None:
            return None
        held = lease.held
        try:
            return self._answer(body, held, asked).to_json()
        except BaseException:  # a rejected hand-off frees the KV it held
            held.release()
            raise

    def _answer(self, body: HandshakeBody, held: HeldPrompt, asked: float) -> Answer:
        """Check decode's view of the prompt; hand its pages off under a new lease."""
        prompt = held.prompt.prompt_ids
        if body.prompt_len != len(prompt) or body.prompt_digest != prompt_digest(prompt):
            raise RequestError(f"prompt mismatch for room {body.room}: decode has {body.prompt_len} tokens "
                               f"(digest {body.prompt_digest}), prefill has {len(prompt)} (digest "
                               f"{prompt_digest(prompt)})", 409, "digest_mismatch")
        lease_id, hold, now = next(self._lease_ids), self.config.kv_lease_s, time.monotonic()
        self.handed[lease_id] = _Lease(held, now + hold, body.room)  # the hold runs from the instant waited_s ends
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._watch_releases())
        metadata = b"" if body.known_agent == self.agent.name else self.agent.metadata()
        first = held.first
        return Answer(body.room, lease_id, held.prompt_pages(),
                      first.token, first.logprob, self.agent.pool, metadata, hold, waited_s=now - asked,
                      top_logprobs=first.top, prompt_logprobs=first.prompt)

    async def _wait_for_room(self, room: int, wait_s: float | None) -> _Lease | None:
        """Wait for the room's KV up to the lease time from the first ask; None when ``wait_s`` ends first."""
        now = time.monotonic()
        gives_up = self.asked_since.setdefault(room, now) + self.config.kv_lease_s
        poll_ends = gives_up if wait_s is None else min(gives_up, now + wait_s)
        event = self._arrived.setdefault(room, asyncio.Event())
        try:
            async with asyncio.timeout(max(0.0, poll_ends - now)):
                await event.wait()
        except TimeoutError:
            if poll_ends < gives_up:
                return None  # still computing (or not here yet): the peer asks again
            self.asked_since.pop(room, None)
            self._arrived.pop(room, None)
            raise RequestError(f"unknown room {room}: no prefilled request with it arrived in time", 404, "unknown_room") from None
        self.asked_since.pop(room, None)
        lease = self._drop(room)
        if lease is None:
            raise RequestError(f"room {room} was already handed off or expired", 404, "unknown_room")
        return lease

    def _abandon(self, room: int) -> None:
        """The decode peer left: free the room's KV now or on arrival."""
        self._arrived.pop(room, None)
        self.asked_since.pop(room, None)
        if (lease := self.leases.pop(room, None)) is not None:
            lease.held.release()
        else:
            self.abandoned[room] = time.monotonic() + self.config.kv_lease_s

    async def _watch_releases(self) -> None:
        while self.handed:
            for message in self.agent.notifications():
                if (release := parse_release(message)) is not None:
                    self._release(*release)
            await asyncio.sleep(RELEASE_POLL_S)

    def _release(self, room: int, lease_id: int) -> None:
        lease = self.handed.get(lease_id)
        if lease is not None and lease.room == room:  # a late or foreign notification frees nothing
            del self.handed[lease_id]
            lease.held.release()

    async def close(self) -> None:
        """Let peers finish reading (up to the transfer deadline), then unregister."""
        deadline = time.monotonic() + self.config.transfer_timeout_s
        while self.handed and time.monotonic() < deadline and self._watcher is not None and not self._watcher.done():
            await asyncio.sleep(0.01)
        if self._watcher is not None:
            self._watcher.cancel()
        self.agent.close()
