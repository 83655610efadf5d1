"""The run's outputs: a JSON line of every figure, Markdown tables."""
from __future__ import annotations

import json
from collections.abc import Sequence

from decode_worker.bench.runner import Row
from decode_worker.bench.timings import MISSING_TIMINGS

BASELINE = "radix"  # ratios are against radix-only, as in the reference; the first mode when it did not run
PARTS = ("client", "router_and_http", "prefill_queue", "prefill_compute", "kv_transfer", "decode_other",
         "decode_queue")
RESTART_NOTE = ("restart: a fresh deployment over the L3 folder hier_l3 left. It replays a second round, so its "
                "prompts differ from the other rows': the same prefixes with new suffixes, and for chat the next "
                "rounds of the same conversations (longer prompts, which its fresh prefill computes whole).")


def _rounded(value):
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def json_line(rows: Sequence[Row], machine: dict, settings: dict) -> str:
    return json.dumps(_rounded({"bench": "decode-worker bench", "machine": machine, "settings": settings,
                                "rows": [r.to_dict() for r in rows], "missing_timings": MISSING_TIMINGS}))


def fmt(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "–" if value is None else f"{value * scale:.{digits}f}"


def own_share(row: Row) -> str:
    """Decode's own share of TTFT, p50 / p99 seconds."""
    own = row.workers.decode_own_s or {}
    return f"{fmt(own.get('p50'), 1.0, 3)} / {fmt(own.get('p99'), 1.0, 3)}"


def hits(row: Row) -> str:
    h = row.workers.hit_rate
    if h is None:
        return "–"
    return f"{h['device']:.0%} / {h['host']:.0%} / {h['storage']:.0%} = **{h['total']:.0%}**"


def ratio(a: float | None, b: float | None) -> str:
    return "–" if a is None or not b else f"{a / b:.2f}x"


def _baseline(rows: Sequence[Row]) -> str:
    return BASELINE if any(r.mode == BASELINE for r in rows) else rows[0].mode


def table(rows: Sequence[Row]) -> str:
    """One table of every workload and mode, then TTFT's parts."""
    base_mode = _baseline(rows)
    head = ("| workload | mode | hit rate L1 / L2 / L3 = total | unbounded | KV received (MB) "
            "| TTFT p50 / p90 / p99 (s) | ITL p50 / p99 (ms) | E2E p50 (s) | req/s | out tok/s "
            f"| TTFT p50 vs {base_mode} | req/s vs {base_mode} |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    parts_head = ("| workload | mode | client TTFT | router + HTTP | prefill queue | prefill compute | KV transfer "
                  "| decode other | decode queue (alongside prefill) | decode's own, per request p50 / p99 "
                  "| load avg start → end |")
    parts = [parts_head, "|" + "---|" * (parts_head.count("|") - 1)]
    for workload in dict.fromkeys(r.workload for r in rows):
        group = [r for r in rows if r.workload == workload]
        base = next((r for r in group if r.mode == base_mode), group[0])
        for r in group:
            c, w, t = r.client, r.workers, r.workers.ttft_parts_s
            kv = fmt(w.kv_received_bytes, 1e-6, 1)
            failed = f" ({c.failed} failed)" if c.failed else ""
            lines.append(
                f"| {workload} | {r.mode}{failed} | {hits(r)} | {r.unbounded_hit_rate:.0%} | {kv} "
                f"| {fmt(c.ttft_s['p50'])} / {fmt(c.ttft_s['p90'])} / {fmt(c.ttft_s['p99'])} "
                f"| {fmt(c.itl_s['p50'], 1e3, 0)} / {fmt(c.itl_s['p99'], 1e3, 0)} | {fmt(c.e2e_s['p50'])} "
                f"| {c.request_throughput:.2f} | {c.output_throughput:.1f} "
                f"| {ratio(c.ttft_s['p50'], base.client.ttft_s['p50'])} "
                f"| {ratio(c.request_throughput, base.client.request_throughput)} |")
            means = " | ".join(fmt(t[k], 1.0, 3) for k in PARTS)
            parts.append(f"| {workload} | {r.mode} | {means} | {own_share(r)} "
                         f"| {r.load_average[0]:.1f} → {r.load_average[1]:.1f} |")
    notes = [RESTART_NOTE] if any(r.mode == "restart" for r in rows) else []
    parts_title = "TTFT parts (mean seconds, from the workers' histograms):"
    return "\n\n".join(["\n".join(lines), *notes, parts_title, "\n".join(parts)]) + "\n"
