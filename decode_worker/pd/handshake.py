"""The PD handshake: what decode tells prefill, and the checks both sides agree on."""
from __future__ import annotations

import hashlib
from typing import Any, Protocol

import numpy as np


def prompt_digest(token_ids: list[int]) -> str:
    """Digest of the prompt token ids: prefill and decode must have tokenized the same prompt."""
    return hashlib.sha256(np.asarray(token_ids, dtype=np.int64).tobytes()).hexdigest()[:32]


HANDSHAKE_PATH = "/v1/pd/handshake"
PD_TOKEN_HEADER = "X-PD-Token"  # the shared secret of a prefill/decode pair; a header keeps it out of body logs


class HandshakeBody(Protocol):
    """Decode -> prefill: what the decode side holds and where to push the rest (the HTTP layer validates the
    body against its schema; prefill reads only these fields)."""

    room: int
    decode_prefix_len: int
    prompt_len: int
    prompt_digest: str
    ucx_address: str  # base64 PeerAddress of the decode side
    layout: dict[str, Any]
