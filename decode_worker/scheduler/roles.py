"""What a worker's role changes in the scheduler, and the views of a request it gets."""
from __future__ import annotations

from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from decode_worker.core.request import Bootstrap, Prefilled


@dataclass(frozen=True, eq=False)
class PeerPrompt:
    """A request as its role sees it."""

    rid: str
    bootstrap: Bootstrap | None
    prompt_ids: list[int]  # the request's own list: read, never change
    logprob_start: int | None
    top_logprobs: int


@dataclass(eq=False)
class PendingReceive:
    """An admitted request's receive: fill ``pages`` with the prompt's KV past ``prefix_pages``."""

    prompt: PeerPrompt
    prefix_pages: int  # pages the cache already had: the read starts after them
    pages: np.ndarray  # the request's own delta pages
    keep_pages_out_of_use: Callable[[], None]  # a read that could not be stopped: ``pages`` are never freed
    own_since: float | None = None  # set on success: when decode's own share of the first token's latency began


@dataclass(frozen=True, eq=False)
class HeldPrompt:
    """A computed prompt whose KV the prefill role holds for its decode peer."""

    prompt: PeerPrompt
    first: Prefilled  # what prefill's answer carries besides the pages
    prompt_pages: Callable[[], list[int]]  # the pages holding the prompt's KV now (none once released)
    release: Callable[[], None]  # ends the hold; a second call does nothing


class PromptSource(Protocol):
    def receives(self, prompt: PeerPrompt) -> bool:
        """True when this fresh prompt's KV is received rather than computed here."""
        ...

    def prepare(self, prompt: PeerPrompt, wakeup: Callable[[], None]) -> None:
        """Start the early work of a queued receiving request; call ``wakeup`` when it settles."""
        ...

    def answered(self, prompt: PeerPrompt) -> bool:
        """True once the request could start."""
        ...

    def receive(self, pending: PendingReceive) -> Coroutine[Any, Any, Prefilled | tuple[int, float]]:
        """Fill ``pending.pages``; return prefill's first token, or raise ``RequestError``."""
        ...

    def forget(self, prompt: PeerPrompt) -> None:
        """The request left before admission: stop what ``prepare`` started."""
        ...


class PromptDone(Protocol):
    def hold(self, held: HeldPrompt) -> bool:
        """True to hold this computed prompt's KV for a decode peer."""
        ...


class Colocated:
    """The colocated role, and the local half of each PD role."""

    def receives(self, prompt: PeerPrompt) -> bool:
        return False

    def prepare(self, prompt: PeerPrompt, wakeup: Callable[[], None]) -> None:
        pass

    def answered(self, prompt: PeerPrompt) -> bool:
        return True  # nothing to wait for: a best_effort prefetch stops at admission

    def forget(self, prompt: PeerPrompt) -> None:
        pass

    def receive(self, pending: PendingReceive) -> Coroutine[Any, Any, tuple[int, float]]:
        raise TypeError("a colocated scheduler receives no prompt KV (receives() is always False)")

    def hold(self, held: HeldPrompt) -> bool:
        return False


COLOCATED = Colocated()
