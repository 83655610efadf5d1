"""Request bodies and streamed chunks in the OpenAPI schema: routes parse and stream them themselves."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

_REF = "#/components/schemas/{model}"


def json_body(model: type[BaseModel], examples: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """``openapi_extra`` of a route whose JSON body is ``model``, with named examples."""
    media: dict[str, Any] = {"schema": {"$ref": _REF.format(model=model.__name__)}}
    if examples:
        media["examples"] = {name: {"value": value} for name, value in examples.items()}
    return {"requestBody": {"required": True, "content": {"application/json": media}}}


def declare_models(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Add ``models`` (and the models they use) to the schema's components once."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            _, defs = models_json_schema([(m, "validation") for m in models], ref_template=_REF)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
        return app.openapi_schema

    app.openapi = openapi
