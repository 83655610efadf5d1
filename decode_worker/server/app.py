"""FastAPI app: SGLang `/generate`, OpenAI completions and chat (SSE streaming), health, info, metrics."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel

from decode_worker.server.detokenize import IncrementalText
from decode_worker.server.errors import error_body, error_response, install_error_handlers, parse_body
from decode_worker.server.examples import CHAT_EXAMPLES, COMPLETION_EXAMPLES, GENERATE_EXAMPLES, HANDSHAKE_EXAMPLES
from decode_worker.server.guard import RequestGuard
from decode_worker.server.openapi import declare_models, json_body
from decode_worker.server.responses import (
    STREAM_CHUNKS,
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
    FlushResult,
    GenerateChunk,
    GenerateOutput,
    HandshakeAccepted,
    Load,
    ModelInfo,
    ModelList,
    errors,
    sse_content,
)
from decode_worker.server.schemas import (
    BootstrapFields,
    ChatCompletionRequest,
    CompletionRequest,
    ContentPart,
    GenerateRequest,
    HandshakeRequest,
    OpenAISampling,
    SGLangSamplingParams,
)
from decode_worker.core.request import Bootstrap, GenerateInput, RequestError, RequestStream, TokenEvent
from decode_worker.core.sampling import SamplingParams
from decode_worker.core.sequence import trim_stop_string
from decode_worker.pd.handshake import HANDSHAKE_PATH, PD_TOKEN_HEADER

if TYPE_CHECKING:
    from decode_worker.engine.engine import Engine

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
BOOTSTRAP = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


def _pick(value: Any, i: int) -> Any:
    return value[i] if isinstance(value, list) else value


def _bootstrap(body: BootstrapFields, i: int, default_port: int | None) -> Bootstrap | None:
    host, port, room = _pick(body.bootstrap_host, i), _pick(body.bootstrap_port, i), _pick(body.bootstrap_room, i)
    if host is None and room is None:
        return None
    if host is None or room is None:
        raise RequestError("bootstrap_host and bootstrap_room must be given together")
    port = port if port is not None else default_port
    if port is None:
        raise RequestError("bootstrap_port is null and this worker has no --bootstrap-port default")
    return Bootstrap(_url_host(host), int(port), int(room))


def _url_host(host: str) -> str:
    """A raw IPv6 address goes in brackets in the handshake URL."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _per_prompt(body: BaseModel, fields: tuple[str, ...], n: int) -> None:
    """A list-valued field gives one value per prompt: one of another length is refused (400 naming it) rather
    than pairing a prompt with another prompt's room, or failing on a missing entry."""
    for name in fields:
        value = getattr(body, name)
        if isinstance(value, list) and len(value) != n:
            raise RequestError(f"{name} has {len(value)} entries for {n} prompt{'s' if n != 1 else ''}")


def _message_text(content: str | list[ContentPart] | None) -> str | None:
    """OpenAI content parts joined into one text; a part a text model cannot read is refused, not dropped."""
    if not isinstance(content, list):
        return content
    other = sorted({p.type for p in content} - {"text"})
    if other:
        raise RequestError(f"messages: content parts of type {', '.join(map(repr, other))} are not supported "
                           "(text parts only)")
    return "".join(p.text or "" for p in content)


def _stop_list(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def _sglang_params(p: SGLangSamplingParams) -> SamplingParams:
    stop = _stop_list(p.stop)
    return SamplingParams(max_new_tokens=p.max_new_tokens, temperature=p.temperature, top_p=p.top_p,
                          top_k=p.top_k, seed=p.seed, stop=stop, stop_token_ids=list(p.stop_token_ids or []),
                          ignore_eos=p.ignore_eos)


def _new_text(text: str, sent: str, finished: bool) -> str:
    """What to send now: the text past ``sent``, holding back a trailing replacement character (a multi-byte
    character whose remaining bytes are in tokens not generated yet) until the stream ends."""
    if not finished:
        text = text.rstrip("\ufffd")
    return text[len(sent):] if text.startswith(sent) else ""


def _openai_params(body: OpenAISampling, max_tokens: int) -> SamplingParams:
    if body.n != 1:
        raise RequestError("only n=1 is supported")
    if getattr(body, "echo", False) or getattr(body, "logprobs", None):
        raise RequestError("echo and logprobs are not supported on the OpenAI routes; use /generate with return_logprob")
    stop = _stop_list(body.stop)
    return SamplingParams(max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                          top_k=body.top_k, seed=body.seed, stop=stop, stop_token_ids=list(body.stop_token_ids or []),
                          ignore_eos=body.ignore_eos)


class _Collected:
    """A request's output so far: tokens, streamed text, finish reason and cache figures."""

    def __init__(self, rid: str, prompt_tokens: int, decode):
        self.rid = rid
        self.prompt_tokens = prompt_tokens
        self.stream_text = IncrementalText(decode)
        self.logprobs: list[float] = []
        self.finish_reason: dict | None = None
        self.cached: dict[str, int] = {}

    def add(self, event: TokenEvent) -> None:
        if event.error is not None:
            raise event.error
        self.stream_text.add(event.token_ids)
        self.logprobs += event.logprobs
        self.finish_reason = event.finish_reason or self.finish_reason
        self.cached = event.cached_tokens or self.cached

    @property
    def ids(self) -> list[int]:
        """Output token ids; the detokenizer keeps the one list."""
        return self.stream_text.ids

    def meta(self, return_logprob: bool) -> dict:
        meta = {
            "id": self.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.ids),
            "cached_tokens": sum(self.cached.values()),
            "cached_tokens_details": {t: self.cached.get(t, 0) for t in ("device", "host", "storage")},
        }
        if return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(self.logprobs, self.ids)]
        return meta


def create_app(engine: "Engine") -> FastAPI:
    cfg = engine.config
    app = FastAPI(title="decode-worker", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.add_middleware(RequestGuard, api_key=cfg.api_key, max_body_bytes=cfg.max_request_body_bytes,
                       max_concurrent=cfg.max_concurrent_requests)
    auth = (401,) if cfg.api_key else ()
    transfer = (502, 504) if cfg.role == "decode" else ()  # the prefill peer failed or missed a deadline
    generation_errors = errors(400, *auth, 409, 413, 503, *transfer)
    # A null bootstrap_port names prefill's handshake port: --bootstrap-port on a decode worker, while a prefill
    # worker (which gets the same body from the router) serves the handshake itself, on its own port.
    default_port = cfg.bootstrap_port if cfg.role == "decode" else cfg.port

    def text_of(c: _Collected) -> str:
        """Streamed text while running; the exact full decode, cut at a matched stop string, once finished."""
        if c.finish_reason is None:
            return c.stream_text.text
        return trim_stop_string(engine.tokenizer.decode(c.ids), c.finish_reason)

    async def start(inp: GenerateInput) -> tuple[RequestStream, _Collected]:
        return await engine.submit(inp), _Collected(inp.rid, len(inp.prompt_ids), engine.tokenizer.decode)

    async def collect(request: Request, inputs: list[GenerateInput]) -> list[_Collected]:
        """Run requests to the end; a client that goes away aborts them all."""
        started: list[tuple[RequestStream, _Collected]] = []
        tasks: list[asyncio.Future] = []

        async def drain(stream: RequestStream, c: _Collected) -> _Collected:
            async for event in stream:
                c.add(event)
            return c

        try:
            for inp in inputs:
                started.append(await start(inp))
            tasks = [asyncio.ensure_future(drain(s, c)) for s, c in started]
            while not all(t.done() for t in tasks):
                done, _ = await asyncio.wait(tasks, timeout=0.5, return_when=asyncio.ALL_COMPLETED)
                if not all(t.done() for t in tasks) and await request.is_disconnected():
                    raise RequestError("client disconnected", 499, "aborted")
            return [t.result() for t in tasks]
        finally:
            for i, (s, _) in enumerate(started):
                if i >= len(tasks) or not tasks[i].done():
                    if i < len(tasks):
                        tasks[i].cancel()
                    engine.abort(s.rid)

    async def stream_events(inp: GenerateInput) -> AsyncIterator[tuple[_Collected, TokenEvent]]:
        stream, c = await start(inp)
        finished = False
        try:
            async for event in stream:
                c.add(event)
                yield c, event
            finished = True
        finally:
            if not finished:
                engine.abort(stream.rid)

    def sse(obj: Any) -> str:
        return f"data: {json.dumps(obj) if not isinstance(obj, str) else obj}\n\n"

    async def sse_wrap(gen: AsyncIterator[str]) -> AsyncIterator[str]:
        """Turn an error raised mid-stream into a final error event instead of a cut connection."""
        try:
            async for chunk in gen:
                yield chunk
        except RequestError as e:
            yield sse(error_body(str(e), e.status, e.kind))
        yield sse("[DONE]")

    def encode(text: str | None, ids: list[int] | None) -> list[int]:
        if ids is not None:
            return list(ids)
        if text is None:
            raise RequestError("give either text or input_ids")
        return engine.tokenizer.encode(text)

    # ---- SGLang native ----
    @app.post("/generate", openapi_extra=json_body(GenerateRequest, GENERATE_EXAMPLES),
              responses={200: {"model": GenerateOutput, "content": sse_content(GenerateChunk)}, **generation_errors})
    async def generate(request: Request):
        body = await parse_body(request, GenerateRequest)
        engine.require_ready()
        batched = isinstance(body.text, list) or (body.input_ids and isinstance(body.input_ids[0], list))
        texts = body.text if isinstance(body.text, list) else [body.text]
        ids = body.input_ids if batched and body.input_ids else [body.input_ids]
        n = len(texts) if body.text is not None else len(ids)
        _per_prompt(body, BOOTSTRAP + ("sampling_params", "rid", "return_logprob"), n)
        inputs = []
        for i in range(n):
            sp = _pick(body.sampling_params, i) or SGLangSamplingParams()
            rid = _pick(body.rid, i) or uuid.uuid4().hex
            prompt = encode(texts[i] if body.text is not None else None, ids[i] if body.text is None else None)
            inputs.append(GenerateInput(rid, prompt, _sglang_params(sp), bool(_pick(body.return_logprob, i)),
                                        _bootstrap(body, i, default_port)))
        for inp in inputs:
            engine.check_request(inp)

        def response(c: _Collected, inp: GenerateInput) -> dict:
            return {"text": text_of(c), "output_ids": c.ids, "meta_info": c.meta(inp.return_logprob)}

        if not body.stream:
            results = await collect(request, inputs)
            out = [response(c, i) for c, i in zip(results, inputs)]
            return out if batched else out[0]

        async def events() -> AsyncIterator[str]:
            for index, inp in enumerate(inputs):  # batched streams run one prompt after another
                async for c, _ in stream_events(inp):
                    chunk = response(c, inp)
                    if batched:
                        chunk["index"] = index
                    yield sse(chunk)

        return StreamingResponse(sse_wrap(events()), media_type="text/event-stream", headers=SSE_HEADERS)

    # ---- OpenAI ----
    def usage(c: _Collected) -> dict:
        return {"prompt_tokens": c.prompt_tokens, "completion_tokens": len(c.ids),
                "total_tokens": c.prompt_tokens + len(c.ids),
                "prompt_tokens_details": {"cached_tokens": sum(c.cached.values())}}

    def finish(c: _Collected) -> str | None:
        return None if c.finish_reason is None else c.finish_reason["type"]

    @app.post("/v1/completions", openapi_extra=json_body(CompletionRequest, COMPLETION_EXAMPLES),
              responses={200: {"model": CompletionResponse, "content": sse_content(CompletionChunk)},
                         **generation_errors})
    async def completions(request: Request):
        body = await parse_body(request, CompletionRequest)
        engine.require_ready()
        prompts = body.prompt if isinstance(body.prompt, list) and body.prompt and not isinstance(body.prompt[0], int) else [body.prompt]
        _per_prompt(body, BOOTSTRAP, len(prompts))
        params = _openai_params(body, body.max_tokens)
        inputs = []
        for i, p in enumerate(prompts):
            prompt = encode(p, None) if isinstance(p, str) else list(p)
            rid = f"{body.rid or 'cmpl-' + uuid.uuid4().hex}" + (f"-{i}" if len(prompts) > 1 else "")
            inputs.append(GenerateInput(rid, prompt, params, False, _bootstrap(body, i, default_port)))
        for inp in inputs:
            engine.check_request(inp)
        created, model = int(time.time()), engine.model_name
        if not body.stream:
            results = await collect(request, inputs)
            return {"id": inputs[0].rid, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": i, "text": text_of(c), "finish_reason": finish(c), "logprobs": None}
                                for i, c in enumerate(results)],
                    "usage": {k: sum(usage(c)[k] for c in results) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}

        async def events() -> AsyncIterator[str]:
            for index, inp in enumerate(inputs):
                sent = ""
                async for c, event in stream_events(inp):
                    delta = _new_text(text_of(c), sent, event.finish_reason is not None)
                    sent += delta
                    yield sse({"id": inp.rid, "object": "text_completion", "created": created, "model": model,
                               "choices": [{"index": index, "text": delta, "finish_reason": finish(c) if event.finish_reason else None,
                                            "logprobs": None}]})

        return StreamingResponse(sse_wrap(events()), media_type="text/event-stream", headers=SSE_HEADERS)

    @app.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest, CHAT_EXAMPLES),
              responses={200: {"model": ChatCompletionResponse, "content": sse_content(ChatCompletionChunk)},
                         **generation_errors})
    async def chat(request: Request):
        body = await parse_body(request, ChatCompletionRequest)
        engine.require_ready()
        _per_prompt(body, BOOTSTRAP, 1)
        messages = [{"role": m.role, "content": _message_text(m.content)} for m in body.messages]
        try:
            prompt = engine.tokenizer.apply_chat_template(messages)
        except ValueError as e:
            raise RequestError(str(e)) from e
        max_tokens = body.max_completion_tokens or body.max_tokens or 256
        rid = body.rid or "chatcmpl-" + uuid.uuid4().hex
        inp = GenerateInput(rid, prompt, _openai_params(body, max_tokens), False, _bootstrap(body, 0, default_port))
        engine.check_request(inp)
        created, model = int(time.time()), engine.model_name
        if not body.stream:
            (c,) = await collect(request, [inp])
            return {"id": rid, "object": "chat.completion", "created": created, "model": model,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text_of(c)},
                                 "finish_reason": finish(c), "logprobs": None}],
                    "usage": usage(c)}

        def chunk(delta: dict, reason: str | None) -> str:
            return sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": [{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}]})

        async def events() -> AsyncIterator[str]:
            yield chunk({"role": "assistant", "content": ""}, None)
            sent = ""
            async for c, event in stream_events(inp):
                delta = _new_text(text_of(c), sent, event.finish_reason is not None)
                sent += delta
                if delta:
                    yield chunk({"content": delta}, None)
                if event.finish_reason:
                    yield chunk({}, finish(c))

        return StreamingResponse(sse_wrap(events()), media_type="text/event-stream", headers=SSE_HEADERS)

    @app.get("/v1/models", responses={200: {"model": ModelList}, **errors(*auth, 503)})
    async def models():
        engine.require_ready()
        return {"object": "list", "data": [{"id": engine.model_name, "object": "model", "created": engine.started_at,
                                            "owned_by": "decode-worker", "max_model_len": engine.model_config.max_context}]}

    # ---- operations ----
    @app.get("/health", response_class=Response, responses={200: {"description": "ready"}, **errors(503)})
    async def health():
        if not engine.ready:
            return error_response("not ready: " + engine.not_ready_reason, 503, "unavailable")
        return Response(status_code=200)

    @app.get("/health_generate", response_class=Response,
             responses={200: {"description": "one token went through the scheduler"}, **errors(503)})
    async def health_generate():
        if not engine.ready:
            return error_response("not ready: " + engine.not_ready_reason, 503, "unavailable")
        await engine.health_generate()
        return Response(status_code=200)

    info = {200: {"description": "configuration (secrets left out), model, KV layout and cache figures",
                  "content": {"application/json": {"schema": {"type": "object"}}}}, **errors(*auth)}

    @app.get("/server_info", responses=info)
    @app.get("/get_server_info", responses=info)
    async def server_info():
        return engine.server_info()

    @app.get("/model_info", responses={200: {"model": ModelInfo}, **errors(*auth, 503)})
    @app.get("/get_model_info", responses={200: {"model": ModelInfo}, **errors(*auth, 503)})
    async def model_info():
        engine.require_ready()
        return {"model_path": engine.model_path, "served_model_name": engine.model_name,
                "tokenizer_path": engine.model_path, "is_generation": True,
                "max_context": engine.model_config.max_context}

    @app.get("/get_load", responses={200: {"model": Load}, **errors(*auth)})
    async def get_load():
        return engine.get_load()

    @app.post("/flush_cache", responses={200: {"model": FlushResult}, **errors(*auth, 413, 503)})
    @app.get("/flush_cache", responses={200: {"model": FlushResult}, **errors(*auth, 503)})
    async def flush_cache():
        dropped = engine.flush_cache()
        return {"success": True, "message": f"cache flushed: {dropped} tokens dropped", "dropped_tokens": dropped}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4")

    if cfg.role == "prefill":
        from decode_worker.pd.prefill import check_pd_token  # loads UCX: prefill role only

        token_header = {"name": PD_TOKEN_HEADER, "in": "header", "required": False, "schema": {"type": "string"},
                        "description": "the pair's --pd-token; required when this worker has one, refused when not"}

        body_and_header = {**json_body(HandshakeRequest, HANDSHAKE_EXAMPLES), "parameters": [token_header]}

        @app.post(HANDSHAKE_PATH, openapi_extra=body_and_header,
                  responses={200: {"model": HandshakeAccepted}, **errors(400, 401, 404, 409, 413, 503)})
        async def handshake(request: Request):
            body = await parse_body(request, HandshakeRequest)  # first, so an old peer hears its body is refused
            check_pd_token(cfg.pd_token, request.headers.get(PD_TOKEN_HEADER))
            return JSONResponse(await engine.handshake(body))

    declare_models(app, [GenerateRequest, CompletionRequest, ChatCompletionRequest, HandshakeRequest, *STREAM_CHUNKS])
    return app
