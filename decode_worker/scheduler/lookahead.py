"""L3 lookahead: the first queued requests prefetch their prefix from the store into L2."""
from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Callable, Iterable

from decode_worker.cache.prefix_cache import PrefetchCache
from decode_worker.scheduler.req import Req, StorageFetch

STORAGE_LOOKAHEAD = 8  # queued requests that may have an L3 lookup or prefetch in flight (each holds L2 pages)


class StorageLookahead:
    def __init__(self, cache: PrefetchCache, page_size: int, match_key: Callable[[Req], bytes],
                 wakeup: asyncio.Event):
        self.cache = cache
        self.storage = cache.storage
        self.page_size = page_size
        self.match_key = match_key  # the tokens whose cached KV a request can use
        self.wakeup = wakeup  # set at each lookup's or prefetch's progress
        self._fetching: Counter[str] = Counter()  # L3 keys of unsettled fetches: later requests do not repeat them

    def start(self, queue: Iterable[Req]) -> list[Req]:
        """Start the first queued requests' L3 lookups; returns those that began."""
        started = []
        for req in itertools.islice(queue, STORAGE_LOOKAHEAD):
            fresh = req.fetch is None and not req.seq.output_ids and req.aborted is None
            if fresh and self._start_fetch(req, defer=True):
                started.append(req)
        return started

    def _start_fetch(self, req: Req, defer: bool) -> bool:
        """Start ``req``'s lookup; with ``defer``, not while an earlier one fetches its next page."""
        key = self.match_key(req)
        match = self.cache.match(key)
        keys = self.cache.storage_keys(match)
        if defer and keys and self._fetching[keys[0]]:
            return False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.storage.prefetch_deadline_s(len(keys) * self.page_size)
        req.fetch = fetch = StorageFetch(key, match.hit_tokens // self.page_size, keys, deadline)
        if keys:
            self._fetching.update(keys)
            fetch.task = loop.create_task(self._fetch(fetch))
        return True

    async def _fetch(self, fetch: StorageFetch) -> None:
        """Fetch what the store holds into L2, up to the policy's deadline."""
        waits = self.storage.policy.name != "best_effort"
        try:
            async with asyncio.timeout_at(fetch.deadline if waits else None):
                found = await self.storage.exists(fetch.keys)
                if fetch.settled:  # settled while the store answered (a cancel lost in wait_for): take nothing
                    return
                fetch.host_pages = self.cache.alloc_host(found) if found else None
                if fetch.host_pages is not None:
                    fetch.prefetch = self.storage.start_prefetch(fetch.keys[:found], self.cache.host_pool,
                                                                 fetch.host_pages)
                    await fetch.prefetch.wait(None)
        except TimeoutError:
            pass  # past the policy's deadline: the request proceeds with the pages that arrived
        finally:
            self.wakeup.set()

    def settled(self, req: Req) -> bool:
        """True once ``req`` is done with L3."""
        if req.seq.output_ids:
            return True
        if req.fetch is None:
            self._start_fetch(req, defer=False)
        fetch = req.fetch
        if not fetch.settled:
            waiting = fetch.task is not None and not fetch.task.done()
            waits = self.storage.policy.name != "best_effort"  # best_effort: the request could start now
            if waiting and waits and asyncio.get_running_loop().time() < fetch.deadline:
                return False  # the deadline is checked here too: the task's own timeout can be lost like a cancel
            self.settle(req, insert=True)
        return True

    def settle(self, req: Req, insert: bool) -> None:
        """Stop the prefetch; attach what arrived (``insert``), free the other L2 pages."""
        fetch = req.fetch
        if fetch is None or fetch.settled:
            return
        fetch.settled = True
        for key in fetch.keys:
            self._fetching[key] -= 1
            if not self._fetching[key]:
                del self._fetching[key]
        if fetch.task is not None:
            fetch.task.cancel()
        pages, fetch.host_pages = fetch.host_pages, None
        if pages is None:
            return
        arrived = fetch.prefetch.stop() if fetch.prefetch is not None else 0
        if insert and arrived:
            fetch.span = self.cache.insert_host(fetch.key, pages[:arrived], fetch.from_page)
        self.cache.free_host(pages[arrived if insert else 0 :])
