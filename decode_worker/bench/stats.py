"""Client-side latency distributions and throughput over successful requests."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from decode_worker.bench.client import RequestResult

QUANTILES = (50, 90, 99)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Closest-ranks linear interpolation (numpy's default) on a sorted list."""
    pos = (len(sorted_values) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    """p50/p90/p99 and mean in seconds; each None without values."""
    ordered = sorted(values)
    out: dict[str, float | None] = {f"p{q}": percentile(ordered, q) if ordered else None for q in QUANTILES}
    out["mean"] = sum(ordered) / len(ordered) if ordered else None
    return out


@dataclass(frozen=True)
class ClientStats:
    requests: int
    failed: int
    duration_s: float
    ttft_s: dict[str, float | None]
    itl_s: dict[str, float | None]
    e2e_s: dict[str, float | None]
    request_throughput: float  # finished requests per second of the run
    output_throughput: float  # output tokens per second of the run

    @classmethod
    def of(cls, results: Sequence[RequestResult], duration_s: float) -> ClientStats:
        ok = [r for r in results if r.error is None]
        return cls(
            requests=len(results),
            failed=len(results) - len(ok),
            duration_s=duration_s,
            ttft_s=distribution([r.ttft for r in ok if r.ttft is not None]),
            itl_s=distribution([gap for r in ok for gap in r.itl]),
            e2e_s=distribution([r.e2e for r in ok]),
            request_throughput=len(ok) / duration_s,
            output_throughput=sum(len(r.output) for r in ok) / duration_s,
        )
