"""The PNG: hit rates per tier against the ceiling, TTFT per mode."""
from __future__ import annotations

import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path

from decode_worker.bench.runner import Row

TIER_COLOURS = {"device": "#1f77b4", "host": "#ff7f0e", "storage": "#2ca02c"}


def plot(rows: Sequence[Row], path: Path, title: str, column: Callable[[Row], str] = lambda r: r.workload) -> None:
    """A panel column per ``column(row)`` (workload or pod count), a bar per mode."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(column(r) for r in rows))
    fig, axes = plt.subplots(2, len(workloads), figsize=(4.2 * len(workloads), 7), squeeze=False)
    for col, workload in enumerate(workloads):
        group = [r for r in rows if column(r) == workload]
        x = range(len(group))
        hits, ttft = axes[0][col], axes[1][col]
        bottom = [0.0] * len(group)
        for tier, colour in TIER_COLOURS.items():
            values = [(r.workers.hit_rate or {}).get(tier, 0.0) for r in group]
            hits.bar(x, values, bottom=bottom, color=colour, label=f"L{list(TIER_COLOURS).index(tier) + 1} {tier}")
            bottom = [b + v for b, v in zip(bottom, values)]
        hits.scatter(x, [r.unbounded_hit_rate for r in group], marker="_", s=600, color="black", label="unbounded")
        hits.set(title=workload, ylim=(0, 1), ylabel="token hit rate" if col == 0 else None)
        p50 = [r.client.ttft_s["p50"] or 0.0 for r in group]
        p90 = [r.client.ttft_s["p90"] or 0.0 for r in group]
        ttft.bar(x, p50, color="#7f7f7f", yerr=[[0] * len(group), [b - a for a, b in zip(p50, p90)]], capsize=4)
        ttft.set(ylabel="TTFT p50, whisker p90 (s)" if col == 0 else None)
        for ax in (hits, ttft):
            ax.set_xticks(list(x), [r.mode for r in group], rotation=30)
    axes[0][0].legend(loc="upper left", fontsize=8)
    fig.suptitle(textwrap.fill(title, 40 * len(workloads)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_savings(rows: Sequence[Row], path: Path, title: str) -> None:
    """`bench --link`: hier's TTFT p50 saving per link rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from decode_worker.bench.link_report import REFERENCE_SAVING, savings

    found = savings(rows)
    probe = {r.link: r.kv_probe_gbit for r in rows}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, workload in enumerate(dict.fromkeys(s.workload for s in found)):
        points = sorted((s for s in found if s.workload == workload),
                        key=lambda s: s.link_gbit or probe.get(s.link) or float("inf"))
        x = [s.link_gbit or probe.get(s.link) or 0.0 for s in points]
        colour = f"C{i}"
        for attr, style, what in (("vs_radix", "-o", "hier vs radix"), ("vs_off", "--s", "hier vs off")):
            y = [(getattr(s, attr) or 0.0) * 100 for s in points]
            ax.plot(x, y, style, color=colour, label=f"{workload}: {what}")
        for s, xs in zip(points, x):
            if s.link_gbit is None:
                ax.annotate("same host", (xs, (s.vs_radix or 0.0) * 100), fontsize=7, textcoords="offset points",
                            xytext=(4, 4))
        if workload in REFERENCE_SAVING:
            ax.axhline(REFERENCE_SAVING[workload] * 100, color=colour, linestyle=":", linewidth=1,
                       label=f"{workload}: reference hier vs radix")
    ax.axhline(0, color="black", linewidth=0.5)
    ax.set(xscale="log", xlabel="link rate prefill -> decode (Gbit/s; same host: its KV probe's rate)",
           ylabel="TTFT p50 change (%)")
    ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(textwrap.fill(title, 90), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
