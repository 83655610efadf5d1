"""`decode-worker bench` end to end on a tiny shape: real deployments (smg, prefill, decode) of the
tiny random model, started by the command itself, one per mode."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny_model import save_tiny_chat_model

MODES = ["off", "hier"]
SHAPE, CHAT = "2x4", "2x2"


pytestmark = pytest.mark.slow  # a benchmark run (~15 s); the bench's own parts have unit tests

@pytest.fixture(scope="module")
def bench_run(tmp_path_factory) -> tuple[dict, Path]:
    root = tmp_path_factory.mktemp("bench")
    model = save_tiny_chat_model(root / "model")
    cmd = [sys.executable, "-m", "decode_worker.cli", "bench", "--model-path", str(model), "--dtype", "float32",
           "--modes", *MODES, "--shapes", SHAPE, "--chat", CHAT, "--prefix-len", "32", "--suffix-len", "16",
           "--output-len", "3", "--chat-first-len", "32", "--chat-turn-len", "8", "--concurrency", "2",
           "--out", str(root / "out"), "--log-dir", str(root / "logs")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout  # stdout is the JSON line alone: the table and progress go to stderr
    return json.loads(lines[0]), root / "out"


def test_json_line_has_every_figure(bench_run):
    result, _ = bench_run
    rows = {(r["workload"], r["mode"]): r for r in result["rows"]}
    assert set(rows) == {(w, m) for w in (SHAPE, f"chat {CHAT}") for m in MODES}
    for (workload, _), row in rows.items():
        client, workers = row["client"], row["workers"]
        assert client["requests"] == (8 if workload == SHAPE else 4) and client["failed"] == 0, row["errors"]
        for dist in ("ttft_s", "itl_s", "e2e_s"):
            assert 0 < client[dist]["p50"] <= client[dist]["p90"] <= client[dist]["p99"]
        assert client["request_throughput"] > 0 and client["output_throughput"] > 0
        assert set(workers["hit_rate"]) == {"device", "host", "storage", "total"}
        assert workers["hit_rate"]["total"] <= row["unbounded_hit_rate"] + 1e-9
        assert 0 < row["unbounded_hit_rate"] < 1
        assert workers["kv_received_bytes"] > 0
        parts = workers["ttft_parts_s"]
        assert all(parts[k] is not None for k in ("client", "prefill_queue", "prefill_compute", "kv_transfer",
                                                  "decode_other", "decode_queue"))
    assert result["machine"]["cores"] and result["missing_timings"]


def test_hierarchical_cache_receives_less_kv_than_no_cache(bench_run):
    result, _ = bench_run
    rows = {(r["workload"], r["mode"]): r for r in result["rows"]}
    for workload in (SHAPE, f"chat {CHAT}"):
        off, hier = rows[workload, "off"]["workers"], rows[workload, "hier"]["workers"]
        assert off["hit_rate"]["total"] == 0 and hier["hit_rate"]["total"] > 0
        assert hier["kv_received_bytes"] < off["kv_received_bytes"]


def test_table_and_plot_are_written(bench_run):
    result, out = bench_run
    assert json.loads((out / "bench.json").read_text()) == result
    table = (out / "bench.md").read_text()
    assert f"| {SHAPE} | hier |" in table and "TTFT parts" in table
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
