"""Server-sent events: a ``data:`` line per chunk, a mid-stream error as a last event, then ``data: [DONE]``."""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from decode_worker.core.request import RequestError
from decode_worker.server.errors import error_body

log = logging.getLogger(__name__)
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy may hold tokens back


def _event(data: dict | str) -> str:
    return f"data: {json.dumps(data) if not isinstance(data, str) else data}\n\n"


async def _framed(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    try:
        async for chunk in chunks:
            yield _event(chunk)
    except RequestError as e:  # the scheduler logged the request's failure
        yield _event(error_body(str(e), e.status, e.kind))
    except Exception as e:  # a bug while building a chunk: the client still hears of it, and the stream ends
        log.exception("stream failed")
        yield _event(error_body(f"internal error: {type(e).__name__}: {e}", 500, "internal_error"))
    yield _event("[DONE]")


def sse_response(chunks: AsyncIterator[dict]) -> StreamingResponse:
    return StreamingResponse(_framed(chunks), media_type="text/event-stream", headers=HEADERS)
