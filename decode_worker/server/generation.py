"""Running requests whole or streamed; what the client leaves is aborted."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from decode_worker.core.request import GenerateInput, PromptLogprobs, RequestError, RequestStream, TokenEvent
from decode_worker.core.sequence import trim_stop_string
from decode_worker.engine.engine import Engine
from decode_worker.server.errors import error_body
from decode_worker.server.guard import fan_out

T = TypeVar("T")
log = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.5  # how often a non-streaming request asks whether its client is still there
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy may hold tokens back


@dataclass
class IncrementalText:
    """Incremental detokenization (vLLM's offsets), holding back an incomplete character."""

    decode: Callable[[list[int]], str]
    ids: list[int] = field(default_factory=list)
    text: str = ""  # complete text so far
    prefix_offset: int = 0  # window start: tokens before it are final
    read_offset: int = 0  # tokens up to here are in ``text``

    def add(self, new_ids: list[int]) -> str:
        """The text ``new_ids`` complete, possibly empty."""
        self.ids += new_ids
        head = self.decode(self.ids[self.prefix_offset : self.read_offset])
        window = self.decode(self.ids[self.prefix_offset :])
        if len(window) <= len(head) or window.endswith("\ufffd"):
            return ""
        delta = window[len(head) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta


class Collected:
    """A request's output so far."""

    def __init__(self, inp: GenerateInput, decode: Callable[[list[int]], str]):
        self.rid = inp.rid
        self.prompt_tokens = len(inp.prompt_ids)
        self.stream_text = IncrementalText(decode)
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []  # per token, when the request asked for them
        self.prompt_logprobs: PromptLogprobs | None = None  # when the request scores its prompt
        self.finish_reason: dict | None = None
        self.cached: dict[str, int] = {}
        self.started = time.monotonic()
        self.e2e_latency = 0.0  # seconds from submission to the last event

    def add(self, event: TokenEvent) -> None:
        if event.error is not None:
            raise event.error
        self.stream_text.add(event.token_ids)
        self.logprobs += event.logprobs
        self.top_logprobs += event.top_logprobs
        self.prompt_logprobs = event.prompt_logprobs or self.prompt_logprobs
        self.finish_reason = event.finish_reason or self.finish_reason
        self.cached = event.cached_tokens or self.cached
        self.e2e_latency = time.monotonic() - self.started

    def abort(self, error: Exception) -> TokenEvent:
        """End with ``error`` as SGLang's abort finish reason."""
        status = error.status if isinstance(error, RequestError) else 500
        message = str(error) if isinstance(error, RequestError) else f"internal error: {type(error).__name__}"
        self.finish_reason = {"type": "abort", "message": message, "status_code": status}
        self.e2e_latency = time.monotonic() - self.started
        return TokenEvent([], [], finish_reason=self.finish_reason)

    @property
    def ids(self) -> list[int]:
        return self.stream_text.ids

    @property
    def cached_tokens(self) -> int:
        return sum(self.cached.values())

    def text(self) -> str:
        """Streamed text; once finished, the full decode cut at a stop string."""
        if self.finish_reason is None:
            return self.stream_text.text
        return trim_stop_string(self.stream_text.decode(self.ids), self.finish_reason)


async def admit(engine: Engine, request: Request, inputs: list[GenerateInput]) -> None:
    """Count every sequence against the cap, check every prompt and compile its grammar before any runs."""
    fan_out(request, len(inputs))
    for inp in inputs:
        engine.check_request(inp)
    for inp in inputs:
        await engine.compile_grammar(inp)


def token_text(engine: Engine) -> Callable[[int], str]:
    return lambda token: engine.tokenizer.decode([token], skip_special_tokens=False)


def _collected(engine: Engine, inp: GenerateInput) -> Collected:
    skip = inp.params.skip_special_tokens
    return Collected(inp, lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=skip))


async def _start(engine: Engine, inp: GenerateInput) -> tuple[RequestStream, Collected]:
    return await engine.submit(inp), _collected(engine, inp)


async def _drain(stream: RequestStream, c: Collected) -> Collected:
    async for event in stream:
        c.add(event)
    return c


async def collect(engine: Engine, request: Request, inputs: list[GenerateInput]) -> list[Collected]:
    """Run to the end; a client leaving aborts all."""
    started: list[tuple[RequestStream, Collected]] = []
    tasks: list[asyncio.Future] = []
    try:
        for inp in inputs:
            started.append(await _start(engine, inp))
        tasks = [asyncio.ensure_future(_drain(s, c)) for s, c in started]
        while not all(t.done() for t in tasks):
            await asyncio.wait(tasks, timeout=DISCONNECT_POLL_S, return_when=asyncio.ALL_COMPLETED)
            if not all(t.done() for t in tasks) and await request.is_disconnected():
                raise RequestError("client disconnected", 499, "aborted")
        failed = [e for e in (t.exception() for t in tasks) if e is not None]  # each looked at: none logged as lost
        if failed:
            raise failed[0]
        return [t.result() for t in tasks]
    finally:
        for i, (s, _) in enumerate(started):
            if i >= len(tasks) or not tasks[i].done():
                if i < len(tasks):
                    tasks[i].cancel()
                engine.abort(s.rid)


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result; a client leaving cancels it (499)."""
    me = asyncio.current_task()  # the work runs in this task, saving an event-loop hop; the watcher cancels it
    gone = False

    async def watch() -> None:
        nonlocal gone
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)
        gone = True
        me.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        result = await work
    except asyncio.CancelledError:
        if not gone:
            raise
        me.uncancel()
        raise RequestError("client disconnected", 499, "aborted") from None
    finally:
        watcher.cancel()
    if gone:  # it left just as the work ended: take the pending cancel here, not on the answer's way out
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            me.uncancel()
    return result


async def stream_events(engine: Engine, inp: GenerateInput) -> AsyncIterator[tuple[Collected, TokenEvent]]:
    """Events with the output so far; a failure ends in an abort event."""
    c = _collected(engine, inp)
    stream: RequestStream | None = None
    finished = False
    try:
        stream = await engine.submit(inp)
        async for event in stream:
            c.add(event)
            yield c, event
        finished = True
    except Exception as e:
        yield c, c.abort(e)
        raise
    finally:
        if not finished and stream is not None:
            engine.abort(stream.rid)


async def interleave(engine: Engine, inputs: list[GenerateInput]) -> AsyncIterator[tuple[int, Collected, TokenEvent]]:
    """All prompts' events with their index; an error aborts the rest."""
    queue: asyncio.Queue[tuple[int, Collected | None, TokenEvent | None, Exception | None]] = asyncio.Queue()

    async def pump(i: int, inp: GenerateInput) -> None:
        events = stream_events(engine, inp)
        try:
            async for c, event in events:
                queue.put_nowait((i, c, event, None))
        except Exception as e:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait((i, None, None, e))
        finally:
            await events.aclose()  # aborts the request if it did not finish
            queue.put_nowait((i, None, None, None))

    tasks = [asyncio.ensure_future(pump(i, inp)) for i, inp in enumerate(inputs)]
    outputs: dict[int, Collected] = {}
    try:
        running = len(tasks)
        while running:
            i, c, event, error = await queue.get()
            if error is not None:
                await _cancel(tasks)
                for j, inp in enumerate(inputs):  # the failed prompt's own abort event came before its error
                    if (c := outputs.get(j)) is None or c.finish_reason is None:
                        c = c or _collected(engine, inp)
                        yield j, c, c.abort(error)
                raise error
            if c is None:
                running -= 1
            else:
                outputs[i] = c
                yield i, c, event
    finally:
        await _cancel(tasks)


async def _cancel(tasks: list[asyncio.Future]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _event(data: dict | str) -> str:
    return f"data: {json.dumps(data) if not isinstance(data, str) else data}\n\n"


async def _framed(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    try:
        async for chunk in chunks:
            yield _event(chunk)
    except RequestError as e:  # the scheduler logged the request's failure
        yield _event(error_body(str(e), e.status, e.kind))
    except Exception as e:  # a bug while building a chunk: the client still hears of it, and the stream ends
        log.exception("stream failed")
        yield _event(error_body(f"internal error: {type(e).__name__}: {e}", 500, "internal_error"))
    yield _event("[DONE]")


def sse_response(chunks: AsyncIterator[dict]) -> StreamingResponse:
    """``data:`` per chunk, an error as last event, then ``[DONE]``."""
    return StreamingResponse(_framed(chunks), media_type="text/event-stream", headers=SSE_HEADERS)
