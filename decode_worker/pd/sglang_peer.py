"""Decode side of SGLang's PD protocol (``--pd-peer-protocol sglang``): an unmodified SGLang prefill pushes the
prompt's KV and first token into this worker's pool (docs/sglang-prefill.md).

Per prefill: its bootstrap server is asked for its layout and its rank's ZMQ endpoint, its model is checked at its
HTTP ``/model_info``, and this worker's memory is registered once over ZMQ. Per request, once admission has
allocated the delta pages: the pages and an aux slot go to prefill (which waits for them before it computes),
then NIXL notifications say what landed. Pages a prefill may still write after a failure stay fenced.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import numpy as np
import torch
import zmq

from decode_worker.cache.pool import KVPool
from decode_worker.config import ServerConfig
from decode_worker.core.prefill_hosts import prefill_hosts
from decode_worker.core.request import Bootstrap, Prefilled, RequestError
from decode_worker.metrics import Metrics
from decode_worker.pd.sglang_wire import (
    AuxLayout,
    Endpoint,
    PrefillServerInfo,
    RankInfo,
    Registration,
    RoomProgress,
    TransferRequest,
    abort_frames,
    parse_notification,
)
from decode_worker.scheduler.roles import PeerPrompt, PendingReceive
from decode_worker.transfer.agent import KVAgent

log = logging.getLogger(__name__)
POLL_S = 0.001
"""How often NIXL notifications are read while a room waits (reading them also drives UCX's progress)."""
FENCE_S = 60.0
"""How long pages and an aux slot stay out of use after a room failed or was aborted: SGLang 0.5.18 does not
acknowledge an abort, so a write it had started (or starts late) may still land there."""
RETRY_S = 1.0
"""How long a failed discovery of a prefill answers its requests before the next request tries again."""
FENCE_SHARE = 0.25
"""Most of the pool fenced at once; past it new requests from SGLang prefills get 503 until fences end."""


@dataclass
class _Prefill:
    """One SGLang prefill, by bootstrap address: its rank's socket once discovered and registered."""

    boot: tuple[str, int]
    task: asyncio.Task[None]
    socket: zmq.Socket | None = None
    failed_at: float | None = None
    wakes: bool = False  # the scheduler's wakeup is called when ``task`` ends

    def stale(self) -> bool:
        """True when its discovery failed long enough ago (or its socket was dropped) to try again."""
        if self.task.done() and self.socket is None:
            return self.failed_at is None or time.monotonic() - self.failed_at > RETRY_S
        return False


@dataclass
class _Fence:
    pages: list[int]
    slot: int
    until: float


@dataclass
class _Room:
    progress: RoomProgress = field(default_factory=RoomProgress)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    error: str = ""


class AuxSlots:
    """SGLang's aux ("metadata") buffers, registered with NIXL: one slot per room in flight."""

    def __init__(self, agent: KVAgent, layout: AuxLayout, slots: int):
        self.layout = layout
        self.buffers = [torch.zeros(slots * n, dtype=torch.uint8) for n in layout.item_lens]
        for buffer in self.buffers:
            agent.register_extra(buffer)
        self.free = list(range(slots))

    def take(self) -> int | None:
        return self.free.pop() if self.free else None

    def read(self, slot: int) -> list[bytes]:
        return [b[slot * n: (slot + 1) * n].numpy().tobytes() for b, n in zip(self.buffers, self.layout.item_lens)]

    def clear(self, slot: int) -> None:
        for b, n in zip(self.buffers, self.layout.item_lens):
            b[slot * n: (slot + 1) * n] = 0


class SGLangPrefillSource:
    """The decode role's ``PromptSource`` against SGLang prefills."""

    def __init__(self, config: ServerConfig, pool: KVPool, agent: KVAgent, metrics: Metrics, *, vocab_size: int,
                 hidden_size: int, model_name: str, free_pages: Callable[[np.ndarray], None]):
        self.config = config
        self.pool = pool
        self.agent = agent
        self.metrics = metrics
        self.vocab_size = vocab_size
        self.model_name = model_name
        self.free_pages = free_pages  # the cache's: fenced pages go back once their fence ends
        self.layout = pool.layout
        self.aux = AuxSlots(agent, AuxLayout(hidden_size * pool.layout.dtype.itemsize),
                            2 * config.max_running_requests)
        self.http = httpx.AsyncClient(timeout=config.handshake_timeout_s)
        self.zmq = zmq.Context()
        self._prefills: dict[tuple[str, int], _Prefill] = {}
        self._rooms: dict[int, _Room] = {}
        self._fences: list[_Fence] = []
        self._pump: asyncio.Task | None = None
        self.me = Endpoint(config.host, config.port, agent.name)

    # ---- PromptSource ---------------------------------------------------------------------------------------

    def receives(self, prompt: PeerPrompt) -> bool:
        return True

    def prepare(self, prompt: PeerPrompt, wakeup: Callable[[], None]) -> None:
        """Discover and register with the request's prefill while the request queues."""
        prefill = self._prefill(prompt.bootstrap)
        if not prefill.wakes:  # called each step for each queued request: one callback per discovery
            prefill.wakes = True
            prefill.task.add_done_callback(lambda _: wakeup())

    def answered(self, prompt: PeerPrompt) -> bool:
        """True once its prefill is registered, or its discovery failed (the request then fails with it)."""
        boot = prompt.bootstrap
        prefill = self._prefills.get((boot.host, boot.port))
        return prefill is not None and prefill.task.done()

    def forget(self, prompt: PeerPrompt) -> None:
        pass  # a registration serves every request to that prefill

    async def receive(self, pending: PendingReceive) -> Prefilled:
        """Tell prefill where the delta goes, wait for it and the aux slot; prefill's first token."""
        prompt, pages = pending.prompt, pending.pages.tolist()
        boot = prompt.bootstrap
        if prompt.logprob_start is not None:
            raise RequestError("logprob_start_len: an SGLang prefill does not send prompt logprobs to its decode "
                               "peer (--pd-peer-protocol sglang); leave it unset or -1")
        if boot.room in self._rooms:
            raise RequestError(f"bootstrap_room {boot.room} is already being received", 409, "conflict")
        prefill = self._prefill(boot)
        try:
            await asyncio.shield(prefill.task)
        except RequestError as e:  # the discovery's failure is this request's: an error of its own, no shared frames
            raise RequestError(str(e), e.status, e.kind) from None
        if prefill.socket is None:  # dropped by another request's failed send since: the next one registers anew
            raise self._fail("peer_lost", f"SGLang prefill {boot.host}:{boot.port} stopped taking requests")
        if self._fenced_pages() + len(pages) > FENCE_SHARE * self.pool.num_pages:
            raise self._fail("fenced", f"{self._fenced_pages()} KV pages wait for SGLang prefills that did not "
                                       "finish; try again shortly", 503)
        slot = self.aux.take()
        if slot is None:
            raise self._fail("fenced", "no aux slot is free for another SGLang transfer; try again shortly", 503)
        room = self._rooms[boot.room] = _Room()
        started = time.monotonic()
        ok = False
        try:
            self.aux.clear(slot)
            request = TransferRequest(boot.room, self.me, pages, slot, prefix_tokens=pending.prefix_pages
                                      * self.layout.page_size)
            self._send(prefill, request.frames())
            self._start_pump()
            deadline = self.config.handshake_timeout_s + self.config.transfer_timeout_s
            try:
                async with asyncio.timeout(deadline):
                    while not room.progress.done and not room.error:
                        room.event.clear()
                        await room.event.wait()
            except TimeoutError:
                raise self._fail("timeout", f"SGLang prefill {boot.host}:{boot.port} did not send room {boot.room} "
                                            f"within {deadline:g}s", 504) from None
            if room.error:
                raise self._fail("bad_answer", f"SGLang prefill {boot.host}:{boot.port}: {room.error}")
            first = self._first_token(boot, slot, prompt.top_logprobs)
            ok = True
        finally:
            del self._rooms[boot.room]
            if ok:
                self.aux.free.append(slot)
            else:  # a write may still come: keep its pages and slot out of use, and tell prefill to stop
                self._fence(pending, pages, slot)
                if prefill.socket is not None:
                    self._send(prefill, abort_frames(boot.room), quiet=True)
        took = time.monotonic() - started
        self.metrics.kv_transfer.observe(took)
        self.metrics.kv_received_tokens.inc(len(prompt.prompt_ids) - pending.prefix_pages * self.layout.page_size)
        self.metrics.kv_received_bytes.inc(len(pages) * self.layout.page_bytes)
        pending.own_since = time.monotonic()
        return first

    async def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
        for prefill in self._prefills.values():
            prefill.task.cancel()
            if prefill.socket is not None:
                prefill.socket.close(linger=0)
        self.zmq.term()
        await self.http.aclose()
        self.agent.close()

    # ---- discovery and registration ----------------------------------------------------------------------

    def _prefill(self, boot: Bootstrap) -> _Prefill:
        """The prefill at ``boot``, its discovery started (again, once a failed one is ``RETRY_S`` old)."""
        key = (boot.host, boot.port)
        prefill = self._prefills.get(key)
        if prefill is None or prefill.stale():
            task = asyncio.get_running_loop().create_task(self._register(key))
            prefill = self._prefills[key] = _Prefill(key, task)
            task.add_done_callback(lambda t, p=prefill: self._registered(p, t))
        return prefill

    @staticmethod
    def _registered(prefill: _Prefill, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is not None:
            prefill.failed_at = time.monotonic()
        else:
            prefill.socket = task.result()

    async def _register(self, boot: tuple[str, int]) -> zmq.Socket:
        """Check the prefill at ``boot`` and register this worker's memory with its rank; the rank's socket."""
        host, port = boot
        where = f"SGLang prefill bootstrap {host}:{port}"
        ranks = "prefill_dp_rank={0}&prefill_cp_rank={0}&target_tp_rank={1}&target_pp_rank={0}"
        try:
            layout = await self._get(f"http://{host}:{port}/route?" + ranks.format(-1, -1))
            info = PrefillServerInfo.parse(layout)
            self._check(info, where)
            await self._check_model(host, layout.get("prefill_http_port"), where)
            rank = RankInfo.parse(await self._get(f"http://{host}:{port}/route?" + ranks.format(0, 0)))
        except ValueError as e:
            raise self._fail("handshake_rejected", f"{where}: {e}") from None
        rank_host = host if rank.ip in ("0.0.0.0", "::") else rank.ip
        if not await prefill_hosts(self.config.prefill_hosts).allowed(rank_host, port):
            raise self._fail("handshake_rejected", f"{where} names its rank at {rank.ip}, which --prefill-hosts "
                                                   "does not list: nothing sent there")
        sock = self.zmq.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{rank_host}:{rank.port}")
        try:
            sock.send_multipart(self._registration().frames(), flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            raise self._fail("peer_lost", f"{where}: registering failed: {e!r}") from e
        log.info("registered with SGLang prefill %s:%d (its rank at %s:%d)", host, port, rank.ip, rank.port)
        return sock

    def _registration(self) -> Registration:
        layout = self.layout
        base, region = self.pool.buffer.data_ptr(), layout.page_bytes // (2 * layout.num_layers)
        regions = 2 * layout.num_layers  # each layer's K, then its V: a page's [layer, K|V, token, head, dim]
        return Registration(self.me, self.agent.metadata(), kv_ptrs=[base + r * region for r in range(regions)],
                            kv_strides=[layout.page_bytes] * regions, num_pages=self.pool.num_pages,
                            aux_ptrs=[b.data_ptr() for b in self.aux.buffers],
                            layer_ids=[r // 2 for r in range(regions)])

    def _check(self, info: PrefillServerInfo, where: str) -> None:
        ours = self.layout.describe()["dtype"]  # the name SGLang uses too ("bfloat16", "float32")
        sizes = {"attention TP": info.attn_tp_size, "pipeline parallel": info.pp_size,
                 "context parallel": info.attn_cp_size, "data parallel": info.dp_size}
        problems = [f"{name} {size} (this decode takes KV from 1 only)" for name, size in sizes.items() if size != 1]
        if info.page_size != self.layout.page_size:
            problems.append(f"page size {info.page_size}, ours {self.layout.page_size} (--page-size)")
        if info.kv_cache_dtype not in (ours, "auto"):
            problems.append(f"KV dtype {info.kv_cache_dtype}, ours {ours}")
        if problems:
            raise ValueError(f"{where} does not fit this decode worker: " + "; ".join(problems))

    async def _check_model(self, host: str, http_port: object, where: str) -> None:
        if not isinstance(http_port, int) or isinstance(http_port, bool) or not 0 < http_port < 65536:
            raise ValueError("its /route names no prefill_http_port, so its model cannot be checked")
        data = await self._get(f"http://{host}:{http_port}/model_info")
        theirs = data.get("served_model_name") if isinstance(data, dict) else None
        if theirs != self.model_name:
            raise ValueError(f"it serves model {str(theirs)[:80]!r}, this decode worker {self.model_name!r} "
                             "(--served-model-name names the same model on both)")

    async def _get(self, url: str) -> object:
        try:
            resp = await self.http.get(url)
        except httpx.HTTPError as e:
            raise self._fail("handshake_unreachable", f"{url} failed: {e!r}") from e
        if resp.status_code != 200:
            raise self._fail("handshake_rejected", f"{url} answered {resp.status_code}: {resp.text[:200]}")
        try:
            return resp.json()
        except ValueError:
            raise ValueError(f"{url} did not answer JSON") from None

    def _send(self, prefill: _Prefill, frames: list[bytes], quiet: bool = False) -> None:
        try:
            prefill.socket.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            if quiet:
                log.warning("SGLang prefill %s:%d: %r", *prefill.boot, e)
                return
            prefill.socket.close(linger=0)
            prefill.socket = None  # the next request discovers and registers anew
            raise self._fail("peer_lost", f"SGLang prefill {prefill.boot[0]}:{prefill.boot[1]} takes no more "
                                          f"requests: {e!r}") from e

    # ---- notifications, aux, fences ------------------------------------------------------------------------

    def _start_pump(self) -> None:
        if self._pump is None or self._pump.done():
            self._pump = asyncio.get_running_loop().create_task(self._read_notifications())

    async def _read_notifications(self) -> None:
        """While rooms wait: read NIXL notifications (which also drives the writes' progress) and note them."""
        while self._rooms:
            for message in self.agent.notifications():
                self._note(message)
            await asyncio.sleep(POLL_S)

    def _note(self, message: bytes) -> None:
        try:
            notification = parse_notification(message)
        except ValueError as e:
            log.warning("SGLang notification refused: %s", e)
            return
        room = self._rooms.get(notification.room)
        if room is None:
            log.debug("notification for room %d, which no request waits for: %r", notification.room, message)
            return
        try:
            room.progress.note(notification)
        except ValueError as e:
            room.error = str(e)
        room.event.set()

    def _first_token(self, boot: Bootstrap, slot: int, top_logprobs: int) -> Prefilled:
        try:
            record = self.aux.layout.read(self.aux.read(slot))
        except ValueError as e:
            raise self._fail("bad_answer", f"SGLang prefill {boot.host}:{boot.port}: {e}") from e
        if record.room != boot.room:
            raise self._fail("bad_answer", f"SGLang prefill {boot.host}:{boot.port} wrote the aux slot of room "
                                           f"{record.room} for room {boot.room}")
        if not 0 <= record.first_token < self.vocab_size:
            raise self._fail("bad_answer", f"SGLang prefill {boot.host}:{boot.port} sent first token "
                                           f"{record.first_token}, outside the vocabulary of {self.vocab_size}")
        if not (math.isfinite(record.logprob) and record.logprob <= 0):
            raise self._fail("bad_answer", f"SGLang prefill {boot.host}:{boot.port} sent logprob {record.logprob}")
        return Prefilled(record.first_token, record.logprob, record.top_logprobs[:top_logprobs])

    def _fence(self, pending: PendingReceive, pages: list[int], slot: int) -> None:
        pending.keep_pages_out_of_use()
        self._fences.append(_Fence(pages, slot, time.monotonic() + FENCE_S))
        self.metrics.fenced_pages.set(self._fenced_pages())
        asyncio.get_running_loop().call_later(FENCE_S, self._end_fences)

    def _end_fences(self) -> None:
        now = time.monotonic()
        ended = [f for f in self._fences if f.until <= now]
        if not ended:
            return
        self._fences = [f for f in self._fences if f.until > now]
        for fence in ended:
            self.free_pages(np.asarray(fence.pages, dtype=np.int64))  # no write can come now: back into use
            self.aux.free.append(fence.slot)
        self.metrics.fenced_pages.set(self._fenced_pages())

    def _fenced_pages(self) -> int:
        return sum(len(f.pages) for f in self._fences)

    def _fail(self, reason: str, message: str, status: int = 502) -> RequestError:
        self.metrics.transfer_failures.labels(reason).inc()
        return RequestError(message, status, "kv_transfer_error")
