"""The PD handshake: what decode asks, what prefill answers, and the checks both sides agree on."""
from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from decode_worker.transfer.descriptors import PoolDescriptor


def prompt_digest(token_ids: list[int]) -> str:
    """Digest of the prompt token ids: prefill and decode must have tokenized the same prompt."""
    return hashlib.sha256(np.asarray(token_ids, dtype=np.int64).tobytes()).hexdigest()[:32]


HANDSHAKE_PATH = "/v1/pd/handshake"
PD_TOKEN_HEADER = "X-PD-Token"  # the shared secret of a prefill/decode pair; a header keeps it out of body logs


class HandshakeBody(Protocol):
    """Decode -> prefill: which room, the prompt decode holds, its KV layout, and which prefill agent it already
    knows (prefill then leaves its metadata out of the answer). The HTTP layer validates the body against its
    schema; prefill reads only these fields."""

    room: int
    prompt_len: int
    prompt_digest: str
    layout: dict[str, Any]
    nixl_agent: str  # decode's agent: the one that reads and sends the release notification
    known_agent: str  # the prefill agent whose metadata decode has loaded for this peer, or ""


@dataclass(frozen=True)
class Answer:
    """Prefill -> decode, once prefill holds the room's KV: where the prompt's pages are, the first token, and
    how long prefill keeps them for decode's read (``hold_s`` from the answer; ``waited_s`` is how long prefill
    took to answer, so decode can bound the read by prefill's clock without trusting either clock's time)."""

    room: int
    lease: int  # names this hand-off in the release notification (a room may be reused)
    pages: list[int]  # prefill's pool pages of the whole prompt, in order
    first_token: int
    logprob: float
    pool: PoolDescriptor
    metadata: bytes  # prefill's agent metadata; empty when decode said it knows the agent
    hold_s: float
    waited_s: float

    def to_json(self) -> dict[str, Any]:
        return {"status": "ready", "room": self.room, "lease": self.lease, "pages": self.pages,
                "first_token": self.first_token, "logprob": self.logprob, "pool": self.pool.to_dict(),
                "metadata": base64.b64encode(self.metadata).decode(), "hold_s": self.hold_s, "waited_s": self.waited_s}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Answer:
        return cls(int(d["room"]), int(d["lease"]), [int(p) for p in d["pages"]], int(d["first_token"]),
                   float(d["logprob"]), PoolDescriptor.from_dict(d["pool"]), base64.b64decode(d["metadata"]),
                   float(d["hold_s"]), float(d["waited_s"]))


def release_message(room: int, lease: int) -> bytes:
    """The notification that tells prefill decode is done with a hand-off (read, or given up)."""
    return b"release %d %d" % (room, lease)


def parse_release(message: bytes) -> tuple[int, int] | None:
    parts = message.split()
    if len(parts) != 3 or parts[0] != b"release":
        return None
    try:
        return int(parts[1]), int(parts[2])
    except ValueError:
        return None
