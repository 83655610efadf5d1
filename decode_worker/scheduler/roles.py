"""What a worker's role changes in the scheduler: where a fresh prompt's KV comes from, and what happens once
a prompt computed here has its first token.

Colocated: an extend computes every prompt and decoding goes on (``Colocated``, here). Decode role: prompts
arrive from prefill (``pd.decode.DeltaKVFetcher``), whose handshake starts while the request is queued. Prefill role: a PD request's KV is held for its decode peer
(``pd.prefill.KVHandoff``). The PD halves live in ``pd/``, which imports the scheduler, never the reverse.
"""
from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from decode_worker.scheduler.req import Req


class PromptSource(Protocol):
    def receives(self, req: Req) -> bool:
        """True when ``req``'s prompt KV is received rather than computed here by an extend. Then the request
        matches its whole prompt, is allocated pages for all of it, and goes from TRANSFERRING to RUNNING."""
        ...

    def prepare(self, req: Req, wakeup: Callable[[], None]) -> None:
        """Start what can go ahead while ``req`` is queued (decode: the handshake, so prefill computes while the L3
        prefetch runs); ``wakeup`` is called when it settles. Called every step for the first queued requests."""
        ...

    def answered(self, req: Req) -> bool:
        """True once ``req`` could start (decode: prefill answered or the handshake failed). Admission passes over
        a request until then; its L3 prefetch runs meanwhile."""
        ...

    def receive(self, req: Req, delta_pages: np.ndarray) -> Coroutine[Any, Any, tuple[int, float]]:
        """Receive the KV of prompt tokens [prefix, prompt_len) into ``delta_pages``; returns prefill's first
        token and its logprob, or raises RequestError. Called once per request that ``receives``."""
        ...

    def forget(self, req: Req) -> None:
        """``req`` leaves before admission: stop what ``prepare`` started."""
        ...


class PromptDone(Protocol):
    def hold(self, req: Req) -> bool:
        """Called when an extend gave ``req`` its first token and it goes on: True when its KV is to be held for
        a decode peer (the scheduler answers the client and keeps the pages until ``release_held``), False
        when it decodes on."""
        ...


class Colocated:
    """The colocated role, and the local half of each PD role: prompts are computed here, decoding goes on."""

    def receives(self, req: Req) -> bool:
        return False

    def prepare(self, req: Req, wakeup: Callable[[], None]) -> None:
        pass

    def answered(self, req: Req) -> bool:
        return True  # nothing to wait for: a best_effort prefetch stops at admission

    def forget(self, req: Req) -> None:
        pass

    def receive(self, req: Req, delta_pages: np.ndarray) -> Coroutine[Any, Any, tuple[int, float]]:
        raise TypeError("a colocated scheduler receives no prompt KV (receives() is always False)")

    def hold(self, req: Req) -> bool:
        return False


COLOCATED = Colocated()
