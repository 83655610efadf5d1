"""API key, body cap and deadline, concurrency cap (docs/security.md)."""
from __future__ import annotations

import asyncio
import hmac
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from decode_worker.core.request import RequestError
from decode_worker.server.errors import error_response

# Probes and scrapes stay open: kubelets and Prometheus carry no key, and none of them reveals a prompt.
OPEN_PATHS = frozenset({"/health", "/health_generate", "/metrics"})
GENERATION_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions"})
CLOSE = {"Connection": "close"}  # a refused request's unread body must not be parsed as the next request


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def bearer_matches(authorization: str | None, api_key: str) -> bool:
    """``Authorization: Bearer <key>``, compared in constant time."""
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


@dataclass
class Body:
    """A read body, or its refusal."""

    data: bytes = b""
    refusal: Response | None = None
    gone: bool = False


@dataclass
class Slots:
    """``--max-concurrent-requests``, counted in sequences: a generation request takes one slot once its body is
    in and, once its inputs are known, one more per further sequence it fans out to (a batch of prompts, ``n``);
    it gives back all it took with its last byte out."""

    limit: int
    in_use: int = 0


HELD = "decode_worker_slots"  # in a request's scope state: the slots it holds


def fan_out(request: Request, sequences: int) -> None:
    """Take the slots of a request's further sequences: 400 if it could never fit, 503 while too many are taken."""
    slots: Slots = request.app.state.slots
    more = sequences - 1  # its first took a slot at the door
    if sequences > slots.limit:
        raise RequestError(f"the request fans out to {sequences} sequences (prompts x n), more than "
                           f"--max-concurrent-requests ({slots.limit})")
    if slots.in_use + more > slots.limit:
        raise RequestError(f"server busy: {slots.in_use} of {slots.limit} sequence slots taken and this request "
                           f"needs {sequences}; retry later", 503, "overloaded")
    slots.in_use += more
    request.scope["state"][HELD] += more


class RequestGuard:
    def __init__(self, app: ASGIApp, api_key: str, max_body_bytes: int, slots: Slots, body_timeout_s: float):
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.slots = slots
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is None:
            body = await self._read_body(receive)
            if body.gone:
                return  # the client left mid-body: nobody to answer
            refusal = body.refusal or self._busy(scope)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        replay = self._replay(body.data, receive)
        if scope["path"] not in GENERATION_PATHS:
            await self.app(scope, replay, send)
            return
        held = scope.setdefault("state", {})
        held[HELD] = 1
        self.slots.in_use += 1
        try:
            await self.app(scope, replay, send)
        finally:
            self.slots.in_use -= held[HELD]

    def _refusal(self, scope: Scope) -> Response | None:
        """A refusal on headers alone, or None."""
        path = scope["path"]
        if self.api_key and path not in OPEN_PATHS:
            authorization = _header(scope, b"authorization")
            if not bearer_matches(authorization, self.api_key):
                message = "invalid API key" if authorization else "missing API key: send 'Authorization: Bearer <key>'"
                return error_response(message, 401, "authentication_error", {"WWW-Authenticate": "Bearer", **CLOSE})
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return error_response(self._too_large(), 413, "request_too_large", CLOSE)
        return None

    def _busy(self, scope: Scope) -> Response | None:
        """503 past the generation cap."""
        if scope["path"] in GENERATION_PATHS and self.slots.in_use >= self.slots.limit:
            return error_response(f"server busy: {self.slots.in_use} generation sequences in flight "
                                  f"(--max-concurrent-requests {self.slots.limit}); retry later", 503, "overloaded")
        return None

    def _too_large(self) -> str:
        return f"request body larger than --max-request-body-bytes ({self.max_body_bytes})"

    async def _read_body(self, receive: Receive) -> Body:
        """The body within the deadline and size cap, or its refusal."""
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return Body(gone=True)
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > self.max_body_bytes:
                        return Body(refusal=error_response(self._too_large(), 413, "request_too_large", CLOSE))
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return Body(b"".join(chunks))
        except TimeoutError:
            message = (f"request body not received within --request-body-timeout-s ({self.body_timeout_s:g} s): "
                       f"{size} bytes arrived")
            return Body(refusal=error_response(message, 408, "timeout", CLOSE))

    @staticmethod
    def _replay(data: bytes, receive: Receive) -> Receive:
        """The body read, then the connection's messages."""
        pending = True

        async def replay() -> Message:
            nonlocal pending
            if pending:
                pending = False
                return {"type": "http.request", "body": data, "more_body": False}
            return await receive()

        return replay
