"""The engine as a FastAPI dependency: a route declares ``engine: EngineDep`` and gets the app's engine, so route
modules hold plain functions instead of closures over it."""
from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from decode_worker.engine.engine import Engine


async def get_engine(request: Request) -> Engine:
    """Async, so FastAPI calls it on the event loop rather than in a worker thread."""
    return request.app.state.engine


EngineDep = Annotated[Engine, Depends(get_engine)]
