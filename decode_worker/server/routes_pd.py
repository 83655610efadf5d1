"""The prefill end of the PD handshake."""
from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from decode_worker.core.request import RequestError
from decode_worker.pd.handshake import HANDSHAKE_PATH, PD_TOKEN_HEADER
from decode_worker.pd.prefill import check_pd_token
from decode_worker.server.generation import until_disconnected
from decode_worker.server.inputs import EngineDep, parse_body
from decode_worker.server.openapi import HANDSHAKE_EXAMPLES, HandshakeAccepted, HandshakePending, errors, json_body
from decode_worker.server.schemas import HandshakeRequest

_TOKEN_HEADER = {"name": PD_TOKEN_HEADER, "in": "header", "required": False, "schema": {"type": "string"},
                 "description": "the pair's --pd-token; required when this worker has one, refused when not"}

router = APIRouter()
log = logging.getLogger(__name__)


# 401 with or without an --api-key: the PD token is checked here.
@router.post(HANDSHAKE_PATH, openapi_extra={**json_body(HandshakeRequest, HANDSHAKE_EXAMPLES),
                                            "parameters": [_TOKEN_HEADER]},
             responses={200: {"model": HandshakeAccepted}, 202: {"model": HandshakePending},
                        **errors(400, 401, 404, 409, 413, 503)})
async def handshake(request: Request, engine: EngineDep) -> JSONResponse:
    body = None
    try:
        body = await parse_body(request, HandshakeRequest)  # first, so an old peer hears its body is refused
        check_pd_token(engine.config.pd_token, request.headers.get(PD_TOKEN_HEADER))
        answer = await until_disconnected(request, engine.handshake(body))
        if answer is None:  # the room's KV is not here yet after the peer's wait_s: it asks again
            return JSONResponse({"status": "pending", "room": body.room}, status_code=202)
        return JSONResponse(answer)
    except RequestError as e:
        peer = f"{request.client.host}:{request.client.port}" if request.client else "an unknown address"
        asked = f"agent {body.nixl_agent}, room {body.room}" if body is not None else "body refused"
        log.warning("handshake from %s (%s) %s: %d %s: %s", peer, asked,
                    "abandoned" if e.status == 499 else "refused", e.status, e.kind, e)
        raise
