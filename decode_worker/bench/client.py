"""The load generator: streamed `/generate` calls timed at the client."""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from decode_worker.bench.workload import Conversation


@dataclass(frozen=True)
class Target:
    url: str
    headers: dict[str, str] = field(default_factory=dict)


def bearer(api_key: str) -> dict[str, str]:
    """The ``--api-key`` header; none without a key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


@dataclass
class RequestResult:
    prompt: list[int]
    sent_at: float  # seconds after the run started
    output: list[int] = field(default_factory=list)
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)  # per token after the first; a chunk of n tokens gives n
    e2e: float = 0.0
    error: str | None = None


def _body(prompt: list[int], output_len: int, text: str | None) -> dict:
    return {**({"text": text} if text is not None else {"input_ids": prompt}), "stream": True,
            "sampling_params": {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}}


async def generate(http: httpx.AsyncClient, target: Target, prompt: list[int], output_len: int,
                   t0: float, text: str | None = None) -> RequestResult:
    """One streamed request (ids or ``text``); errors: a status or an error chunk."""
    start = time.perf_counter()
    res = RequestResult(prompt, start - t0)
    last = start
    try:
        async with http.stream("POST", target.url + "/generate", json=_body(prompt, output_len, text),
                               headers=target.headers) as resp:
            if resp.status_code != 200:
                res.error = f"{resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return res
            async for line in resp.aiter_lines():
                data = line[5:].strip() if line.startswith("data:") else ""
                if not data or data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"])[:200]
                    return res
                now, new = time.perf_counter(), len(chunk["output_ids"]) - len(res.output)
                if new > 0 and res.ttft is None:
                    res.ttft = now - start
                elif new > 0:
                    res.itl += [(now - last) / new] * new
                if new > 0:
                    last, res.output = now, chunk["output_ids"]
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        res.e2e = time.perf_counter() - start
    return res


async def warm_up_request(http: httpx.AsyncClient, target: Target, prompt: list[int], output_len: int,
                          deadline: float, text: str | None = None) -> None:
    """One request retried until success or ``deadline`` (a fresh router may answer 503)."""
    while (res := await generate(http, target, prompt, output_len, 0.0, text)).error is not None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"warm-up request failed: {res.error}")
        await asyncio.sleep(1)


def http_client(connections: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(900.0, connect=30.0),
                             limits=httpx.Limits(max_connections=connections + 4))


async def run_prompts(target: Target, prompts: list[list[int]], output_len: int, concurrency: int,
                      request_rate: float, seed: int, done: Callable[[], None],
                      texts: list[str] | None = None) -> list[RequestResult]:
    """Open loop: at most ``concurrency`` in flight, Poisson arrivals at ``request_rate`` per second."""
    rng = random.Random(f"arrivals-{seed}")
    gate = asyncio.Semaphore(concurrency)
    t0 = time.perf_counter()
    arrivals, at = [], 0.0
    for _ in prompts:
        arrivals.append(at)
        at += rng.expovariate(request_rate) if request_rate != float("inf") else 0.0

    async def one(prompt: list[int], text: str | None, arrival: float, http: httpx.AsyncClient) -> RequestResult:
        await asyncio.sleep(max(0.0, t0 + arrival - time.perf_counter()))
        async with gate:
            res = await generate(http, target, prompt, output_len, t0, text)
        done()
        return res

    sent_as = texts if texts is not None else [None] * len(prompts)
    async with http_client(concurrency) as http:
        return list(await asyncio.gather(*(one(p, t, a, http) for p, t, a in zip(prompts, sent_as, arrivals))))


async def run_chat(target: Target, convs: list[Conversation], rounds: int, output_len: int,
                   done: Callable[[], None]) -> list[RequestResult]:
    """Closed loop: clients in parallel, rounds in turn; a failed round ends its chat."""
    t0 = time.perf_counter()
    results: list[RequestResult] = []

    async def client(conv: Conversation, http: httpx.AsyncClient) -> None:
        for _ in range(rounds):
            prompt = conv.next_prompt()
            res = await generate(http, target, prompt, output_len, t0)
            results.append(res)
            done()
            if res.error is not None:
                return
            conv.answered(prompt, res.output)

    async with http_client(len(convs)) as http:
        await asyncio.gather(*(client(c, http) for c in convs))
    return sorted(results, key=lambda r: r.sent_at)
