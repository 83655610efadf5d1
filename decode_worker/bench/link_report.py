"""The tables of a `bench --link` run, with the TTFT model's check."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from decode_worker.bench.report import fmt, hits, own_share
from decode_worker.bench.runner import Row
from decode_worker.bench.ttft_model import fit_and_check, model_tables

# The reference (SGLang decode HiCache on Qwen3-32B, H200s): TTFT change of hier against radix-only.
REFERENCE_SAVING = {"10x50": -0.41, "50x10": -0.26}


@dataclass(frozen=True)
class Saving:
    workload: str
    link: str
    link_gbit: float | None
    vs_radix: float | None  # hier's TTFT p50 over radix's, less one
    vs_off: float | None


def _p50(rows: Sequence[Row], mode: str) -> float | None:
    return next((r.client.ttft_s["p50"] for r in rows if r.mode == mode), None)


def _change(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b - 1


def savings(rows: Sequence[Row]) -> list[Saving]:
    out = []
    for workload in dict.fromkeys(r.workload for r in rows):
        for link in dict.fromkeys(r.link for r in rows if r.workload == workload):
            group = [r for r in rows if r.workload == workload and r.link == link]
            hier = _p50(group, "hier")
            out.append(Saving(workload, link, group[0].link_gbit, _change(hier, _p50(group, "radix")),
                              _change(hier, _p50(group, "off"))))
    return out


def pct(x: float | None) -> str:
    return "–" if x is None else f"{x:+.0%}"


def _gbit(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def _rows_table(rows: Sequence[Row]) -> str:
    head = ("| workload | link | mode | configured / TCP / KV probe (Gbit/s) | decode hit L1 / L2 / L3 = total "
            "| prefill hit | KV received (MB) | TTFT p50 / p90 / p99 (s) | req/s | out tok/s | TTFT p50 vs radix "
            "| vs off |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        group = [g for g in rows if g.workload == r.workload and g.link == r.link]
        c, w = r.client, r.workers
        failed = f" ({c.failed} failed)" if c.failed else ""
        lines.append(
            f"| {r.workload} | {r.link} | {r.mode}{failed} "
            f"| {_gbit(r.link_gbit)} / {_gbit(r.tcp_probe_gbit)} / {_gbit(r.kv_probe_gbit)} | {hits(r)} "
            f"| {fmt(w.prefill_hit_rate, 100, 0)}% | {fmt(w.kv_received_bytes, 1e-6, 1)} "
            f"| {fmt(c.ttft_s['p50'])} / {fmt(c.ttft_s['p90'])} / {fmt(c.ttft_s['p99'])} "
            f"| {c.request_throughput:.2f} | {c.output_throughput:.1f} "
            f"| {pct(_change(c.ttft_s['p50'], _p50(group, 'radix')))} "
            f"| {pct(_change(c.ttft_s['p50'], _p50(group, 'off')))} |")
    return "\n".join(lines)


PARTS = ("client", "router_and_http", "prefill_queue", "prefill_compute", "kv_transfer", "decode_queue",
         "decode_other")


def _parts_table(rows: Sequence[Row]) -> str:
    head = ("| workload | link | mode | client TTFT | router + HTTP | prefill queue | prefill compute | KV transfer "
            "| decode queue (alongside prefill) | decode worker's own share (mean) "
            "| decode's own, per request p50 / p99 | load avg start → end |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        means = " | ".join(fmt(r.workers.ttft_parts_s[k], 1.0, 3) for k in PARTS)
        lines.append(f"| {r.workload} | {r.link} | {r.mode} | {means} | {own_share(r)} "
                     f"| {r.load_average[0]:.1f} → {r.load_average[1]:.1f} |")
    return "\n".join(lines)


def _savings_table(found: list[Saving]) -> str:
    head = "| workload | link | hier vs radix (TTFT p50) | hier vs off | reference, hier vs radix |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in found:
        lines.append(f"| {s.workload} | {s.link} | **{pct(s.vs_radix)}** | {pct(s.vs_off)} "
                     f"| {pct(REFERENCE_SAVING.get(s.workload))} |")
    return "\n".join(lines)


OWN_SHARE_NOTE = ("The decode worker's own share (mean) is its TTFT less prefill's (queue and compute) and the KV "
                  "transfer: the handshake round trip, admission, the wait for the running step and bookkeeping. "
                  "Its per-request p50 / p99 come from decode_worker_decode_own_seconds, timed on each PD request "
                  "from prefill's answer arriving to the first token leaving, less the KV read (so without the "
                  "answer's trip from prefill), read from the histogram's buckets as histogram_quantile does.")


def _in_order(rows: Sequence[Row]) -> list[Row]:
    """By workload, link, then mode, each in first-met order."""
    order = [{v: i for i, v in enumerate(dict.fromkeys(getattr(r, k) for r in rows))}
             for k in ("workload", "link", "mode")]
    return sorted(rows, key=lambda r: tuple(o[getattr(r, k)] for o, k in zip(order, ("workload", "link", "mode"))))


def link_table(rows: Sequence[Row], settings: dict) -> tuple[str, dict]:
    """The Markdown, and the JSON's extra settings (savings, TTFT model)."""
    rows = _in_order(rows)
    found = savings(rows)
    model = fit_and_check(rows, settings)
    md = "\n\n".join([
        _rows_table(rows),
        "TTFT p50 saving of hier (L1 + L2):",
        _savings_table(found),
        "TTFT parts (mean seconds, from the workers' histograms):",
        _parts_table(rows),
        OWN_SHARE_NOTE,
        *model_tables(model),
    ]) + "\n"
    return md, {"savings": [s.__dict__ for s in found], "ttft_model": model.to_dict() if model else None}
