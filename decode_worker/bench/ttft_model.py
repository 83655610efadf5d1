"""docs/ttft-model.md's TTFT model: fitted on a `bench --link` run, applied to the reference."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

TOLERANCE = 0.15


@dataclass(frozen=True)
class Deployment:
    """What the model needs of a deployment besides hit rates."""

    name: str
    prompt_tokens: int
    kv_bytes_per_token: float
    prefill_s_per_token: float


# Qwen3-32B: 64 layers x 8 KV heads x 128 dims x K and V x 2 bytes (bfloat16). Prefill on one H200: ~105 GFLOP per
# suffix token at a 16K-token context (65.6 in the weights, ~39 in attention) at ~45% of 989 dense TFLOP/s.
REFERENCE = Deployment("Qwen3-32B on H200, 16384 + 4608 tokens", 16384 + 4608, 64 * 8 * 128 * 2 * 2, 1 / 4000)
REFERENCE_GBIT = (100, 200, 400)


@dataclass(frozen=True)
class Point:
    workload: str
    link: str
    mode: str
    measured_s: float
    predicted_s: float

    @property
    def miss(self) -> float:
        return self.predicted_s / self.measured_s - 1


@dataclass(frozen=True)
class Fit:
    fixed_s: float
    a: float
    k: float
    prefill_s_per_token: float
    kv_bytes_per_token: float
    points: list[Point]
    reference: list[dict]  # per workload and link rate: predicted TTFT per mode and hier's saving

    def to_dict(self) -> dict:
        return asdict(self) | {"tolerance": TOLERANCE}


def _terms(prompt: float, prefill_hit: float, decode_hit: float, s_per_token: float, bytes_per_token: float,
           gbit: float) -> tuple[float, float]:
    """Prefill compute seconds and ideal transfer seconds of one request."""
    return (prompt * (1 - prefill_hit) * s_per_token,
            prompt * (1 - decode_hit) * bytes_per_token * 8 / (gbit * 1e9))


def _usable(r) -> bool:
    w = r.workers
    return (r.client.ttft_s["mean"] is not None and w.hit_rate is not None and w.prefill_hit_rate is not None
            and w.kv_received_tokens and w.ttft_parts_s.get("prefill_compute") is not None
            and (r.link_gbit or r.kv_probe_gbit))


def fit_and_check(rows: Sequence, settings: dict) -> Fit | None:
    """The fit over a `bench --link` run's ``rows``; None with too few usable rows."""
    rows = [r for r in rows if _usable(r)]
    if len(rows) < 4:
        return None
    prompt = settings["prefix_len"] + settings["suffix_len"]
    computed = [prompt * (1 - r.workers.prefill_hit_rate) for r in rows]
    s_per_token = sum(r.workers.ttft_parts_s["prefill_compute"] for r in rows) / sum(computed)
    bytes_per_token = (sum(r.workers.kv_received_bytes for r in rows)
                       / sum(r.workers.kv_received_tokens for r in rows))
    terms = [_terms(prompt, r.workers.prefill_hit_rate, r.workers.hit_rate["total"], s_per_token, bytes_per_token,
                    r.link_gbit or r.kv_probe_gbit) for r in rows]
    x = np.array([[1.0, p, t] for p, t in terms])
    y = np.array([r.client.ttft_s["mean"] for r in rows])
    (fixed, a, k), *_ = np.linalg.lstsq(x, y, rcond=None)
    points = [Point(r.workload, r.link, r.mode, float(m), float(p))
              for r, m, p in zip(rows, y, x @ np.array([fixed, a, k]))]
    fit = Fit(float(fixed), float(a), float(k), s_per_token, bytes_per_token, points, [])
    return Fit(**{**fit.__dict__, "reference": _reference(fit, rows)})


def _reference(fit: Fit, rows: Sequence) -> list[dict]:
    """The reference's TTFT per mode and link rate, with hit rates from this run's slowest shaped link."""
    out = []
    ref = REFERENCE
    for workload in dict.fromkeys(r.workload for r in rows):
        group = [r for r in rows if r.workload == workload]
        slowest = min((r.link_gbit or float("inf")) for r in group)
        group = [r for r in group if (r.link_gbit or float("inf")) == slowest]
        for gbit in REFERENCE_GBIT:
            ttft = {}
            for r in group:
                p, t = _terms(ref.prompt_tokens, r.workers.prefill_hit_rate, r.workers.hit_rate["total"],
                              ref.prefill_s_per_token, ref.kv_bytes_per_token, gbit)
                ttft[r.mode] = fit.a * p + fit.k * t  # the fixed part is this host's, not the reference's
            hier = ttft.get("hier")
            out.append({"workload": workload, "gbit": gbit, "ttft_s": ttft,
                        "hier_vs_radix": hier / ttft["radix"] - 1 if hier and ttft.get("radix") else None,
                        "hier_vs_off": hier / ttft["off"] - 1 if hier and ttft.get("off") else None})
    return out


def model_tables(fit: Fit | None) -> list[str]:
    """Markdown: the fit, its check per row, and the reference's predicted saving."""
    if fit is None:
        return ["TTFT model: not fitted (fewer than four rows with both workers' metrics)."]
    within = sum(abs(p.miss) <= TOLERANCE for p in fit.points)
    head = (f"TTFT model: fixed {fit.fixed_s * 1e3:.0f} ms + {fit.a:.2f} x prefill compute "
            f"({fit.prefill_s_per_token * 1e6:.0f} µs per computed token) + {fit.k:.2f} x KV bytes / link rate "
            f"({fit.kv_bytes_per_token:.0f} bytes per token). Mean TTFT, measured against predicted: "
            f"{within} of {len(fit.points)} rows within {TOLERANCE:.0%}.")
    check = ["| workload | link | mode | measured (s) | predicted (s) | miss |", "|---|---|---|---|---|---|"]
    for p in fit.points:
        flag = "" if abs(p.miss) <= TOLERANCE else " **(over 15%)**"
        check.append(f"| {p.workload} | {p.link} | {p.mode} | {p.measured_s:.3f} | {p.predicted_s:.3f} "
                     f"| {p.miss:+.0%}{flag} |")
    ref = [f"Predicted for the reference ({REFERENCE.name}, {REFERENCE.kv_bytes_per_token / 1024:.0f} KiB of KV "
           f"per token, prefill {1 / REFERENCE.prefill_s_per_token:.0f} tokens/s), with this run's hit rates:\n",
           "| workload | link | TTFT off / radix / hier (s) | hier vs radix | hier vs off |", "|---|---|---|---|---|"]
    for e in fit.reference:
        t = e["ttft_s"]
        modes = " / ".join(f"{t[m]:.2f}" if m in t else "–" for m in ("off", "radix", "hier"))
        vs = [f"{v:+.0%}" if v is not None else "–" for v in (e["hier_vs_radix"], e["hier_vs_off"])]
        ref.append(f"| {e['workload']} | {e['gbit']} Gbit/s | {modes} | {vs[0]} | {vs[1]} |")
    return [head, "\n".join(check), "\n".join(ref)]
