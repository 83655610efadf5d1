"""One run: per mode a deployment, each workload on emptied caches between scrapes."""
from __future__ import annotations

import asyncio
import copy
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import httpx

from decode_worker.bench.ceiling import unbounded_hit_rate
from decode_worker.bench.client import (
    RequestResult,
    Target,
    bearer,
    http_client,
    run_chat,
    run_prompts,
    warm_up_request,
)
from decode_worker.bench.deploy import DeploySpec, Endpoints, deployed
from decode_worker.bench.link import LOCAL
from decode_worker.bench.modes import WARMS_RESTART, Mode
from decode_worker.bench.prom import Scrape, scrape
from decode_worker.bench.stats import ClientStats
from decode_worker.bench.timings import WorkerStats
from decode_worker.bench.workload import ChatSpec, Conversation, SharedPrefixSpec, conversations, shared_prefix_trace

Workload = SharedPrefixSpec | ChatSpec
WARMUP_REQUESTS = 2


@dataclass(frozen=True)
class Plan:
    workloads: list[Workload]
    modes: list[Mode]
    concurrency: int
    request_rate: float
    page_size: int
    vocab_size: int
    seed: int
    api_key: str = ""

    @property
    def headers(self) -> dict[str, str]:
        return bearer(self.api_key)

    @property
    def total_requests(self) -> int:
        return len(self.modes) * sum(w.groups * w.prompts_per_group if isinstance(w, SharedPrefixSpec)
                                     else w.clients * w.rounds for w in self.workloads)


@dataclass(frozen=True)
class Row:
    """One workload under one mode: a table row, a JSON entry."""

    workload: str
    mode: str
    client: ClientStats
    workers: WorkerStats
    unbounded_hit_rate: float
    load_average: tuple[float, float]  # the host's 1-minute load at the row's start and end: a shared machine
    errors: list[str]
    kv_probe_gbit: float | None = None  # KV rate of one request alone on the deployment: bytes / its transfer
    link: str = LOCAL  # the link prefill and decode talked over (bench/link.py)
    link_gbit: float | None = None  # its configured rate; None: the host's own loopback
    tcp_probe_gbit: float | None = None  # a plain TCP stream over the same link, apart from UCX

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Row:
        return cls(**{**d, "client": ClientStats(**d["client"]), "workers": WorkerStats(**d["workers"]),
                      "load_average": tuple(d["load_average"])})


@dataclass
class History:
    """What a storage row served, for the restart row to continue."""

    requests: dict[str, list[RequestResult]] = field(default_factory=dict)
    chats: dict[str, list[Conversation]] = field(default_factory=dict)


async def _scrape(http: httpx.AsyncClient, url: str | None) -> Scrape | None:
    return await scrape(http, url) if url else None


async def _flush(http: httpx.AsyncClient, ep: Endpoints, headers: dict[str, str]) -> None:
    """Empty both workers' caches; RuntimeError if one stays warm."""
    for url in (ep.decode, ep.prefill):
        if url:
            resp = await http.post(url + "/flush_cache", headers=headers, timeout=60)
            resp.raise_for_status()
            if not resp.json().get("success", False):
                raise RuntimeError(f"{url}/flush_cache left the cache warm: {resp.json().get('message')}")


async def _kv_probe(plan: Plan, target: Target, ep: Endpoints, prompt_len: int) -> float | None:
    """One lone request's KV rate in Gbit/s, on an uncached prompt."""
    if ep.decode is None:
        return None
    rng = random.Random(f"probe-{plan.seed}")
    prompt = [rng.randrange(plan.vocab_size) for _ in range(prompt_len)]
    async with http_client(1) as http:
        before = await scrape(http, ep.decode)
        await warm_up_request(http, target, prompt, 1, time.monotonic() + 120)
        d = await scrape(http, ep.decode) - before
    seconds = d.get("decode_worker_kv_transfer_seconds_sum")
    return d.get("decode_worker_kv_received_bytes_total") * 8 / seconds / 1e9 if seconds else None


async def _warm_up(plan: Plan, target: Target, prompt_len: int) -> None:
    """Keep one-off costs (allocator, kernels) out of the figures."""
    rng = random.Random(f"warmup-{plan.seed}")
    deadline = time.monotonic() + 120
    async with http_client(WARMUP_REQUESTS) as http:
        for _ in range(WARMUP_REQUESTS):
            await warm_up_request(http, target, [rng.randrange(plan.vocab_size) for _ in range(prompt_len)], 4,
                                  deadline)


async def _replay(plan: Plan, workload: Workload, mode: Mode, target: Target, history: History,
                  done: Callable[[], None]) -> list[RequestResult]:
    if isinstance(workload, SharedPrefixSpec):
        prompts = [p.ids for p in shared_prefix_trace(workload, plan.vocab_size, 1 if mode.restart else 0)]
        return await run_prompts(target, prompts, workload.output_len, plan.concurrency, plan.request_rate, plan.seed,
                                 done)
    convs = copy.deepcopy(history.chats[workload.name]) if mode.restart else conversations(workload, plan.vocab_size)
    results = await run_chat(target, convs, workload.rounds, workload.output_len, done)
    if mode.name == WARMS_RESTART:
        history.chats[workload.name] = convs
    return results


async def bench_mode(plan: Plan, mode: Mode, ep: Endpoints, history: History, flush: bool,
                     progress: Callable[[str], Callable[[], None]]) -> list[Row]:
    """Every workload on one deployment."""
    target = Target(ep.router, plan.headers)
    longest = max(w.prefix_len + w.suffix_len if isinstance(w, SharedPrefixSpec) else w.first_len
                  for w in plan.workloads)
    await _warm_up(plan, target, longest)
    probe = await _kv_probe(plan, target, ep, longest)
    rows = []
    async with httpx.AsyncClient() as http:
        for workload in plan.workloads:
            if flush:
                await _flush(http, ep, plan.headers)
            before = await _scrape(http, ep.decode), await _scrape(http, ep.prefill)
            load0, start = os.getloadavg()[0], time.perf_counter()
            results = await _replay(plan, workload, mode, target, history, progress(f"{mode.name} {workload.name}"))
            duration = time.perf_counter() - start
            after = await _scrape(http, ep.decode), await _scrape(http, ep.prefill)
            warm = history.requests.get(workload.name, []) if mode.restart else []
            if mode.name == WARMS_RESTART:
                history.requests[workload.name] = results
            decode, prefill = (a - b if a is not None and b is not None else None for a, b in zip(after, before))
            client = ClientStats.of(results, duration)
            ceiling = unbounded_hit_rate([(r.prompt, r.output) for r in results], plan.page_size,
                                         [(r.prompt, r.output) for r in warm])
            rows.append(Row(workload.name, mode.name, client, WorkerStats.of(client.ttft_s["mean"], decode, prefill),
                            ceiling, (load0, os.getloadavg()[0]), sorted({r.error for r in results if r.error})[:5],
                            probe))
    return rows


def run(plan: Plan, spec: DeploySpec | None, given: Endpoints | None,
        progress: Callable[[str], Callable[[], None]]) -> list[Row]:
    """Each mode on its own deployment from ``spec``, or on ``given`` with its caches as they are."""
    history, rows = History(), []
    for mode in plan.modes:
        if given is not None:
            rows += asyncio.run(bench_mode(plan, mode, given, history, False, progress))
            continue
        with deployed(spec, mode) as ep:
            rows += asyncio.run(bench_mode(plan, mode, ep, history, True, progress))
    return rows
