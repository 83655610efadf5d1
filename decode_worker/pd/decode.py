"""Decode side of PD: handshake while queued, read the delta once admitted (docs/reliability.md)."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx

from decode_worker.config import ServerConfig
from decode_worker.core.prefill_hosts import prefill_hosts
from decode_worker.core.request import Bootstrap, Prefilled, RequestError
from decode_worker.metrics import Metrics
from decode_worker.pd.handshake import (
    HANDSHAKE_PATH,
    PD_TOKEN_HEADER,
    Answer,
    Asked,
    BadAnswer,
    prompt_digest,
    release_message,
)
from decode_worker.scheduler.roles import PeerPrompt, PendingReceive
from decode_worker.transfer.agent import KVAgent, Peer, TransferError

if TYPE_CHECKING:
    from decode_worker.cache.pool import KVPool

log = logging.getLogger(__name__)
_HANDSHAKE_REASONS = {401: "unauthorized", 404: "unknown_room", 409: "mismatch"}
HANDSHAKE_KEEPALIVE_S = 1.0
"""How long an idle connection to a prefill worker is kept for the next handshake; well under the server's."""
HOLD_MARGIN_S = 1.0
"""How much earlier than prefill's hold our read must end."""
MAX_ANSWER_BYTES = 64 << 20
"""The largest handshake answer read: its agent metadata and a long prompt's top logprobs fit many times over."""
PARSE_ON_LOOP_BYTES = 64 << 10
"""Answers larger than this are parsed off the event loop."""


@dataclass(frozen=True)
class _Reply:
    """A handshake call's status and body, read whole within ``MAX_ANSWER_BYTES``."""

    status_code: int
    content: bytes

    async def json(self) -> object:
        """The body as JSON, parsed off the loop when large; None when it is not JSON."""
        try:
            if len(self.content) <= PARSE_ON_LOOP_BYTES:
                return json.loads(self.content)
            return await asyncio.get_running_loop().run_in_executor(None, json.loads, self.content)
        except (ValueError, RecursionError):
            return None


def handshake_client(timeout_s: float) -> httpx.AsyncClient:
    """Handshake client whose idle connections close well before the server's."""
    return httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(
        max_connections=100, max_keepalive_connections=20, keepalive_expiry=HANDSHAKE_KEEPALIVE_S))


@dataclass(eq=False)
class _Room:
    """One request's handshake, then its answer."""

    boot: Bootstrap
    asked: float  # monotonic time the last handshake call was posted (prefill counts waited_s from it)
    task: asyncio.Task[tuple[Answer, Peer]] | None = None
    answered: float = 0.0  # monotonic time prefill's answer arrived: decode's own share of TTFT starts here
    released: bool = False  # prefill was told to free the room's pages (by the read's notification or on its own)


class DeltaKVFetcher:
    """The decode role's ``PromptSource``: prompt KV comes from the prefill peer."""

    def __init__(self, config: ServerConfig, pool: KVPool, agent: KVAgent, metrics: Metrics, vocab_size: int):
        self.config = config
        self.pool = pool
        self.agent = agent
        self.metrics = metrics
        self.http = handshake_client(config.handshake_timeout_s)
        self._rooms: dict[str, _Room] = {}  # by request id
        self._known: dict[tuple[str, int], str] = {}  # prefill (host, port) -> its agent, loaded here
        self._reading: Counter[str] = Counter()  # agent -> its reads in flight
        self._replaced: set[str] = set()  # agents a restarted prefill replaced, dropped once their reads end
        self.vocab_size = vocab_size  # the model's: prefill's first token must be below it

    async def close(self) -> None:
        for rid in list(self._rooms):
            self._forget_room(rid)
        await self.http.aclose()
        self.agent.close()

    def _fail(self, reason: str, message: str, status: int = 502) -> RequestError:
        self.metrics.transfer_failures.labels(reason).inc()
        return RequestError(message, status, "kv_transfer_error")

    def receives(self, prompt: PeerPrompt) -> bool:
        """Every fresh prompt comes from prefill."""
        return True

    def prepare(self, prompt: PeerPrompt, wakeup: Callable[[], None]) -> None:
        """Post the handshake now, racing the L3 prefetch."""
        if prompt.rid not in self._rooms:
            self._start(prompt).task.add_done_callback(lambda _: wakeup())

    def answered(self, prompt: PeerPrompt) -> bool:
        """True once prefill answered or the handshake failed."""
        room = self._rooms.get(prompt.rid)
        return room is not None and room.task.done()

    def forget(self, prompt: PeerPrompt) -> None:
        """Stop the handshake; release prefill's pages if answered."""
        self._forget_room(prompt.rid)

    async def receive(self, pending: PendingReceive) -> Prefilled:
        """Read the prompt's KV into ``pending.pages``; prefill's first token, or ``RequestError`` (502/504)."""
        prompt = pending.prompt
        room = self._rooms.get(prompt.rid) or self._start(prompt)
        try:
            answer, peer = await room.task
            try:
                first = answer.prefilled(prompt.logprob_start, prompt.top_logprobs)
            except BadAnswer as e:
                raise self._fail("bad_answer", f"prefill {room.boot.host}:{room.boot.port} answered: {e}") from e
            read_s = await self._read(pending, room, answer, peer, pending.pages.tolist())
            pending.own_since = room.answered + read_s  # the first token's emission observes decode_own_seconds
            return first
        finally:
            self._forget_room(prompt.rid)

    async def _read(self, pending: PendingReceive, room: _Room, answer: Answer, peer: Peer, into: list[int]) -> float:
        """Read the delta into ``into`` within prefill's hold; the seconds it took."""
        ps, prompt = self.pool.page_size, pending.prompt.prompt_ids
        prefix_pages = pending.prefix_pages
        started = time.monotonic()
        hold_ends = room.asked + answer.waited_s + answer.hold_s - HOLD_MARGIN_S  # monotonic: docs/reliability.md
        deadline = min(started + self.config.transfer_timeout_s, hold_ends)
        if deadline <= started:  # admitted after prefill's hold: its pages may be reused by now
            raise self._fail("timeout", f"prefill {room.boot.host}:{room.boot.port} held room {answer.room}'s KV "
                                        f"for {answer.hold_s:.0f}s; it was gone before this request was admitted", 504)
        if into:  # a full prefix hit reads nothing, and prefill still waits for the release
            self._reading[peer.name] += 1
            try:
                await self.agent.read(answer.room, peer, into, answer.pages[prefix_pages:], deadline)
            except TransferError as e:
                if e.reason == "unstoppable":
                    self._quarantine(pending)
                raise self._fail(e.reason, f"KV transfer from prefill {room.boot.host}:{room.boot.port} failed: "
                                           f"{e.reason}" + (f" ({e.detail})" if e.detail else ""),
                                 504 if e.reason == "timeout" else 502) from e
            finally:
                self._done_reading(peer.name)
            room.released = self.agent.notify(peer.name, release_message(answer.room, answer.lease))
        self.metrics.kv_received_tokens.inc(len(prompt) - prefix_pages * ps)
        self.metrics.kv_received_bytes.inc(len(into) * self.pool.layout.page_bytes)
        took = time.monotonic() - started
        self.metrics.kv_transfer.observe(took)
        return took

    def _done_reading(self, name: str) -> None:
        """A read ended; a replaced agent goes after its last read."""
        self._reading[name] -= 1
        if not self._reading[name]:
            del self._reading[name]
            if name in self._replaced:
                self._replaced.discard(name)
                self.agent.drop_peer(name)

    @staticmethod
    def _quarantine(pending: PendingReceive) -> None:
        """Never free the pages of a read that could not be stopped."""
        pending.keep_pages_out_of_use()
        log.error("request %s: %d KV pages are kept out of use for good (a read into them could not be stopped)",
                  pending.prompt.rid, len(pending.pages))

    def _start(self, prompt: PeerPrompt) -> _Room:
        room = self._rooms[prompt.rid] = _Room(prompt.bootstrap, time.monotonic())
        room.task = asyncio.get_running_loop().create_task(self._handshake(room, prompt.prompt_ids))
        return room

    def _forget_room(self, rid: str) -> None:
        room = self._rooms.pop(rid, None)
        if room is None:
            return
        if not room.task.done():
            room.task.cancel()
        elif not room.released and not room.task.cancelled() and room.task.exception() is None:
            answer, peer = room.task.result()
            room.released = True
            self.agent.notify(peer.name, release_message(answer.room, answer.lease))

    def _auth_headers(self, boot: Bootstrap) -> dict[str, str]:
        """PD token and API key headers, for a ``--prefill-hosts`` worker only."""
        if not prefill_hosts(self.config.prefill_hosts).allowed_now(boot.host, boot.port):
            raise RequestError(f"bootstrap_host {boot.host!r} is not in --prefill-hosts: nothing sent to it")
        headers = {PD_TOKEN_HEADER: self.config.pd_token} if self.config.pd_token else {}
        if self.config.api_key:
            headers["Authorization"] = f"Bearer {self.config.api_key}"
        return headers

    async def _handshake(self, room: _Room, prompt: list[int]) -> tuple[Answer, Peer]:
        """Ask prefill for the room until it holds the KV (it answers 202 while computing); loads its agent once."""
        boot = room.boot
        peer_key = (boot.host, boot.port)
        wait_s = self.config.handshake_timeout_s / 2
        body = {"room": boot.room, "prompt_len": len(prompt), "prompt_digest": prompt_digest(prompt),
                "layout": self.pool.layout.describe(), "nixl_agent": self.agent.name,
                "known_agent": self._known.get(peer_key, ""), "wait_s": wait_s}
        url = f"http://{boot.host}:{boot.port}{HANDSHAKE_PATH}"
        first_asked = time.monotonic()
        patience = self.config.kv_lease_s + self.config.handshake_timeout_s
        while (resp := await self._ask(room, url, body)).status_code == 202:
            if time.monotonic() >= first_asked + patience:  # bounded by our own clock, not prefill's word
                raise self._fail("timeout", f"prefill {boot.host}:{boot.port} had not computed room {boot.room} "
                                            f"within {patience:g}s", 504)
            await asyncio.sleep(max(0.0, room.asked + wait_s - room.answered))  # one ask per wait_s, however fast
        if resp.status_code != 200:
            try:
                detail = str((await resp.json())["error"]["message"])[:300]
            except (TypeError, KeyError):
                detail = resp.content[:300].decode(errors="replace")
            reason = _HANDSHAKE_REASONS.get(resp.status_code, "handshake_rejected")
            raise self._fail(reason, f"prefill rejected the handshake ({resp.status_code}): {detail}")
        round_trip = room.answered - room.asked  # the last call's: prefill's waited_s must fit in it
        self.metrics.kv_handshake_seconds.observe(room.answered - first_asked)  # prefill's queue and compute
        asked_for = Asked(boot.room, len(prompt), self.pool.page_size, self.agent.pool.page_bytes, self.vocab_size,
                          round_trip)
        data = await resp.json()  # None when not JSON (a truncated body): refused below as not an object
        try:
            answer = Answer.from_json(data, asked_for)
        except ValueError as e:  # a field out of range: this request fails, nothing else
            raise self._fail("bad_answer", f"prefill {boot.host}:{boot.port} sent an unusable handshake answer: "
                                           f"{e}") from e
        return answer, await self._peer(peer_key, answer)

    async def _ask(self, room: _Room, url: str, body: dict) -> _Reply:
        """One handshake call, each within the handshake timeout; ``room.asked``/``answered`` time the last one.
        The answer is read up to ``MAX_ANSWER_BYTES``: a larger one fails the request without being held."""
        room.asked = time.monotonic()
        try:
            async with (asyncio.timeout(self.config.handshake_timeout_s),
                        self.http.stream("POST", url, json=body, headers=self._auth_headers(room.boot)) as resp):
                chunks, size = [], 0
                async for chunk in resp.aiter_bytes():
                    size += len(chunk)
                    if size > MAX_ANSWER_BYTES:
                        raise self._fail("bad_answer", f"prefill handshake at {url} answered more than "
                                                       f"{MAX_ANSWER_BYTES} bytes")
                    chunks.append(chunk)
        except (httpx.TimeoutException, TimeoutError) as e:
            raise self._fail("timeout", f"prefill handshake at {url} timed out", 504) from e
        except httpx.HTTPError as e:
            raise self._fail("handshake_unreachable", f"prefill handshake at {url} failed: {e!r}") from e
        room.answered = time.monotonic()
        return _Reply(resp.status_code, b"".join(chunks))

    async def _peer(self, peer_key: tuple[str, int], answer: Answer) -> Peer:
        """Prefill's agent, loaded once, within the handshake timeout."""
        peer = self.agent.peer(answer.pool.agent)
        if peer is not None:
            return peer
        if not answer.metadata:
            raise self._fail("handshake_rejected", f"prefill agent {answer.pool.agent} sent no metadata")
        if (old := self._known.get(peer_key)) not in (None, answer.pool.agent):
            self._drop_agent(old)
        timeout = self.config.handshake_timeout_s
        try:
            peer = await self.agent.load_peer(answer.metadata, answer.pool, timeout)
        except TimeoutError as e:
            raise self._fail("timeout", f"loading prefill agent {answer.pool.agent} took over {timeout:g}s", 504) from e
        except Exception as e:  # nixl raises its own error types for metadata it cannot load
            raise self._fail("peer_lost", f"cannot load prefill agent {answer.pool.agent}: {e!r}") from e
        self._known[peer_key] = peer.name
        return peer

    def _drop_agent(self, name: str) -> None:
        """Drop a replaced agent once its reads end."""
        if self._reading[name]:
            self._replaced.add(name)
        else:
            self._reading.pop(name, None)
            self.agent.drop_peer(name)
