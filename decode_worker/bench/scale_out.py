"""Scale-out benchmark: shared-prefix traces through 1, 2, 4... decode pods (docs/scale-out.md)."""
from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import httpx

from decode_worker.bench.ceiling import unbounded_hit_rate
from decode_worker.bench.client import Target, bearer, http_client, run_prompts, warm_up_request
from decode_worker.bench.deploy import DeploySpec
from decode_worker.bench.fleet import FleetEndpoints, fleet, redis_flush, routed
from decode_worker.bench.prom import Scrape, scrape
from decode_worker.bench.stats import ClientStats
from decode_worker.bench.timings import P, WorkerStats
from decode_worker.bench.workload import SharedPrefixSpec


@dataclass(frozen=True)
class Routing:
    name: str
    decode_policy: str  # smg's --decode-policy
    shared_l3: bool  # the decode pods share one Redis as L3


ROUTINGS = {r.name: r for r in (
    Routing("round_robin", "round_robin", False),
    Routing("cache_aware", "cache_aware", False),
    Routing("round_robin_l3", "round_robin", True),
    Routing("cache_aware_l3", "cache_aware", True),
)}


@dataclass(frozen=True)
class Trace:
    """A workload's prompts as ids (for the ceiling) and text (sent)."""

    spec: SharedPrefixSpec
    ids: list[list[int]]
    texts: list[str]


@dataclass(frozen=True)
class ScalePlan:
    traces: list[Trace]
    pods: list[int]
    routings: list[Routing]
    concurrency: int
    request_rate: float
    page_size: int
    seed: int
    words: list[int]  # the ids warm-up prompts are drawn from
    decode_text: Callable[[list[int]], str]
    api_key: str = ""

    @property
    def headers(self) -> dict[str, str]:
        return bearer(self.api_key)

    @property
    def total_requests(self) -> int:
        return len(self.pods) * len(self.routings) * sum(len(t.ids) for t in self.traces)


@dataclass(frozen=True)
class ScaleRow:
    workload: str
    mode: str  # the routing's name
    pods: int
    client: ClientStats
    workers: WorkerStats  # decode figures summed over the row's pods
    requests_per_pod: list[int]
    unbounded_hit_rate: float  # one unbounded cache in front of all pods: what no routing can beat
    load_average: tuple[float, float]
    errors: list[str]

    def to_dict(self) -> dict:
        return asdict(self)


async def _flush(http: httpx.AsyncClient, ep: FleetEndpoints, headers: dict[str, str]) -> None:
    for url in (*ep.decodes, ep.prefill):
        (await http.post(url + "/flush_cache", headers=headers, timeout=60)).raise_for_status()
    if ep.redis is not None:
        redis_flush(*ep.redis)


async def _warm_up(plan: ScalePlan, ep: FleetEndpoints) -> None:
    """Two requests per pod, retried while a fresh router answers 503."""
    rng = random.Random(f"warmup-{plan.seed}")
    target, deadline = Target(ep.router, plan.headers), time.monotonic() + 120
    length = max(len(t.ids[0]) for t in plan.traces)
    async with http_client(2) as http:
        for _ in range(2 * len(ep.decodes)):
            ids = [rng.choice(plan.words) for _ in range(length)]
            await warm_up_request(http, target, ids, 2, deadline, plan.decode_text(ids))


async def _scrapes(http: httpx.AsyncClient, ep: FleetEndpoints) -> tuple[list[Scrape], Scrape]:
    return [await scrape(http, url) for url in ep.decodes], await scrape(http, ep.prefill)


async def bench_row(plan: ScalePlan, routing: Routing, ep: FleetEndpoints,
                    progress: Callable[[str], Callable[[], None]]) -> list[ScaleRow]:
    """Every trace through one router over ``ep.decodes``."""
    await _warm_up(plan, ep)
    rows, pods = [], len(ep.decodes)
    async with httpx.AsyncClient() as http:
        for trace in plan.traces:
            await _flush(http, ep, plan.headers)
            decodes0, prefill0 = await _scrapes(http, ep)
            load0, start = os.getloadavg()[0], time.perf_counter()
            done = progress(f"{pods} pods {routing.name} {trace.spec.name}")
            results = await run_prompts(Target(ep.router, plan.headers), trace.ids, trace.spec.output_len,
                                        plan.concurrency, plan.request_rate, plan.seed, done, trace.texts)
            duration = time.perf_counter() - start
            decodes1, prefill1 = await _scrapes(http, ep)
            per_pod = [after - before for after, before in zip(decodes1, decodes0)]
            client = ClientStats.of(results, duration)
            ceiling = unbounded_hit_rate([(r.prompt, r.output) for r in results], plan.page_size)
            rows.append(ScaleRow(trace.spec.name, routing.name, pods, client,
                                 WorkerStats.of(client.ttft_s["mean"], sum(per_pod, Scrape()), prefill1 - prefill0),
                                 [round(s.get(P + "requests_total")) for s in per_pod], ceiling,
                                 (load0, os.getloadavg()[0]), sorted({r.error for r in results if r.error})[:5]))
    return rows


def run_scale_out(plan: ScalePlan, spec: DeploySpec, progress: Callable[[str], Callable[[], None]]) -> list[ScaleRow]:
    """A fleet per L3 setting, sized for the most pods; a router per (pods, routing)."""
    rows: list[ScaleRow] = []
    for shared in (False, True):
        routings = [r for r in plan.routings if r.shared_l3 == shared]
        if not routings:
            continue
        with fleet(spec, max(plan.pods), shared, "shared-l3" if shared else "pod-local") as fl:
            for pods in plan.pods:
                for routing in routings:
                    with routed(fl, pods, routing.decode_policy, f"router-{pods}-{routing.name}") as ep:
                        rows += asyncio.run(bench_row(plan, routing, ep, progress))
    order = {r.name: i for i, r in enumerate(plan.routings)}
    return sorted(rows, key=lambda r: (r.pods, order[r.mode]))
