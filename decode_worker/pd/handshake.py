"""The PD handshake: what decode asks, what prefill answers, and the checks."""
from __future__ import annotations

import base64
import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from decode_worker.core.request import Prefilled, PromptLogprobs
from decode_worker.core.sampling import MAX_TOP_LOGPROBS
from decode_worker.transfer.descriptors import PoolDescriptor


def prompt_digest(token_ids: list[int]) -> str:
    return hashlib.sha256(np.asarray(token_ids, dtype=np.int64).tobytes()).hexdigest()[:32]


HANDSHAKE_PATH = "/v1/pd/handshake"
PD_TOKEN_HEADER = "X-PD-Token"  # the shared secret of a prefill/decode pair; a header keeps it out of body logs


class HandshakeBody(Protocol):
    """Decode -> prefill: room, prompt, KV layout, and the prefill agent it knows."""

    room: int
    prompt_len: int
    prompt_digest: str
    layout: dict[str, Any]
    nixl_agent: str  # decode's agent: the one that reads and sends the release notification
    known_agent: str  # the prefill agent whose metadata decode has loaded for this peer, or ""
    wait_s: float | None  # answer "not yet" (202) after this long; None: wait for the KV up to the lease time


MAX_HANDSHAKE_WAIT_S = 600.0
"""The longest ``wait_s`` a handshake may ask prefill to hold its answer for."""
MAX_POOL_PAGES = 1 << 22
"""The most pages a peer's pool may declare: its page table is built here, one row per page."""
MAX_METADATA_BYTES = 1 << 20
"""The most agent metadata an answer may carry (a NIXL agent's is a few KB)."""
MAX_HOLD_S = 24 * 3600.0


class BadAnswer(ValueError):
    """A field of prefill's answer decode cannot use; ``field`` names it."""

    def __init__(self, field: str, why: str):
        self.field = field
        super().__init__(f"{field} {why}")


@dataclass(frozen=True)
class Asked:
    """What decode asked for; answers are checked against it."""

    room: int
    prompt_len: int
    page_size: int
    page_bytes: int  # of our pool: the peer's pages must be the same size
    vocab_size: int
    round_trip_s: float  # from posting the handshake to reading the answer: prefill cannot have waited longer


@dataclass(frozen=True)
class Answer:
    """Prefill -> decode: the pages, the first token, and ``hold_s`` counted from the end of ``waited_s``."""

    room: int
    lease: int  # names this hand-off in the release notification (a room may be reused)
    pages: list[int]  # prefill's pool pages of the whole prompt, in order
    first_token: int
    logprob: float
    pool: PoolDescriptor
    metadata: bytes  # prefill's agent metadata; empty when decode said it knows the agent
    hold_s: float
    waited_s: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)  # the first token's alternatives, if asked
    prompt_logprobs: PromptLogprobs | None = None  # the prompt's own, scored in prefill's forward, if asked

    def to_json(self) -> dict[str, Any]:
        return {"status": "ready", "room": self.room, "lease": self.lease, "pages": self.pages,
                "first_token": self.first_token, "logprob": self.logprob, "pool": self.pool.to_dict(),
                "metadata": base64.b64encode(self.metadata).decode(), "hold_s": self.hold_s, "waited_s": self.waited_s,
                "top_logprobs": [[t, lp] for t, lp in self.top_logprobs],
                "prompt_logprobs": _prompt_to_json(self.prompt_logprobs)}

    def prefilled(self, logprob_start: int | None, top_logprobs: int) -> Prefilled:
        """What the scheduler takes; ``BadAnswer`` unless the logprobs match what was asked."""
        if len(self.top_logprobs) != top_logprobs:
            raise BadAnswer("top_logprobs", f"has {len(self.top_logprobs)} alternatives, the request asks for "
                                            f"{top_logprobs}")
        p = self.prompt_logprobs
        if (None if p is None else p.start) != logprob_start:
            have = "none" if p is None else f"them from position {p.start}"
            raise BadAnswer("prompt_logprobs", f"carries {have}, the request asks for "
                                               f"{'none' if logprob_start is None else f'them from {logprob_start}'}")
        if p is not None and any(len(row) != top_logprobs for row in p.top[p.start == 0:]):
            raise BadAnswer("prompt_logprobs.top", f"must list {top_logprobs} alternatives per token")
        return Prefilled(self.first_token, self.logprob, self.top_logprobs, p)

    @classmethod
    def from_json(cls, d: Any, asked: Asked) -> Answer:
        """The answer, every field checked; ``BadAnswer`` names the first bad one."""
        if not isinstance(d, dict):
            raise BadAnswer("answer", f"must be a JSON object, not {type(d).__name__}")
        if d.get("status") != "ready":
            raise BadAnswer("status", f"must be 'ready', not {d.get('status')!r}")
        room = _int(d, "room", 0, 1 << 64)
        if room != asked.room:
            raise BadAnswer("room", f"is {room}, but decode asked for room {asked.room}")
        pool = _pool(d.get("pool"), asked)
        pages = d.get("pages")
        need = -(-asked.prompt_len // asked.page_size)
        if not isinstance(pages, list) or len(pages) != need:
            raise BadAnswer("pages", f"must list the {need} pages of the {asked.prompt_len}-token prompt, not "
                                     f"{len(pages) if isinstance(pages, list) else type(pages).__name__}")
        if any(type(p) is not int or not 0 <= p < pool.num_pages for p in pages):
            raise BadAnswer("pages", f"must be page indices in [0, {pool.num_pages}) of prefill's pool")
        if len(set(pages)) != len(pages):
            raise BadAnswer("pages", "name a page twice")
        metadata = d.get("metadata")
        try:
            raw = base64.b64decode(metadata, validate=True) if isinstance(metadata, str) else None
        except ValueError:
            raw = None
        if raw is None or len(raw) > MAX_METADATA_BYTES:
            raise BadAnswer("metadata", f"must be base64 of at most {MAX_METADATA_BYTES} bytes")
        return cls(room, _int(d, "lease", 0, 1 << 63), pages, _int(d, "first_token", 0, asked.vocab_size),
                   _float(d, "logprob", -math.inf, 0.0), pool, raw, _float(d, "hold_s", 0.0, MAX_HOLD_S, low_open=True),
                   _float(d, "waited_s", 0.0, asked.round_trip_s),
                   _alternatives(d.get("top_logprobs", []), "top_logprobs", asked.vocab_size),
                   _prompt_from_json(d.get("prompt_logprobs"), asked))


def _int(d: dict, name: str, low: int, high: int, prefix: str = "") -> int:
    """``d[name]``, an integer in ``[low, high)``."""
    v = d.get(name)
    if type(v) is not int or not low <= v < high:
        raise BadAnswer(prefix + name, f"must be an integer in [{low}, {high}), not {v!r}")
    return v


def _float(d: dict, name: str, low: float, high: float, low_open: bool = False) -> float:
    """``d[name]``, a finite number in ``[low, high]`` (``low_open``: ``(low, high]``)."""
    v = d.get(name)
    ok = type(v) in (int, float) and math.isfinite(v) and (low < v if low_open else low <= v) and v <= high
    if not ok:
        raise BadAnswer(name, f"must be a finite number in {'(' if low_open else '['}{low}, {high}], not {v!r}")
    return float(v)


def _pool(d: Any, asked: Asked) -> PoolDescriptor:
    """Prefill's pool: our page size, a bounded count, 64-bit addresses."""
    if not isinstance(d, dict):
        raise BadAnswer("pool", f"must be a JSON object, not {type(d).__name__}")
    agent = d.get("agent")
    if not isinstance(agent, str) or not 0 < len(agent) <= 256:
        raise BadAnswer("pool.agent", "must be a name of 1 to 256 characters")
    page_bytes = _int(d, "page_bytes", 1, 1 << 40, "pool.")
    if page_bytes != asked.page_bytes:
        raise BadAnswer("pool.page_bytes", f"is {page_bytes}, but a page here is {asked.page_bytes} bytes")
    num_pages = _int(d, "num_pages", 1, MAX_POOL_PAGES + 1, "pool.")
    _int(d, "base", 0, (1 << 64) - num_pages * page_bytes, "pool.")
    _int(d, "device", 0, 1 << 16, "pool.")
    if d.get("mem") not in ("DRAM", "VRAM"):
        raise BadAnswer("pool.mem", f"must be DRAM or VRAM, not {d.get('mem')!r}")
    try:
        return PoolDescriptor.from_dict(d)
    except (KeyError, TypeError, ValueError) as e:
        raise BadAnswer("pool.shared", f"is malformed: {e!r}") from e


def release_message(room: int, lease: int) -> bytes:
    """Tells prefill decode is done with a hand-off."""
    return b"release %d %d" % (room, lease)


def parse_release(message: bytes) -> tuple[int, int] | None:
    parts = message.split()
    if len(parts) != 3 or parts[0] != b"release":
        return None
    try:
        return int(parts[1]), int(parts[2])
    except ValueError:
        return None


def _prompt_to_json(p: PromptLogprobs | None) -> dict[str, Any] | None:
    return None if p is None else {"start": p.start, "logprobs": p.logprobs,
                                   "top": [[[t, lp] for t, lp in row] for row in p.top]}


def _logprob(v: Any, name: str) -> float:
    if type(v) not in (int, float) or not math.isfinite(v) or v > 0:
        raise BadAnswer(name, f"must hold finite log-probabilities <= 0, not {v!r}")
    return float(v)


def _alternatives(v: Any, name: str, vocab_size: int) -> list[tuple[int, float]]:
    """At most ``MAX_TOP_LOGPROBS`` pairs, ids in the vocabulary."""
    if not isinstance(v, list) or len(v) > MAX_TOP_LOGPROBS:
        raise BadAnswer(name, f"must be a list of at most {MAX_TOP_LOGPROBS} [token, logprob] pairs")
    out = []
    for pair in v:
        if not isinstance(pair, list) or len(pair) != 2 or type(pair[0]) is not int or not 0 <= pair[0] < vocab_size:
            raise BadAnswer(name, f"must be [token, logprob] pairs with tokens in [0, {vocab_size}), not {pair!r}")
        out.append((pair[0], _logprob(pair[1], name)))
    return out


def _prompt_from_json(v: Any, asked: Asked) -> PromptLogprobs | None:
    """The prompt's logprobs from ``start``, each with its alternatives."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise BadAnswer("prompt_logprobs", f"must be a JSON object or null, not {type(v).__name__}")
    start = _int(v, "start", 0, asked.prompt_len, "prompt_logprobs.")
    logprobs, top, n = v.get("logprobs"), v.get("top"), asked.prompt_len - start
    if not isinstance(logprobs, list) or not isinstance(top, list) or len(logprobs) != n or len(top) != n:
        raise BadAnswer("prompt_logprobs", f"must score the {n} prompt tokens from position {start}, with "
                                           "alternatives for each")
    values = [None if start + i == 0 and lp is None else _logprob(lp, "prompt_logprobs.logprobs")
              for i, lp in enumerate(logprobs)]
    rows = [_alternatives(row, "prompt_logprobs.top", asked.vocab_size) for row in top]
    if start == 0 and rows[0]:
        raise BadAnswer("prompt_logprobs.top", "must be empty for the prompt's first token")
    return PromptLogprobs(start, values, rows)
