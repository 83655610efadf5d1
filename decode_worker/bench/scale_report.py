"""The scale-out table: a row per trace, pod count and routing."""
from __future__ import annotations

from collections.abc import Sequence

from decode_worker.bench.report import fmt, hits, ratio
from decode_worker.bench.scale_out import ScaleRow

BASELINE_PODS = 1


def table(rows: Sequence[ScaleRow]) -> str:
    head = ("| trace | decode pods | routing | hit rate L1 / L2 / L3 = total | unbounded | KV received (MB) "
            "| TTFT p50 / p90 / p99 (s) | E2E p50 (s) | req/s | requests per pod | TTFT p50 vs 1 pod |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for workload in dict.fromkeys(r.workload for r in rows):
        group = [r for r in rows if r.workload == workload]
        for r in group:
            c = r.client
            base = next((b for b in group if b.pods == BASELINE_PODS and b.mode == r.mode), None)
            failed = f" ({c.failed} failed)" if c.failed else ""
            lines.append(
                f"| {workload} | {r.pods} | {r.mode}{failed} | {hits(r)} | {r.unbounded_hit_rate:.0%} "
                f"| {fmt(r.workers.kv_received_bytes, 1e-6, 1)} "
                f"| {fmt(c.ttft_s['p50'])} / {fmt(c.ttft_s['p90'])} / {fmt(c.ttft_s['p99'])} "
                f"| {fmt(c.e2e_s['p50'])} | {c.request_throughput:.2f} | {' / '.join(map(str, r.requests_per_pod))} "
                f"| {ratio(c.ttft_s['p50'], base.client.ttft_s['p50'] if base else None)} |")
    return "\n".join(lines) + "\n"
