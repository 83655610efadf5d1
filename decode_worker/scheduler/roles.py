"""What a worker's role changes in the scheduler: where a fresh prompt's KV comes from and what happens at a
computed prompt's first token. The PD halves live in ``pd/``, which imports this, never the reverse."""
from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from decode_worker.scheduler.req import Req


class PromptSource(Protocol):
    def receives(self, req: Req) -> bool:
        """True when ``req``'s prompt KV is received rather than computed here; it then matches its whole prompt
        and goes from TRANSFERRING to RUNNING."""
        ...

    def prepare(self, req: Req, wakeup: Callable[[], None]) -> None:
        """Start what can go ahead while ``req`` is queued (decode: the handshake) and call ``wakeup`` when it
        settles; called every step for the first queued requests."""
        ...

    def answered(self, req: Req) -> bool:
        """True once ``req`` could start (decode: prefill answered or the handshake failed); admission passes
        over it until then."""
        ...

    def receive(self, req: Req, delta_pages: np.ndarray) -> Coroutine[Any, Any, tuple[int, float]]:
        """Receive the KV of prompt tokens [prefix, prompt_len) into ``delta_pages``; return prefill's first token
        and logprobs, or raise ``RequestError``. Called once per request that ``receives``."""
        ...

    def forget(self, req: Req) -> None:
        """``req`` leaves before admission: stop what ``prepare`` started."""
        ...


class PromptDone(Protocol):
    def hold(self, req: Req) -> bool:
        """At ``req``'s first token from an extend: True to hold its KV for a decode peer (the client is answered,
        the pages kept until ``release_held``), False to decode on."""
        ...


class Colocated:
    """The colocated role, and the local half of each PD role."""

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
