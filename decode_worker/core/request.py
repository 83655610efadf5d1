"""What the HTTP layer hands the scheduler, and what comes back."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from decode_worker.core.sampling import SamplingParams


class RequestError(Exception):
    """A request that cannot be served; ``status`` is the client's HTTP status."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.kind = kind


@dataclass(frozen=True)
class Bootstrap:
    """Where a PD request's prefill peer runs its handshake, and the transfer's room."""

    host: str
    port: int
    room: int


@dataclass
class GenerateInput:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    bootstrap: Bootstrap | None = None
    logprob_start: int | None = None  # score the prompt's tokens from this position on; None: do not


@dataclass
class PromptLogprobs:
    """The prompt's log-probabilities from ``start`` (None for the first token) and each token's best
    alternatives."""

    start: int
    logprobs: list[float | None]
    top: list[list[tuple[int, float]]]  # per scored token, best first; [] for the first token or with top 0


class Prefilled(NamedTuple):
    """What comes with a prompt from prefill: its first token, logprobs, and prompt logprobs if asked."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = []
    prompt: PromptLogprobs | None = None


@dataclass
class TokenEvent:
    """New tokens for one request; the last event sets ``finish_reason`` or ``error``."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: dict | None = None
    error: RequestError | None = None
    cached_tokens: dict[str, int] = field(default_factory=dict)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per token: (id, logprob), best first
    prompt_logprobs: PromptLogprobs | None = None  # with the first event, when the request scores its prompt


@dataclass
class RequestStream:
    """The HTTP side's handle: an async iterator of TokenEvents and an abort hook."""

    rid: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    created_at: float = field(default_factory=time.monotonic)

    def __aiter__(self):
        return self

    async def __anext__(self) -> TokenEvent:
        event = self.queue.get_nowait() if not self.queue.empty() else await self.queue.get()
        if event is None:
            raise StopAsyncIteration
        return event
