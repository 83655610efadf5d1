"""The engine as a FastAPI dependency (``engine: EngineDep``), so routes are plain functions."""
from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from decode_worker.engine.engine import Engine


async def get_engine(request: Request) -> Engine:
    """Async, so FastAPI calls it on the event loop, not in a thread."""
    return request.app.state.engine


EngineDep = Annotated[Engine, Depends(get_engine)]
