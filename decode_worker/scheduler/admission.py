"""Admission: queue to LOADING or TRANSFERRING in FIFO order, retracted requests first; a fresh prompt that shares
pages with a prompt admitted before it but not yet computed waits for that one's extend (in-batch prefix sharing)."""
from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterable, Iterator

from decode_worker.cache.pool import OutOfPages
from decode_worker.cache.prefix_cache import PrefixCache, has_storage
from decode_worker.core.lifecycle import CacheHits, ReqState
from decode_worker.core.sequence import TOKEN_BYTES
from decode_worker.metrics import Metrics
from decode_worker.scheduler.lookahead import StorageLookahead
from decode_worker.scheduler.queues import Queues
from decode_worker.scheduler.req import KVTransfer, Req
from decode_worker.scheduler.roles import PromptSource
from decode_worker.scheduler.scoring import computed_before

S = ReqState
PEER_LOOKAHEAD = 32
"""Queued requests per peer (a decode request's prefill, by bootstrap host and port) whose role may start early
work (decode: handshakes, each an HTTP call prefill holds). Per peer, so a stalled prefill with many requests at
the head of the queue holds up only its own: another prefill's requests behind them start their handshakes."""
SHARE_MIN_TOKENS = 32
"""A fresh prompt whose next whole pages, at least this many tokens of them, equal those of a prompt admitted but not
yet computed waits for that prompt's extend and then reads them from the cache: a burst of requests with one system
prompt computes it once, as SGLang's in-batch prefix caching does. Sharing fewer tokens is not worth the step it
waits."""


class Admission:
    def __init__(self, cache: PrefixCache, queues: Queues, source: PromptSource, metrics: Metrics,
                 wakeup: asyncio.Event, *, page_size: int, max_running: int, share_min_tokens: int = SHARE_MIN_TOKENS):
        self.cache = cache
        self.queues = queues
        self.source = source
        self.metrics = metrics
        self.wakeup = wakeup  # set when a transfer ends, so the loop applies it at once
        self.page_size = page_size
        self.max_running = max_running
        self.share_min_tokens = share_min_tokens
        self.lookahead = (StorageLookahead(cache, page_size, self.match_key, wakeup)
                          if has_storage(cache) else None)

    def look_ahead(self) -> None:
        """Start the first queued requests' L3 lookups and handshakes."""
        if self.lookahead is not None:
            for req in self.lookahead.start(self.queues.prealloc):
                self.queues.move(req, S.MATCHING)
        for req in self._peer_windows(self.queues.prealloc):
            if self.receives(req):
                self.source.prepare(req.peer, self.wakeup.set)

    def admit(self) -> None:
        """Admit in order while slots and L1 allow, passing over requests whose peer has not answered and fresh
        prompts that wait for a sharing prompt's extend; the first other one that does not fit stops admission."""
        computing = self._computing_keys()
        while self.queues.admitted() < self.max_running:
            req = self._first_answered(computing)
            if req is None or not self._settled(req) or not self.try_alloc(req):
                return
            if not self.receives(req):
                computing.append(self.match_key(req))

    def _first_answered(self, computing: list[bytes]) -> Req | None:
        queue = self.queues.retracted or self.queues.prealloc
        return next((req for req in self._peer_windows(queue)
                     if (not self.receives(req) or self.source.answered(req.peer))
                     and not self._waits_for_sharer(req, computing)), None)

    def _computing_keys(self) -> list[bytes]:
        """The cache keys of admitted prompts that this worker computes and has not yet."""
        admitted = [*self.queues.loading, *self.queues.extend]
        return [self.match_key(req) for req in admitted if req.state is not S.TRANSFERRING and not self.receives(req)]

    def _waits_for_sharer(self, req: Req, computing: list[bytes]) -> bool:
        """True when fresh ``req`` would read at least ``share_min_tokens`` more tokens from the cache once one of the
        ``computing`` prompts has been computed."""
        if not computing or req.seq.output_ids or self.receives(req):
            return False
        key = self.match_key(req)
        cached = self.cache.match(key).hit_tokens
        page_bytes = self.page_size * TOKEN_BYTES
        return any(shared_pages(key, other, page_bytes) * self.page_size - cached >= self.share_min_tokens
                   for other in computing)

    def receives(self, req: Req) -> bool:
        """True when ``req``'s prompt KV is received: fresh, and its role receives it."""
        return not req.seq.output_ids and self.source.receives(req.peer)

    @staticmethod
    def _peer_windows(queue: Iterable[Req]) -> Iterator[Req]:
        """The queue in order, each peer's first ``PEER_LOOKAHEAD`` only."""
        seen: Counter[tuple[str, int | None]] = Counter()
        for req in queue:
            boot = req.inp.bootstrap
            if boot is not None:
                key = (boot.host, boot.port)
                if seen[key] >= PEER_LOOKAHEAD:
                    continue
                seen[key] += 1
            yield req

    def forget(self, req: Req) -> None:
        """A request leaving before admission: stop its handshake and prefetch."""
        self.source.forget(req.peer)
        if self.lookahead is not None:
            self.lookahead.settle(req, insert=False)

    def _settled(self, req: Req) -> bool:
        """True once ``req`` is done with L3."""
        if self.lookahead is None:
            return True
        settled = self.lookahead.settled(req)
        if settled and req.state is S.MATCHING:
            self.queues.move(req, S.QUEUED)
        elif not settled and req.state is S.QUEUED:
            self.queues.move(req, S.MATCHING)
        return settled

    def match_key(self, req: Req) -> bytes:
        """The tokens whose cached KV ``req`` may use (a computed prompt recomputes its last token)."""
        seq = req.seq
        if self.receives(req):
            return seq.key(len(seq.prompt_ids))
        scored_from = computed_before(req)  # a prompt scored here needs its logits from there on
        return seq.key(seq.num_tokens - 1 if scored_from is None else min(seq.num_tokens - 1, scored_from))

    def try_alloc(self, req: Req) -> bool:
        """Lock the match and allocate the delta if it fits; False, taking nothing, if not."""
        seq, ps = req.seq, self.page_size
        receives = self.receives(req)
        match = self.cache.match(self.match_key(req))
        kv_tokens = len(seq.prompt_ids) if receives else seq.num_tokens
        delta = -(-kv_tokens // ps) - match.hit_tokens // ps
        restore = match.host_hit_tokens // ps
        headroom = len(self.queues.running)  # one page of growth per running request
        if restore + delta + headroom > self.cache.available_device_pages():
            return False
        try:
            req.handle = self.cache.load_back_and_lock(match, extra_pages=delta)
        except OutOfPages:
            return False
        req.prefix_pages = len(req.handle.device_indices)
        if not seq.output_ids:  # report only the first admission, not a resumption
            self._count_hits(req)
        req.transfer = KVTransfer(time.monotonic())
        if not req.seq.output_ids and req.retries == 0:  # its first admission, not a resumption or a retry
            self.metrics.queue_time.observe(req.transfer.since - req.stream.created_at)
        if receives:
            req.transfer.receive = pending = req.pending_receive()
            task = asyncio.get_running_loop().create_task(self.source.receive(pending))
            task.add_done_callback(lambda _: self.wakeup.set())
            req.transfer.task = task
        self.queues.move(req, S.TRANSFERRING if receives else S.LOADING)
        return True

    def _count_hits(self, req: Req) -> None:
        """Cached tokens found per tier at first admission."""
        h, ps = req.handle, self.page_size
        span = req.fetch.span if req.fetch is not None else range(0)
        restored_from = req.prefix_pages - h.restored_tokens // ps  # restored pages end the prefix
        storage = max(0, min(span.stop, req.prefix_pages) - max(span.start, restored_from)) * ps
        req.hits = CacheHits(h.device_hit_tokens, h.restored_tokens - storage, storage)
        for tier, n in req.hits.as_dict().items():
            self.metrics.cached_tokens.labels(tier).inc(n)


def shared_pages(a: bytes, b: bytes, page_bytes: int) -> int:
    """Whole pages equal at the start of both keys (a binary search of memory compares)."""
    va, vb = memoryview(a), memoryview(b)
    low, high = 0, min(len(a), len(b)) // page_bytes
    while low < high:
        mid = (low + high + 1) // 2
        if va[: mid * page_bytes] == vb[: mid * page_bytes]:
            low = mid
        else:
            high = mid - 1
    return low
