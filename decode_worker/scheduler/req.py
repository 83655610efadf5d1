"""One request's whole state in one record: tokens and pages, lifecycle state, L3 fetch, KV transfer."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from decode_worker.cache.pool import NO_PAGES
from decode_worker.cache.hicache import LoadHandle
from decode_worker.cache.prefix_cache import PrefixCache
from decode_worker.cache.storage.tier import Prefetch
from decode_worker.core.lifecycle import CacheHits, ReqState
from decode_worker.core.request import GenerateInput, Prefilled, RequestError, RequestStream
from decode_worker.core.sequence import Sequence
from decode_worker.scheduler.grammar import RowGrammar
from decode_worker.scheduler.roles import HeldPrompt, PeerPrompt, PendingReceive


@dataclass(eq=False)
class StorageFetch:
    """A queued request's L3 lookup and prefetch; owns ``host_pages`` until settled."""

    key: bytes  # the tokens the request matches with, packed (``Sequence.key``)
    from_page: int  # page of ``key`` that keys[0] names (the end of the L1 + L2 hit at lookup time)
    keys: list[str]
    deadline: float  # loop time after which the request stops waiting (timeout and wait_complete policies)
    task: asyncio.Task | None = None  # exists, then prefetch, then wait as the policy says
    prefetch: Prefetch | None = None
    host_pages: np.ndarray | None = None  # L2 page ids from ``alloc_host``
    settled: bool = False
    span: range = range(0)


@dataclass(eq=False)
class KVTransfer:
    """An admitted request's load-back and, on a receiving role, its receive."""

    since: float  # admission; the load-back deadline counts from here
    task: asyncio.Task[Prefilled | tuple[int, float]] | None = None  # returns prefill's first token and its logprob
    receive: PendingReceive | None = None  # what the task was asked to fill

    def in_flight(self) -> bool:
        """The receive may still write into the request's pages."""
        return self.task is not None and not self.task.done()


@dataclass(eq=False)
class Req:
    inp: GenerateInput
    stream: RequestStream
    seq: Sequence
    state: ReqState = ReqState.QUEUED  # changed only by Queues.move, which keeps it in its state's queue
    handle: LoadHandle | None = None
    prefix_pages: int = 0  # leading pages of seq.pages owned by the tree (locked through the handle)
    hits: CacheHits | None = None  # set at the first admission
    transfer: KVTransfer | None = None  # while LOADING or TRANSFERRING
    fetch: StorageFetch | None = None  # the L3 lookahead's lookup, prefetch and the span it attached
    aborted: RequestError | None = None  # why it must end; it is torn down (ABORTED) at the next safe point
    first_token_sent: bool = False
    last_token_at: float = 0.0  # monotonic time of its last output token (inter-token latency)
    own_since: float | None = None  # PD decode: prefill's answer arrived, plus the KV read's time (decode_own_seconds)
    retries: int = 0  # failed load-backs so far
    grammar: RowGrammar | None = None  # constrained decoding: where its output stands in its grammar (grammar.py)
    peer: PeerPrompt = field(init=False)  # what its role sees of it

    def __post_init__(self) -> None:
        inp = self.inp
        self.peer = PeerPrompt(inp.rid, inp.bootstrap, self.seq.prompt_ids, inp.logprob_start,
                               inp.params.top_logprobs)

    @property
    def rid(self) -> str:
        return self.inp.rid

    @property
    def cached_tokens(self) -> dict[str, int]:
        return self.hits.as_dict() if self.hits is not None else {}

    def pending_receive(self) -> PendingReceive:
        """What its role's receive fills: the delta pages past the locked prefix."""
        return PendingReceive(self.peer, self.prefix_pages, self.handle.delta_pages, self._keep_delta_out_of_use)

    def _keep_delta_out_of_use(self) -> None:
        """Never free the delta pages: a read into them could not be stopped."""
        self.handle.delta_pages = NO_PAGES

    def held(self, first: Prefilled, release: Callable[[Req], None], page_size: int) -> HeldPrompt:
        """What the prefill role holds for the peer; ``release`` ends the hold."""
        prompt_pages = -(-len(self.seq.prompt_ids) // page_size)
        return HeldPrompt(self.peer, first, lambda: self.seq.pages[:prompt_pages], lambda: release(self))

    def take_pages(self) -> None:
        """The KV landed: prefix and delta pages become the sequence's."""
        self.seq.pages = self.handle.take_pages().tolist()

    def cache_computed(self, cache: PrefixCache, page_size: int) -> None:
        """Put newly full computed pages into the tree now, for concurrent requests."""
        seq = self.seq
        if seq.num_computed // page_size <= self.prefix_pages:
            return
        pages = np.array(seq.pages, dtype=np.int64)
        self.handle, pages = cache.cache_in_flight(self.handle, seq.key(seq.num_computed), pages)
        self.prefix_pages, seq.pages = len(self.handle.device_indices), pages.tolist()

    def release(self, cache: PrefixCache, page_size: int, *, insert: bool = True, backup: bool = False) -> None:
        """Give back everything held; full computed pages go into the tree (``insert``)."""
        if self.handle is None:
            return
        seq = self.seq
        if seq.pages:
            pages = np.array(seq.pages, dtype=np.int64)
            owned_from = self.prefix_pages
            if insert:
                full = min(seq.num_computed, seq.num_tokens) // page_size
                if full > 0:
                    cache.insert(seq.key(full * page_size), pages[:full], backup=backup)
                owned_from = max(full, self.prefix_pages)
            cache.free_device(pages[owned_from:])
        cache.release(self.handle)
        self.handle, self.prefix_pages, seq.pages, seq.num_computed = None, 0, [], 0
