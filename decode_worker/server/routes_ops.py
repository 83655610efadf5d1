"""Health, info, load, cache flush, abort and metrics."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from decode_worker.config import ServerConfig, package_version
from decode_worker.engine.engine import Engine
from decode_worker.server.errors import error_response
from decode_worker.server.inputs import EngineDep, parse_body
from decode_worker.server.openapi import (
    AbortResult,
    FlushResult,
    Load,
    ModelInfo,
    ServerInfo,
    Version,
    auth_statuses,
    errors,
    json_body,
)
from decode_worker.server.schemas import AbortRequest

FLUSH_WAIT_S = 10.0  # longest wait for in-flight copies before flushing what can go
SERVER_INFO = "configuration (secrets left out), model, KV layout and cache figures"


def router(cfg: ServerConfig) -> APIRouter:
    """``cfg`` picks the declared errors."""
    auth = auth_statuses(cfg)
    routes = APIRouter()
    routes.add_api_route("/health", health, methods=["GET"], response_model=None, response_class=Response,
                         responses={200: {"description": "ready"}, **errors(503)})
    routes.add_api_route("/health_generate", health_generate, methods=["GET"], response_model=None,
                         response_class=Response,
                         responses={200: {"description": "one token went through the scheduler"}, **errors(503)})
    for path in ("/get_server_info", "/server_info"):
        routes.add_api_route(path, server_info, methods=["GET"], response_model=None,
                             responses={200: {"model": ServerInfo, "description": SERVER_INFO}, **errors(*auth)})
    for path in ("/get_model_info", "/model_info"):
        routes.add_api_route(path, model_info, methods=["GET"], response_model=None,
                             responses={200: {"model": ModelInfo}, **errors(*auth, 503)})
    routes.add_api_route("/get_load", get_load, methods=["GET"], response_model=None,
                         responses={200: {"model": Load}, **errors(*auth)})
    routes.add_api_route("/flush_cache", flush_cache, methods=["GET"], response_model=None,
                         responses={200: {"model": FlushResult}, **errors(*auth, 503)})
    routes.add_api_route("/flush_cache", flush_cache, methods=["POST"], response_model=None,
                         responses={200: {"model": FlushResult}, **errors(*auth, 413, 503)})
    routes.add_api_route("/abort_request", abort_request, methods=["POST"], response_model=None,
                         openapi_extra=json_body(AbortRequest, {"one": {"rid": "my-request"}, "all": {"abort_all": True}}),
                         responses={200: {"model": AbortResult}, **errors(400, *auth, 413)})
    routes.add_api_route("/get_version", get_version, methods=["GET"], response_model=None,
                         responses={200: {"model": Version}, **errors(*auth)})
    routes.add_api_route("/metrics", metrics, methods=["GET"], response_model=None, response_class=PlainTextResponse)
    return routes


def _not_ready(engine: Engine) -> Response | None:
    """The probes' 503, or None when ready."""
    if engine.ready:
        return None
    return error_response("not ready: " + engine.not_ready_reason, 503, "unavailable")


async def health(engine: EngineDep) -> Response:
    if (refusal := _not_ready(engine)) is not None:
        return refusal
    return Response(status_code=200)


async def health_generate(engine: EngineDep) -> Response:
    if (refusal := _not_ready(engine)) is not None:
        return refusal
    await engine.health_generate()
    return Response(status_code=200)


async def server_info(engine: EngineDep) -> dict:
    return engine.server_info()


async def model_info(engine: EngineDep) -> dict:
    engine.require_ready()
    return {"model_path": engine.model_path, "served_model_name": engine.model_name,
            "tokenizer_path": engine.model_path, "is_generation": True,
            "max_context": engine.model_config.max_context}


async def get_load(engine: EngineDep) -> dict:
    return engine.get_load()


async def flush_cache(engine: EngineDep) -> dict:
    """Waits up to ``FLUSH_WAIT_S`` for tier copies; ``success`` false, saying why, if any token stayed."""
    engine.require_ready()
    out = await engine.cache.flush_settled(FLUSH_WAIT_S)
    message = f"cache flushed: {out.dropped_tokens} tokens dropped"
    if not out.complete:
        running = (f"{out.copies_in_flight} L1/L2 copies still running after {FLUSH_WAIT_S:.0f} s and "
                   if out.copies_in_flight else "")
        message += f"; {out.kept_tokens} tokens stayed, held by {running}running requests"
    return {"success": out.complete, "message": message, "dropped_tokens": out.dropped_tokens,
            "kept_tokens": out.kept_tokens}


async def metrics(engine: EngineDep) -> Response:
    return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4")


async def abort_request(request: Request, engine: EngineDep) -> dict:
    """Abort a live request, or all (499 to their clients); an unknown id aborts nothing."""
    body = await parse_body(request, AbortRequest)
    live = engine.live_requests()
    rids = live if body.abort_all else [r for r in live if r == body.rid]
    for rid in rids:
        engine.abort(rid)
    return {"aborted": len(rids)}


async def get_version() -> dict:
    return {"version": package_version()}
