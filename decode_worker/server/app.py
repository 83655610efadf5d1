"""The HTTP app and the server that runs it."""
from __future__ import annotations

import asyncio
import contextlib
import logging

import uvicorn
from fastapi import FastAPI

from decode_worker.config import ServerConfig
from decode_worker.engine.engine import Engine
from decode_worker.server import routes_openai, routes_ops, routes_sglang
from decode_worker.server.errors import install_error_handlers
from decode_worker.server.guard import RequestGuard, Slots
from decode_worker.server.openapi import declare_models

log = logging.getLogger("decode_worker")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
PROBES = frozenset({"/health", "/health_generate", "/metrics"})


def create_app(engine: Engine) -> FastAPI:
    cfg = engine.config
    app = FastAPI(title="decode-worker", docs_url=None, redoc_url=None)
    app.state.engine = engine  # what the routes' EngineDep hands them
    app.state.slots = Slots(cfg.max_concurrent_requests)  # the guard's cap, which routes extend by a fan-out
    install_error_handlers(app)
    app.add_middleware(RequestGuard, api_key=cfg.api_key, max_body_bytes=cfg.max_request_body_bytes,
                       slots=app.state.slots, body_timeout_s=cfg.request_body_timeout_s)
    app.include_router(routes_sglang.router(cfg))
    app.include_router(routes_openai.router(cfg))
    app.include_router(routes_ops.router(cfg))
    if cfg.role == "prefill":
        from decode_worker.server import routes_pd  # loads UCX: prefill role only

        app.include_router(routes_pd.router)
    declare_models(app)
    return app


class QuietProbes(logging.Filter):
    """Probes and scrapes log at debug only."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        probe = len(args) >= 3 and str(args[2]).split("?")[0] in PROBES
        return not probe or logging.getLogger("uvicorn.access").isEnabledFor(logging.DEBUG)


def build_app(config: ServerConfig) -> tuple[FastAPI, Engine]:
    """The app, its engine loading in the background."""
    engine = Engine(config)
    app = create_app(engine)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        async def start() -> None:
            try:
                await engine.start()
                log.info("ready: %s role, model %s, http://%s:%d", config.role, engine.model_name, config.host, config.port)
            except Exception as e:  # stay up and say why in /health rather than die without a word
                log.exception("start-up failed")
                engine.not_ready_reason = f"start-up failed: {e}"

        task = asyncio.create_task(start())
        yield
        task.cancel()
        await engine.shutdown()

    app.router.lifespan_context = lifespan
    return app, engine


# An idle connection stays open this long: longer than the idle pools of the clients in front of a worker
# (a router's reqwest pool keeps them 90 s, httpx 5 s), so the client closes first. With uvicorn's 5 s a request
# sent on a connection the server is closing at that moment fails without reaching the worker.
KEEP_ALIVE_S = 120


def serve(config: ServerConfig) -> None:
    logging.basicConfig(level=config.log_level.upper(), format=LOG_FORMAT)
    logging.getLogger("uvicorn.access").addFilter(QuietProbes())
    app, _ = build_app(config)
    # log_config=None: uvicorn's loggers go through the root handler above, so every line has one format.
    uvicorn.run(app, host=config.host, port=config.port, loop="uvloop", log_level=config.log_level,
                log_config=None, timeout_graceful_shutdown=15, timeout_keep_alive=KEEP_ALIVE_S)
