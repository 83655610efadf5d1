"""The pieces of `bench --link` that need no namespace: parsing rates, the rate check, the TTFT model's fit, the
decode worker's own share per request from its histogram."""
from __future__ import annotations

import pytest

from decode_worker.bench.link import Link, check_rate, parse_links
from decode_worker.bench.link_report import link_table
from decode_worker.bench.prom import Scrape
from decode_worker.bench.runner import Row
from decode_worker.bench.stats import ClientStats
from decode_worker.bench.timings import WorkerStats
from decode_worker.bench.ttft_model import fit_and_check
from decode_worker.metrics import Metrics


def test_rates_parse_and_bad_ones_are_named():
    assert parse_links("1gbit, 500mbit,local") == [Link("1gbit", 1e9), Link("500mbit", 5e8), Link("local", None)]
    with pytest.raises(ValueError, match="'1gb'"):
        parse_links("1gb")
    with pytest.raises(ValueError, match="twice"):
        parse_links("local,local")


def test_a_rate_off_by_more_than_a_fifth_fails_loudly():
    check_rate(Link("1gbit", 1e9), 0.85, "probe")
    check_rate(Link("local", None), 40.0, "probe")
    with pytest.raises(RuntimeError, match="-25% off the configured 1 Gbit/s"):
        check_rate(Link("1gbit", 1e9), 0.75, "probe")


def _row(mode: str, link: Link, hit: float, prefill_hit: float) -> Row:
    """A row whose TTFT follows 0.1 s + 1.2 x prefill compute + 3 x the ideal transfer exactly."""
    prompt, s_per_token, bpt = 100, 0.001, 1000.0
    compute = prompt * (1 - prefill_hit) * s_per_token
    ttft = 0.1 + 1.2 * compute + 3 * prompt * (1 - hit) * bpt * 8 / link.bits_per_s
    client = ClientStats(10, 0, 1.0, {"p50": ttft, "p90": ttft, "p99": ttft, "mean": ttft}, {}, {}, 1.0, 1.0)
    workers = WorkerStats({"device": hit, "host": 0.0, "storage": 0.0, "total": hit}, prefill_hit,
                          10 * prompt * (1 - hit) * bpt, 10 * prompt * (1 - hit), 0.0,
                          {"prefill_compute": compute})
    return Row("2x5", mode, client, workers, 0.5, (0.0, 0.0), [], link_gbit=link.gbit, link=link.name,
               kv_probe_gbit=link.gbit)


def test_the_model_recovers_its_own_parameters_and_round_trips_through_json():
    rows = []
    for link in (Link("1mbit", 1e6), Link("4mbit", 4e6)):
        for mode, hit, prefill_hit in (("off", 0.0, 0.3), ("radix", 0.4, 0.5), ("hier", 0.7, 0.6)):
            rows.append(_row(mode, link, hit, prefill_hit))
    fit = fit_and_check(rows, {"prefix_len": 80, "suffix_len": 20})
    assert (fit.fixed_s, fit.a, fit.k) == pytest.approx((0.1, 1.2, 3.0))
    assert all(abs(p.miss) < 1e-6 for p in fit.points)
    ref = {(e["workload"], e["gbit"]): e for e in fit.reference}
    assert ref["2x5", 100]["hier_vs_off"] < ref["2x5", 400]["hier_vs_off"] < 0
    assert Row.from_dict(rows[0].to_dict()) == rows[0]


def test_a_missing_tool_is_named_in_one_line(monkeypatch):
    import decode_worker.bench.link as link

    monkeypatch.setattr(link.shutil, "which", lambda tool: None if tool == "tc" else f"/usr/bin/{tool}")
    problem = link.namespace_problem()
    assert "`tc` is missing" in problem and "iproute2" in problem and "\n" not in problem


def test_decode_owns_p50_and_p99_come_from_its_histogram_per_request():
    """A run's own observations (the scrape after less the one before) give per-request quantiles within a bucket,
    and the link report shows them."""
    metrics = Metrics("m")
    metrics.decode_own.observe(30.0)  # before the run: must not count
    before = Scrape.parse(metrics.render().decode())
    own = [0.004 + 0.0002 * i for i in range(98)] + [0.25, 0.4]  # p50 ~ 14 ms, p99 in (0.2, 0.3]
    for seconds in own:
        metrics.decode_own.observe(seconds)
    run = Scrape.parse(metrics.render().decode()) - before
    stats = WorkerStats.of(None, run, None)
    assert stats.decode_own_s["p50"] == pytest.approx(0.0138, abs=0.0025)  # its bucket is (10, 15] ms
    assert 0.2 < stats.decode_own_s["p99"] <= 0.3
    assert stats.decode_own_s["mean"] == pytest.approx(sum(own) / len(own))
    assert Scrape().quantile("decode_worker_decode_own_seconds", 0.5) is None
    row = _row("hier", Link("1gbit", 1e9), 0.5, 0.5)
    row = Row(**{**row.__dict__, "workers": WorkerStats(**{**row.workers.__dict__, "decode_own_s": stats.decode_own_s,
                                                            "ttft_parts_s": {k: 0.1 for k in ("client", "router_and_http",
                                                            "prefill_queue", "prefill_compute", "kv_transfer",
                                                            "decode_queue", "decode_other")}})})
    md, _ = link_table([row], {"prefix_len": 80, "suffix_len": 20})
    p50, p99 = (f"{stats.decode_own_s[k]:.3f}" for k in ("p50", "p99"))
    assert "per request p50 / p99" in md and f"| {p50} / {p99} |" in md, md
    assert Row.from_dict(row.to_dict()) == row
