"""Continuous-batching scheduler on one asyncio event loop.

Queues: prealloc (FIFO, two-phase cache match + budget check) -> loading (L2->L1 load-back, or the PD KV
transfer on a decode worker) -> extend (prompt tokens not in cache, computed locally) -> running (decode
batch). Retracted requests wait in their own queue and block new admissions until they are back.
The model forward runs on a dedicated thread so HTTP and UCX progress never stall behind it.

With L3 storage, the first few requests in prealloc prefetch what the store holds into L2 while they wait
(``lookahead.py``); the head of the queue is admitted once its prefetch settled.

Page ownership of a request: its cache handle locks the matched prefix (pages the tree owns); after the
load-back the request owns the remaining pages of ``seq.pages``. With the radix cache on, the full pages a request
computed (an extend step) or received (PD) join the tree at once and its handle moves down to lock them
(``_cache_computed``), so concurrent requests sharing a fresh prefix hit it. Every exit path goes through
``_release``, which inserts what is fully computed (when the radix cache is on) and frees the rest.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from decode_worker.cache.hicache import HierarchicalCache, LoadHandle
from decode_worker.cache.pool import OutOfPages
from decode_worker.core.request import (
    GenerateInput,
    RequestError,
    RequestStream,
    TokenEvent,
)
from decode_worker.core.sequence import Sequence, check_finish, check_fits
from decode_worker.metrics import Metrics
from decode_worker.model.runner import ModelRunner
from decode_worker.model.sampler import make_generator, sample
from decode_worker.scheduler.lookahead import StorageFetch, StorageLookahead

log = logging.getLogger(__name__)

# A decode worker's source of prompt KV: receives tokens [prefix, prompt_len) into the given pages and
# returns prefill's first token and its logprob. Raises RequestError (with the failure reason) on failure.
KVSource = Callable[["Req", torch.Tensor], Awaitable[tuple[int, float]]]

@dataclass(eq=False)
class Req:
    inp: GenerateInput
    stream: RequestStream
    seq: Sequence
    handle: LoadHandle | None = None
    prefix_pages: int = 0  # leading pages of seq.pages owned by the tree (locked through the handle)
    cached: dict[str, int] = field(default_factory=dict)
    transfer: asyncio.Task | None = None
    loading_since: float = 0.0
    aborted: RequestError | None = None
    first_token_sent: bool = False
    retries: int = 0
    fetch: StorageFetch | None = None
    storage_span: range = range(0)  # pages of the prompt this request's prefetch put into the tree

    @property
    def rid(self) -> str:
        return self.inp.rid


class Scheduler:
    def __init__(self, runner: ModelRunner, cache: HierarchicalCache, metrics: Metrics, *, eos_token_ids: tuple[int, ...],
                 decode_text: Callable[[list[int]], str], radix: bool, max_running: int, max_prefill_tokens: int,
                 load_back_timeout_s: float, kv_source: KVSource | None = None,
                 on_prefilled: Callable[[Req], bool] | None = None):
        self.runner = runner
        self.cache = cache
        self.metrics = metrics
        self.eos_token_ids = eos_token_ids
        self.decode_text = decode_text
        self.radix = radix
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.load_back_timeout_s = load_back_timeout_s
        self.kv_source = kv_source
        self.on_prefilled = on_prefilled  # prefill role: keeps the request's KV for its decode peer
        self.page_size = runner.page_size
        self.prealloc: deque[Req] = deque()
        self.retracted: deque[Req] = deque()
        self.loading: list[Req] = []
        self.extend: deque[Req] = deque()
        self.running: list[Req] = []
        self.held: dict[str, Req] = {}  # prefill role: finished requests whose KV awaits hand-off
        self.requests: dict[str, Req] = {}
        self._wakeup = asyncio.Event()
        self.lookahead = StorageLookahead(cache, self.page_size, self._match_key, self._wakeup) if cache.storage else None
        self._forward_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
        self._task: asyncio.Task | None = None
        self.steps = 0
        self.stopping = False

    # ---- public ----------------------------------------------------------------------------------------------

    def check_fits(self, inp: GenerateInput) -> None:
        """Reject at once (400) what can never run here."""
        config = self.runner.config
        try:
            check_fits(inp.prompt_ids, inp.params, max_context=config.max_context, vocab_size=config.vocab_size,
                       page_size=self.page_size, total_pages=self.cache.device_alloc.total)
        except ValueError as e:
            raise RequestError(str(e)) from e

    def submit(self, inp: GenerateInput) -> RequestStream:
        if self.stopping:
            raise RequestError("server is shutting down", 503, "unavailable")
        if inp.rid in self.requests or inp.rid in self.held:
            raise RequestError(f"request id {inp.rid!r} is already running", 409, "conflict")
        self.check_fits(inp)
        stream = RequestStream(inp.rid)
        seq = Sequence(inp.rid, list(inp.prompt_ids), inp.params, generator=make_generator(inp.params.seed, self.runner.device))
        req = Req(inp, stream, seq)
        self.requests[inp.rid] = req
        self.prealloc.append(req)
        self.metrics.prompt_tokens.inc(len(inp.prompt_ids))
        self._wakeup.set()
        return stream

    def abort(self, rid: str, reason: RequestError | None = None) -> None:
        """Abort a live request (client gone, deadline, shutdown); cleaned up at the next safe point."""
        req = self.requests.get(rid)
        if req is not None and req.aborted is None:
            req.aborted = reason or RequestError("request aborted", 499, "aborted")
            if req.transfer is not None:
                req.transfer.cancel()
            self._wakeup.set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self, grace_s: float = 10.0) -> None:
        """Stop admitting, let running requests finish for up to ``grace_s``, abort the rest."""
        self.stopping = True
        deadline = time.monotonic() + grace_s
        while self.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for rid in list(self.requests):
            self.abort(rid, RequestError("server is shutting down", 503, "unavailable"))
        for req in list(self.held.values()):
            self.release_held(req)
        while self.requests and self._task is not None and not self._task.done():
            await asyncio.sleep(0.01)
        if self._task is not None:
            self._task.cancel()
        self._forward_thread.shutdown(wait=True)

    def queue_stats(self) -> dict:
        return {
            "queues": {"prealloc": len(self.prealloc), "transfer": len(self.loading), "extend": len(self.extend),
                       "retracted": len(self.retracted)},
            "running": len(self.running),
        }

    def idle(self) -> bool:
        return not self.requests

    # ---- the loop ---------------------------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            try:
                worked = await self._step()
            except Exception:  # a bug must not take the server down silently: fail live requests, go on
                log.exception("scheduler step failed")
                self._fail_all(RequestError("internal error in the scheduler", 500, "internal_error"))
                worked = False
            self.steps += 1
            if not worked:  # nothing ran: yield to HTTP, SSE and UCX until something changes
                self._wakeup.clear()
                # Keep polling while copies are in flight: their locks drop only when poll() sees them done.
                busy = self.loading or self.running or self.cache.busy
                timeout = 0.005 if busy else (1.0 if self.held else None)
                try:
                    await asyncio.wait_for(self._wakeup.wait(), timeout)
                except asyncio.TimeoutError:
                    pass

    async def _step(self) -> bool:
        self._reap_aborted()
        self.cache.poll()
        if self.lookahead is not None:
            self.lookahead.start(self.prealloc)
        self._admit()
        self._check_loading()
        worked = False
        if self.extend:
            await self._extend_step()
            worked = True
        if self.running:
            worked = await self._decode_step() or worked
        return worked

    # ---- admission --------------------------------------------------------------------------------------------

    def _admit(self) -> None:
        """FIFO admission; retracted requests go first and new ones wait while any is retracted."""
        while True:
            queue = self.retracted if self.retracted else self.prealloc
            if not queue or len(self.running) + len(self.extend) + len(self.loading) >= self.max_running:
                return
            req = queue[0]
            if self.lookahead is not None and not self.lookahead.settled(req):
                return  # the head waits for its prefetch as its policy says; FIFO, so the rest wait behind it
            if not self._try_alloc(req):
                return
            queue.popleft()
            self.loading.append(req)

    def _match_key(self, req: Req) -> list[int]:
        """Tokens whose cached KV the request can use. Locally computed requests need at least their last token
        extended to get its logits; a fresh PD request gets KV for its whole prompt."""
        seq = req.seq
        return seq.prompt_ids if self.kv_source is not None and not seq.output_ids else seq.token_ids[:-1]

    def _try_alloc(self, req: Req) -> bool:
        """Match, check the budget, lock and allocate; False (taking nothing) when it does not fit now."""
        seq, ps = req.seq, self.page_size
        pd_fresh = self.kv_source is not None and not seq.output_ids
        match = self.cache.match(self._match_key(req) if self.radix else [])
        kv_tokens = len(seq.prompt_ids) if pd_fresh else seq.num_tokens
        prefix_pages = (match.device_hit_tokens + match.host_hit_tokens) // ps
        delta = -(-kv_tokens // ps) - prefix_pages
        restore = match.host_hit_tokens // ps
        headroom = len(self.running)  # one page of growth per running request
        if restore + delta + headroom > self.cache.available_device_pages():
            return False
        try:
            req.handle = self.cache.load_back_and_lock(match, extra_pages=delta)
        except OutOfPages:
            return False
        req.prefix_pages = req.handle.device_indices.numel()
        if not seq.output_ids:  # report only the first admission, not a resumption
            h, span = req.handle, req.storage_span
            restored_from = req.prefix_pages - h.restored_tokens // ps  # restored pages end the prefix
            storage = max(0, min(span.stop, req.prefix_pages) - max(span.start, restored_from)) * ps
            req.cached = {"device": h.device_hit_tokens, "host": h.restored_tokens - storage, "storage": storage}
            for tier, n in req.cached.items():
                self.metrics.cached_tokens.labels(tier).inc(n)
        req.loading_since = time.monotonic()
        if pd_fresh:
            req.transfer = asyncio.get_running_loop().create_task(self.kv_source(req, req.handle.delta_pages))
            req.transfer.add_done_callback(lambda _: self._wakeup.set())
        return True

    def _check_loading(self) -> None:
        now = time.monotonic()
        for req in list(self.loading):
            if req.transfer is not None and not req.transfer.done():
                continue
            if not req.handle.ready():
                if now - req.loading_since > self.load_back_timeout_s:
                    self.loading.remove(req)
                    self._fail(req, RequestError("L2->L1 load-back missed its deadline", 504, "timeout"))
                continue
            self.loading.remove(req)
            if not all(op.ok for op in req.handle.waits):
                self._retry_after_failed_load(req)
                continue
            first = self._transfer_result(req)
            if req.aborted is not None:
                continue  # _transfer_result failed it
            seq = req.seq
            seq.pages = req.handle.take_pages().tolist()
            if first is not None:  # PD: prompt KV arrived, prefill sampled the first token
                seq.num_computed = len(seq.prompt_ids)
                self._cache_computed(req)
                self._emit(req, *first)
                if seq.finished:
                    self._finish(req)
                else:
                    self.running.append(req)
            else:
                seq.num_computed = req.prefix_pages * self.page_size
                self.extend.append(req)

    def _transfer_result(self, req: Req) -> tuple[int, float] | None:
        if req.transfer is None:
            return None
        task, req.transfer = req.transfer, None
        if task.cancelled():
            self._fail(req, req.aborted or RequestError("KV transfer cancelled", 499, "aborted"))
            return None
        if task.exception() is not None:
            err = task.exception()
            self._fail(req, err if isinstance(err, RequestError) else RequestError(f"KV transfer failed: {err}", 502, "transfer_error"))
            return None
        return task.result()

    def _retry_after_failed_load(self, req: Req) -> None:
        """A failed load-back leaves nothing in the tree; match again (a shorter hit) once, then give up.
        A PD request's prefill already handed its room off, so it fails at once instead."""
        if self.kv_source is not None and not req.seq.output_ids:
            self._fail(req, RequestError("restoring the cached prefix from L2 failed", 503, "unavailable"))
            return
        self.cache.release(req.handle)
        req.handle = None
        req.retries += 1
        if req.retries > 2:
            self._fail(req, RequestError("restoring the cached prefix from L2 failed repeatedly", 503, "unavailable"))
        else:
            self.prealloc.appendleft(req)

    # ---- compute ----------------------------------------------------------------------------------------------

    async def _forward(self, reqs: list[Req], new_tokens: list[list[int]], prefix_lens: list[int]) -> torch.Tensor:
        fb = self.runner.build_batch(new_tokens, prefix_lens, [r.seq.pages for r in reqs])
        return await asyncio.get_running_loop().run_in_executor(self._forward_thread, self.runner.forward, fb)

    async def _extend_step(self) -> None:
        batch, budget = [], self.max_prefill_tokens
        while self.extend and (not batch or self.extend[0].seq.num_tokens - self.extend[0].seq.num_computed <= budget):
            req = self.extend.popleft()
            budget -= req.seq.num_tokens - req.seq.num_computed
            batch.append(req)
        seqs = [r.seq for r in batch]
        logits = await self._forward(batch, [s.token_ids[s.num_computed:] for s in seqs], [s.num_computed for s in seqs])
        for req in batch:
            req.seq.num_computed = req.seq.num_tokens
            if req.aborted is None:
                self._cache_computed(req)
        self._sample(batch, logits, into_running=True)

    def _cache_computed(self, req: Req) -> None:
        """Put the request's new fully computed pages into the tree now rather than at finish, so concurrent
        requests with the same prefix hit them (and this one drops its copy of a prefix another just cached)."""
        seq = req.seq
        if not self.radix or seq.num_computed // self.page_size <= req.prefix_pages:
            return
        pages = torch.tensor(seq.pages, dtype=torch.int64)
        req.handle, pages = self.cache.cache_in_flight(req.handle, seq.token_ids[: seq.num_computed], pages)
        req.prefix_pages, seq.pages = req.handle.device_indices.numel(), pages.tolist()

    async def _decode_step(self) -> bool:
        """One decode forward over the running requests that have their next page; False when none has."""
        ready = set()
        for req in sorted(self.running, key=lambda r: -len(r.seq.output_ids)):  # most progress first
            if req in self.running and self._grow(req):
                ready.add(req)
        batch = [r for r in self.running if r in ready]
        if not batch:
            return False
        last = [r.seq.output_ids[-1] if r.seq.output_ids else r.seq.prompt_ids[-1] for r in batch]
        logits = await self._forward(batch, [[t] for t in last], [r.seq.num_tokens - 1 for r in batch])
        for r in batch:
            r.seq.num_computed = r.seq.num_tokens
        self._sample(batch, logits, into_running=False)
        return True

    def _grow(self, req: Req) -> bool:
        """Give ``req`` the page its next token needs; retract the least advanced request when L1 is full.
        False when ``req`` sits this step out: retracted, or waiting for pages that copies in flight free."""
        seq = req.seq
        while len(seq.pages) < seq.pages_needed(self.page_size):
            try:
                seq.pages += self.cache.alloc_device(1).tolist()
            except OutOfPages:
                # Pages draining to L2, or pinned only by a backup (the last retraction's): free in a moment.
                # Waiting for them beats retracting one more request.
                if self.cache.pages_soon_free():
                    return False
                victim = min(self.running, key=lambda r: (len(r.seq.output_ids), -r.stream.created_at))
                self._retract(victim)
                if victim is req:
                    return False
        return True

    def _retract(self, req: Req) -> None:
        """Free a running request's L1 pages (backing its KV up to L2 where possible) and queue it to resume."""
        self.running.remove(req)
        self._release(req, backup=True)
        self.retracted.append(req)
        self.metrics.retractions.inc()
        log.info("retracted %s after %d tokens: L1 is full", req.rid, len(req.seq.output_ids))

    def _sample(self, batch: list[Req], logits: torch.Tensor, into_running: bool) -> None:
        result = sample(logits, [r.seq.params for r in batch], [r.seq.generator for r in batch])
        for req, token, logprob in zip(batch, result.token_ids, result.logprobs):
            if req.aborted is not None:
                if into_running:
                    self.running.append(req)  # reaped at the next step from where it sits
                continue
            self._emit(req, token, logprob)
            if req.seq.finished:
                if not into_running:
                    self.running.remove(req)
                self._finish(req)
            elif into_running:
                if self.on_prefilled is not None and self.on_prefilled(req):
                    self._hold(req)
                    continue
                self.running.append(req)

    def _emit(self, req: Req, token: int, logprob: float) -> None:
        seq = req.seq
        seq.output_ids.append(token)
        seq.output_logprobs.append(logprob)
        check_finish(seq, self.eos_token_ids, self.runner.config.max_context, self.decode_text)
        if not req.first_token_sent:
            req.first_token_sent = True
            self.metrics.ttft.observe(time.monotonic() - req.stream.created_at)
        req.stream.queue.put_nowait(TokenEvent([token], [logprob], finish_reason=seq.finish_reason, cached_tokens=req.cached))

    # ---- exits ------------------------------------------------------------------------------------------------

    def _hold(self, req: Req) -> None:
        """Prefill role: answer the client now, keep the KV (pages stay locked) until ``release_held``."""
        self.held[req.rid] = req
        req.stream.queue.put_nowait(TokenEvent([], [], finish_reason={"type": "length", "length": 1}))
        self._close(req, "ok")

    def release_held(self, req: Req) -> None:
        """The decode peer has the KV (or never came): cache the prompt's pages and free the rest."""
        if self.held.pop(req.rid, None) is not None:
            self._release(req)
            self._wakeup.set()  # the freed pages may admit queued requests

    def _finish(self, req: Req) -> None:
        self._release(req)
        self._close(req, "ok")

    def _fail_all(self, error: RequestError) -> None:
        """Fail every live request; one whose cleanup fails is still answered, so no client waits forever."""
        for req in list(self.requests.values()):
            try:
                self._fail(req, error)
            except Exception:  # noqa: BLE001 - the state is already broken: answer the client at least
                log.exception("failing %s", req.rid)
                req.stream.queue.put_nowait(TokenEvent([], [], None, error=error))
                self._close(req, "error")

    def _fail(self, req: Req, error: RequestError) -> None:
        """End ``req`` with ``error`` and free what it holds. A KV transfer still in flight may be writing into
        its pages: then the transfer is cancelled and the request is failed once that task has ended."""
        if req.transfer is not None and not req.transfer.done():
            req.aborted = req.aborted or error
            req.transfer.cancel()
            return  # _reap_aborted finishes it
        if self.lookahead is not None:
            self.lookahead.settle(req, insert=False)
        for queue in (self.prealloc, self.retracted, self.extend):
            if req in queue:
                queue.remove(req)
        for lst in (self.loading, self.running):
            if req in lst:
                lst.remove(req)
        self.held.pop(req.rid, None)
        if req.transfer is not None:
            req.transfer.cancel()
            req.transfer = None
        self._release(req, insert=False)
        req.aborted = req.aborted or error
        req.stream.queue.put_nowait(TokenEvent([], [], None, error=error))
        self._close(req, "aborted" if error.status == 499 else "error")

    def _close(self, req: Req, outcome: str) -> None:
        self.requests.pop(req.rid, None)
        self.metrics.requests.labels(outcome).inc()
        req.stream.queue.put_nowait(None)

    def _release(self, req: Req, insert: bool = True, backup: bool = False) -> None:
        """Give back everything ``req`` holds. Fully computed pages go into the tree when the cache is on."""
        if req.handle is None:
            return
        seq, ps = req.seq, self.page_size
        if seq.pages:
            pages = torch.tensor(seq.pages, dtype=torch.int64)
            owned_from = req.prefix_pages
            if insert and self.radix:
                full = min(seq.num_computed, seq.num_tokens) // ps
                if full > 0:
                    self.cache.insert(seq.token_ids[: full * ps], pages[:full], backup=backup)
                owned_from = max(full, req.prefix_pages)
            self.cache.free_device(pages[owned_from:])
        self.cache.release(req.handle)
        req.handle, req.prefix_pages, seq.pages, seq.num_computed = None, 0, [], 0

    def _reap_aborted(self) -> None:
        for req in [r for r in self.requests.values() if r.aborted is not None]:
            if req.transfer is not None and not req.transfer.done():
                continue  # its cancellation is in flight; reaped once the task has unwound
            self._fail(req, req.aborted)
