"""JSON errors in one shape: {"error": {"message", "type", "code"}}."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from decode_worker.core.request import RequestError

RETRY_AFTER_S = 1  # every 503 says when to come back: not ready yet, shutting down, or busy


def error_body(message: str, status: int, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "code": status}}


def error_response(message: str, status: int, kind: str = "invalid_request_error",
                   headers: dict[str, str] | None = None) -> JSONResponse:
    if status == 503:
        headers = {"Retry-After": str(RETRY_AFTER_S), **(headers or {})}
    return JSONResponse(error_body(message, status, kind), status_code=status, headers=headers)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_union_tag(part: object) -> bool:
    """Whether a path element names a union member."""
    return isinstance(part, str) and (part in _TYPE_TAGS or part[:1].isupper() or any(c in part for c in "[-"))


def describe(exc: RequestValidationError | ValidationError) -> str:
    """One clause per field; for a union, the closest member."""
    fields: dict[object, tuple[int, dict[str, None]]] = {}
    for err in exc.errors():
        loc = [p for p in err.get("loc", ()) if p != "body"]
        where = ".".join(str(p) for p in loc if not _is_union_tag(p))
        key = loc[0] if loc else ""
        depth, clauses = fields.get(key, (-1, {}))
        clause = f"{where}: {err.get('msg')}" if where else str(err.get("msg"))
        if len(loc) > depth:
            fields[key] = (len(loc), {clause: None})
        elif len(loc) == depth:
            clauses[clause] = None
    parts = ["; or ".join(clauses) for _, clauses in list(fields.values())[:5]]
    return "invalid request body: " + "; ".join(parts)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        return error_response(describe(exc), 400)

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError):
        return error_response(str(exc), exc.status, exc.kind)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        return error_response(f"internal error: {type(exc).__name__}: {exc}", 500, "internal_error")

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException):
        return error_response(str(exc.detail), exc.status_code, "not_found" if exc.status_code == 404 else "http_error")
