"""The worker's HTTP app: the guard in front, errors in one JSON shape, a router per API family."""
from __future__ import annotations

from fastapi import FastAPI

from decode_worker.engine.engine import Engine
from decode_worker.server import routes_openai, routes_ops, routes_sglang
from decode_worker.server.errors import install_error_handlers
from decode_worker.server.guard import RequestGuard
from decode_worker.server.openapi import declare_models
from decode_worker.server.responses import STREAM_CHUNKS
from decode_worker.server.schemas import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    HandshakeRequest,
)


def create_app(engine: Engine) -> FastAPI:
    cfg = engine.config
    app = FastAPI(title="decode-worker", docs_url=None, redoc_url=None)
    app.state.engine = engine  # what the routes' EngineDep hands them
    install_error_handlers(app)
    app.add_middleware(RequestGuard, api_key=cfg.api_key, max_body_bytes=cfg.max_request_body_bytes,
                       max_concurrent=cfg.max_concurrent_requests, body_timeout_s=cfg.request_body_timeout_s)
    app.include_router(routes_sglang.router(cfg))
    app.include_router(routes_openai.router(cfg))
    app.include_router(routes_ops.router(cfg))
    if cfg.role == "prefill":
        from decode_worker.server import routes_pd  # loads UCX: prefill role only

        app.include_router(routes_pd.router)
    declare_models(app, [GenerateRequest, CompletionRequest, ChatCompletionRequest, HandshakeRequest, AbortRequest,
                         *STREAM_CHUNKS])
    return app
