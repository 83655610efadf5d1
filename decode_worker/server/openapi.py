"""Models FastAPI cannot see, put in the OpenAPI schema: request bodies and streamed chunks.

The routes read their body themselves (``parse_body``: any content type, since plain ``curl -d`` sends a form
type, and errors in the project's shape), and stream chunks as SSE text, so FastAPI never meets those models.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

_REF = "#/components/schemas/{model}"


def json_body(model: type[BaseModel], examples: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """``openapi_extra`` of a route whose JSON body is ``model``, with named example bodies."""
    media: dict[str, Any] = {"schema": {"$ref": _REF.format(model=model.__name__)}}
    if examples:
        media["examples"] = {name: {"value": value} for name, value in examples.items()}
    return {"requestBody": {"required": True, "content": {"application/json": media}}}


def declare_models(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Add ``models`` (and the models they use) to the schema's components, once, when it is built."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            _, defs = models_json_schema([(m, "validation") for m in models], ref_template=_REF)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
        return app.openapi_schema

    app.openapi = openapi
