"""The continuous-batching scheduler for every role: ``schedule()``, forward, ``postprocess()``."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator

from decode_worker.cache.pool import OutOfPages
from decode_worker.cache.prefix_cache import PrefixCache
from decode_worker.core.lifecycle import ReqState
from decode_worker.core.request import (
    GenerateInput,
    Prefilled,
    PromptLogprobs,
    RequestError,
    RequestStream,
    TokenEvent,
)
from decode_worker.core.sequence import Sequence, check_finish, check_fits
from decode_worker.core.threads import started_pool
from decode_worker.metrics import Metrics
from decode_worker.model.runner import ModelRunner
from decode_worker.model.sampler import SampleResult, make_generator
from decode_worker.scheduler.admission import SHARE_MIN_TOKENS, Admission
from decode_worker.scheduler.batch import Batch, BatchKind, decode_batch, extend_batch
from decode_worker.scheduler.grammar import CompiledGrammar, RowGrammar, accept_tokens, fill_mask
from decode_worker.scheduler.loading import Loading
from decode_worker.scheduler.queues import Queues
from decode_worker.scheduler.req import Req
from decode_worker.scheduler.roles import COLOCATED, PromptDone, PromptSource
from decode_worker.scheduler.telemetry import log_failure, record_close, record_token

log = logging.getLogger(__name__)
S = ReqState


class Scheduler:
    def __init__(self, runner: ModelRunner, cache: PrefixCache, metrics: Metrics, *,
                 eos_token_ids: tuple[int, ...], decode_text: Callable[[list[int]], str], max_running: int,
                 max_prefill_tokens: int, load_back_timeout_s: float, source: PromptSource = COLOCATED,
                 done: PromptDone = COLOCATED, share_min_tokens: int = SHARE_MIN_TOKENS):
        self.runner = runner
        self.cache = cache
        self.metrics = metrics
        self.eos_token_ids = eos_token_ids
        self.decode_text = decode_text
        self.max_prefill_tokens = max_prefill_tokens
        self.done = done  # what happens when a prompt computed here has its first token
        self.page_size = runner.page_size
        self.queues = Queues()
        self.requests: dict[str, Req] = {}  # live: not yet answered
        self._wakeup = asyncio.Event()
        # ``source``: where a fresh prompt's KV comes from
        self.admission = Admission(cache, self.queues, source, metrics, self._wakeup, page_size=self.page_size,
                                   max_running=max_running, share_min_tokens=share_min_tokens)
        self.loading = Loading(cache, self.queues, metrics, page_size=self.page_size,
                               load_back_timeout_s=load_back_timeout_s)
        self._forward_thread = started_pool(1, "forward")
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

    def submit(self, inp: GenerateInput, grammar: CompiledGrammar | None = None) -> RequestStream:
        """Queue ``inp``, its grammar (if any) already compiled."""
        if self.stopping:
            raise RequestError("server is shutting down", 503, "unavailable")
        if inp.rid in self.requests or inp.rid in self.queues.held:
            raise RequestError(f"request id {inp.rid!r} is already running", 409, "conflict")
        self.check_fits(inp)
        if (inp.params.grammar is None) != (grammar is None):
            raise RequestError(f"{inp.params.grammar_name}: the grammar was not compiled for this request", 500,
                               "internal_error")
        stream = RequestStream(inp.rid)
        generator = make_generator(inp.params.seed, self.runner.device)
        seq = Sequence(inp.rid, list(inp.prompt_ids), inp.params, generator=generator)
        req = Req(inp, stream, seq, grammar=grammar and RowGrammar(grammar, inp.params.grammar_name))
        self.requests[inp.rid] = req
        self.queues.add(req)
        self.metrics.prompt_tokens.inc(len(inp.prompt_ids))
        self._wakeup.set()
        return stream

    def abort(self, rid: str, reason: RequestError | None = None) -> None:
        """End a live request at the next safe point."""
        req = self.requests.get(rid)
        if req is not None and req.aborted is None:
            req.aborted = reason or RequestError("request aborted", 499, "aborted")
            if req.transfer is not None and req.transfer.task is not None:
                req.transfer.task.cancel()
            self._wakeup.set()

    def release_held(self, req: Req) -> None:
        """Prefill role: end a held request's hold; cache its prompt's pages."""
        if req.state is S.HELD:
            self.queues.move(req, S.FINISHED)
            req.release(self.cache, self.page_size)
            self._wakeup.set()  # the freed pages may admit queued requests

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    @property
    def loop_running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def stop(self, grace_s: float = 10.0) -> None:
        """Stop admitting; abort what has not finished within ``grace_s``."""
        self.stopping = True
        deadline = time.monotonic() + grace_s
        while self.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for rid in list(self.requests):
            self.abort(rid, RequestError("server is shutting down", 503, "unavailable"))
        for req in list(self.queues.held.values()):
            self.release_held(req)
        while self.requests and self.loop_running:
            await asyncio.sleep(0.01)
        if self._task is not None:
            self._task.cancel()
        self._forward_thread.shutdown(wait=True)

    def queue_stats(self) -> dict:
        return self.queues.stats()

    def idle(self) -> bool:
        return not self.requests

    # ---- steps ------------------------------------------------------------------------------------------------

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
                await self._wait_for_work()

    async def _wait_for_work(self) -> None:
        self._wakeup.clear()
        # Keep polling while copies are in flight: their locks drop only when poll() sees them done.
        busy = self.queues.loading or self.queues.running or self.cache.busy
        timeout = 0.005 if busy else (1.0 if self.queues.held else None)
        try:
            await asyncio.wait_for(self._wakeup.wait(), timeout)
        except TimeoutError:
            pass

    async def _step(self) -> bool:
        """One step; True when it ran a batch."""
        worked = False
        for batch in self.schedule():
            await self._run_batch(batch)
            worked = True
        return worked

    async def _run_batch(self, batch: Batch) -> None:
        """Run and apply ``batch``. A forward that raises (a row no check caught, a kernel error) is re-run in halves
        until the requests whose rows make it raise stand alone: those fail with 500, the others go on. A re-run
        writes the same KV again; a seeded request in a failed batch may draw other samples."""
        loop = asyncio.get_running_loop()
        try:
            result = await loop.run_in_executor(self._forward_thread, self._forward, batch)
        except Exception:
            self.metrics.step_failures.labels(batch.kind.value).inc()
            if len(batch.reqs) == 1:
                req = batch.reqs[0]
                log.exception("the %s step of request %s failed", batch.kind.value, req.rid)
                self._fail(req, RequestError("internal error in this request's step", 500, "internal_error"))
                return
            half = len(batch.reqs) // 2
            for part in (batch.reqs[:half], batch.reqs[half:]):
                rebuild = extend_batch if batch.kind is BatchKind.EXTEND else decode_batch
                await self._run_batch(rebuild(self.runner, part, self.eos_token_ids))
            return
        self.postprocess(batch, result)

    def _forward(self, batch: Batch) -> SampleResult:
        reqs, started = batch.reqs, time.monotonic()
        params, generators = [r.seq.params for r in reqs], [r.seq.generator for r in reqs]
        mask = fill_mask([r.grammar for r in reqs], self.runner.config.vocab_size)
        if batch.scoring is not None:
            result = batch.scoring.forward_sample(self.runner, batch.forward, params, generators, batch.shaping, mask)
        else:
            result = self.runner.forward_sample(batch.forward, params, generators, batch.shaping, mask)
        if mask is not None:
            accept_tokens([r.grammar for r in reqs], result.token_ids)
        self.metrics.forward_seconds.labels(batch.kind.value).observe(time.monotonic() - started)
        return result

    def step_sync(self) -> bool:
        """One step without an event loop (offline ``LLM``); a failing step fails all, raising."""
        worked = False
        try:
            for batch in self.schedule():
                self.postprocess(batch, self._forward(batch))
                worked = True
        except Exception:
            self._fail_all(RequestError("internal error in the scheduler", 500, "internal_error"))
            raise
        self.steps += 1
        return worked

    def schedule(self) -> Iterator[Batch]:
        """The step's batches: extend, then decode, each picked after the one before was applied."""
        self._housekeep()
        if self.queues.extend:
            yield self._extend_batch()
        if self.queues.running and (batch := self._decode_batch()) is not None:
            yield batch

    def postprocess(self, batch: Batch, result: SampleResult) -> None:
        """Apply a batch's sampled tokens; a request aborted meanwhile ends at the next step."""
        extend = batch.kind is BatchKind.EXTEND
        for req in batch.reqs:
            req.seq.num_computed = req.seq.num_tokens
            if extend and req.aborted is None:
                req.cache_computed(self.cache, self.page_size)
        prompts = result.prompt or [None] * len(batch.reqs)
        for req, token, logprob, top, prompt in zip(batch.reqs, result.token_ids, result.logprobs,
                                                    result.top_logprobs, prompts):
            if req.aborted is not None:
                continue
            if extend and self.done.hold(req.held(Prefilled(token, logprob, top or [], prompt), self.release_held,
                                                  self.page_size)):
                self._emit(req, token, logprob, top)  # even when finished: its decode peer still needs the KV
                self._hold(req)
            elif extend and req.seq.params.max_new_tokens == 0:
                self._scored_only(req, prompt)
            else:
                self._emit(req, token, logprob, top, prompt)
                if req.seq.finished:
                    self._finish(req)
                elif extend:
                    self.queues.move(req, S.RUNNING)

    def _housekeep(self) -> None:
        self._reap_aborted()
        self.cache.poll()
        self.admission.look_ahead()
        self.admission.admit()
        for req, outcome in self.loading.poll():
            if isinstance(outcome, RequestError):
                self._fail(req, outcome)
            else:
                self._first_token(req, outcome)

    def _extend_batch(self) -> Batch:
        """The extend queue's head within ``max_prefill_tokens``."""
        reqs, budget = [], self.max_prefill_tokens
        for req in self.queues.extend:
            new = req.seq.num_tokens - req.seq.num_computed
            if reqs and new > budget:
                break
            budget -= new
            reqs.append(req)
        return extend_batch(self.runner, reqs, self.eos_token_ids)

    def _decode_batch(self) -> Batch | None:
        """The running requests that got their next page."""
        ready = {req for req in sorted(self.queues.running, key=lambda r: -len(r.seq.output_ids))
                 if req.state is S.RUNNING and self._grow(req)}  # most progress first; _grow may retract others
        reqs = [r for r in self.queues.running if r in ready]
        return decode_batch(self.runner, reqs, self.eos_token_ids) if reqs else None

    def _grow(self, req: Req) -> bool:
        """Give ``req`` its next page, retracting the least advanced request if need be; False: it sits out."""
        seq = req.seq
        while len(seq.pages) < seq.pages_needed(self.page_size):
            try:
                seq.pages += self.cache.alloc_device(1).tolist()
            except OutOfPages:
                # Pages draining to L2, or pinned only by a backup (the last retraction's): free in a moment.
                # Waiting for them beats retracting one more request.
                if self.cache.pages_soon_free():
                    return False
                victim = min(self.queues.running, key=lambda r: (len(r.seq.output_ids), -r.stream.created_at))
                self._retract(victim)
                if victim is req:
                    return False
        return True

    def _retract(self, req: Req) -> None:
        """Free a running request's L1 pages (backed up to L2); it resumes later."""
        self.queues.move(req, S.RETRACTED)
        self.runner.rows.release(req.rid)
        req.release(self.cache, self.page_size, backup=True)
        self.metrics.retractions.inc()
        log.info("retracted %s after %d tokens: L1 is full", req.rid, len(req.seq.output_ids))

    def _emit(self, req: Req, token: int, logprob: float, top: list[tuple[int, float]] | None = None,
              prompt: PromptLogprobs | None = None) -> None:
        seq = req.seq
        seq.output_ids.append(token)
        seq.output_logprobs.append(logprob)
        check_finish(seq, self.eos_token_ids, self.runner.config.max_context, self.decode_text)
        if req.grammar is not None:
            req.grammar.advance(seq)
        record_token(self.metrics, req)
        req.stream.queue.put_nowait(TokenEvent([token], [logprob], finish_reason=seq.finish_reason,
                                               cached_tokens=req.cached_tokens, top_logprobs=[top or []],
                                               prompt_logprobs=prompt))

    def _scored_only(self, req: Req, prompt: PromptLogprobs | None) -> None:
        """``max_new_tokens`` 0: answer with the prompt's logprobs only."""
        req.seq.finish_reason = {"type": "length", "length": 0}
        req.stream.queue.put_nowait(TokenEvent([], [], finish_reason=req.seq.finish_reason,
                                               cached_tokens=req.cached_tokens, prompt_logprobs=prompt))
        self._finish(req)

    def _first_token(self, req: Req, first: Prefilled) -> None:
        """Emit a received prompt's first token, then decode on or finish."""
        if req.seq.params.max_new_tokens == 0:
            self._scored_only(req, first.prompt)
            return
        self._emit(req, first.token, first.logprob, first.top, first.prompt)
        if req.seq.finished:
            self._finish(req)
        else:
            self.queues.move(req, S.RUNNING)

    # ---- exits ------------------------------------------------------------------------------------------------

    def _hold(self, req: Req) -> None:
        """Prefill role: answer the client; the pages stay locked until ``release_held``."""
        self.queues.move(req, S.HELD)
        req.stream.queue.put_nowait(TokenEvent([], [], finish_reason={"type": "length", "length": 1}))
        self._close(req, "ok")

    def _finish(self, req: Req) -> None:
        self.queues.move(req, S.FINISHED)
        req.release(self.cache, self.page_size)
        self._close(req, "ok")

    def _fail_all(self, error: RequestError) -> None:
        """Fail every live request; each is answered even if its cleanup fails."""
        for req in list(self.requests.values()):
            try:
                self._fail(req, error)
            except Exception:  # the state is already broken: answer the client at least
                log.exception("failing %s", req.rid)
                req.stream.queue.put_nowait(TokenEvent([], [], None, error=error))
                log_failure(req, error)
                self._close(req, "error")

    def _fail(self, req: Req, error: RequestError) -> None:
        """End ``req`` with ``error``, freeing what it holds, once no receive can still write its pages."""
        if req.transfer is not None and req.transfer.in_flight():
            req.aborted = req.aborted or error
            req.transfer.task.cancel()
            return  # _reap_aborted finishes it
        self.queues.move(req, S.ABORTED)
        self.admission.forget(req)
        req.transfer = None
        req.release(self.cache, self.page_size, insert=False)
        req.aborted = req.aborted or error
        req.stream.queue.put_nowait(TokenEvent([], [], None, error=error))
        log_failure(req, error)
        self._close(req, "aborted" if error.status == 499 else "error")

    def _close(self, req: Req, outcome: str) -> None:
        self.requests.pop(req.rid, None)
        self.runner.rows.release(req.rid)  # its page-table row, if it decoded
        record_close(self.metrics, req, outcome)
        req.stream.queue.put_nowait(None)

    def _reap_aborted(self) -> None:
        for req in [r for r in self.requests.values() if r.aborted is not None]:
            if req.transfer is not None and req.transfer.in_flight():
                continue  # its cancellation is in flight; reaped once the task has unwound
            self._fail(req, req.aborted)
