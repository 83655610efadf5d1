"""What every request passes before a route runs: the API key, the body size cap and the cap on generation
requests in flight.

A plain ASGI middleware rather than route code, so that a refused request costs no body read and no parsing,
and a streaming response keeps its concurrency slot until its last byte has gone.
"""
from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from decode_worker.core.request import RequestError
from decode_worker.server.errors import error_response

# Probes and scrapes stay open: kubelets and Prometheus carry no key, and none of them reveals a prompt.
OPEN_PATHS = frozenset({"/health", "/health_generate", "/metrics"})
GENERATION_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions"})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def bearer_matches(authorization: str | None, api_key: str) -> bool:
    """``Authorization: Bearer <key>``, compared in constant time so the answer's timing gives no prefix away."""
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


class RequestGuard:
    def __init__(self, app: ASGIApp, api_key: str, max_body_bytes: int, max_concurrent: int):
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.max_concurrent = max_concurrent
        self.in_flight = 0  # generation requests between their first byte in and last byte out

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            await refusal(scope, receive, send)
        elif scope["path"] in GENERATION_PATHS:
            self.in_flight += 1
            try:
                await self.app(scope, self._capped(receive), send)
            finally:
                self.in_flight -= 1
        else:
            await self.app(scope, self._capped(receive), send)

    def _refusal(self, scope: Scope):
        """The error response for a request refused before it runs, or None to let it through."""
        path = scope["path"]
        if self.api_key and path not in OPEN_PATHS:
            authorization = _header(scope, b"authorization")
            if not bearer_matches(authorization, self.api_key):
                message = "invalid API key" if authorization else "missing API key: send 'Authorization: Bearer <key>'"
                return error_response(message, 401, "authentication_error", {"WWW-Authenticate": "Bearer"})
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return error_response(self._too_large(), 413, "request_too_large")
        if path in GENERATION_PATHS and self.in_flight >= self.max_concurrent:
            return error_response(f"server busy: {self.in_flight} generation requests in flight "
                                  f"(--max-concurrent-requests {self.max_concurrent}); retry later", 503,
                                  "overloaded")
        return None

    def _too_large(self) -> str:
        return f"request body larger than --max-request-body-bytes ({self.max_body_bytes})"

    def _capped(self, receive: Receive) -> Receive:
        """A body sent without Content-Length (chunked) is counted as it arrives; the route's read then fails
        with 413 (a RequestError, so the usual JSON error) once it passes the cap."""
        seen = 0

        async def capped() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise RequestError(self._too_large(), 413, "request_too_large")
            return message

        return capped
