"""Server-sent events as SGLang and OpenAI streaming clients read them: a ``data:`` line per JSON chunk, an
error raised mid-stream sent as a last error event (its status line went out with the first chunk), then
``data: [DONE]``."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from decode_worker.core.request import RequestError
from decode_worker.server.errors import error_body

HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy may hold tokens back


def _event(data: dict | str) -> str:
    return f"data: {json.dumps(data) if not isinstance(data, str) else data}\n\n"


async def _framed(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    try:
        async for chunk in chunks:
            yield _event(chunk)
    except RequestError as e:
        yield _event(error_body(str(e), e.status, e.kind))
    yield _event("[DONE]")


def sse_response(chunks: AsyncIterator[dict]) -> StreamingResponse:
    return StreamingResponse(_framed(chunks), media_type="text/event-stream", headers=HEADERS)
