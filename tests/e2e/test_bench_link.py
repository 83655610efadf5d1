"""`decode-worker bench --link` end to end on a tiny shape: each mode's deployment inside a private network
namespace whose loopback is shaped, KV over UCX TCP. Checks that the link carries what it was set to and that
the decode cache cuts the KV that crosses it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from decode_worker.bench.link import namespace_problem
from tests.conftest import save_random_checkpoint
from tests.tiny_model import save_tokenizer

RATE, RATE_GBIT = "100mbit", 0.1
SHAPE = "2x4"
PROBLEM = namespace_problem()

# ~30 s on 2 cores: two deployments of a small random model, in the default run as the only proof of the link
pytestmark = [pytest.mark.skipif(PROBLEM is not None, reason=f"no shaped link here: {PROBLEM}"),
              pytest.mark.slow]  # a benchmark run (~30 s); tests/unit/test_bench_link_parts.py checks its parts


def _wide_kv_model(path: Path) -> Path:
    """Random weights with 8 KB of float32 KV per token: a 320-token prompt's KV takes ~0.2 s at 100 Mbit/s, so
    the transfer, not the per-request overhead, sets the rate the bench measures."""
    vocab = save_tokenizer(path)
    save_random_checkpoint(path, "llama", vocab_size=vocab, hidden_size=256, intermediate_size=256,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                           max_position_embeddings=1024, tie_word_embeddings=True)
    return path


@pytest.fixture(scope="module")
def linked_run(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("bench_link")
    model = _wide_kv_model(root / "model")
    cmd = [sys.executable, "-m", "decode_worker.cli", "bench", "--link", RATE, "--model-path", str(model),
           "--dtype", "float32", "--modes", "off", "radix", "--shapes", SHAPE, "--prefix-len", "256",
           "--suffix-len", "64", "--output-len", "2", "--concurrency", "2", "--out", str(root / "out"),
           "--log-dir", str(root / "logs")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (root / "out" / "bench_link.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return json.loads(proc.stdout.splitlines()[-1])


def test_the_shaped_link_carries_its_configured_rate(linked_run):
    for row in linked_run["rows"]:
        assert row["link"] == RATE and row["link_gbit"] == pytest.approx(RATE_GBIT)
        assert row["tcp_probe_gbit"] == pytest.approx(RATE_GBIT, rel=0.2)
        assert row["kv_probe_gbit"] == pytest.approx(RATE_GBIT, rel=0.2)
        assert row["client"]["failed"] == 0, row["errors"]


def test_the_decode_cache_cuts_the_kv_crossing_the_link(linked_run):
    rows = {r["mode"]: r["workers"] for r in linked_run["rows"]}
    assert rows["off"]["hit_rate"]["total"] == 0 and rows["radix"]["hit_rate"]["total"] > 0
    assert rows["radix"]["kv_received_bytes"] < 0.8 * rows["off"]["kv_received_bytes"]
    assert rows["radix"]["kv_received_tokens"] < rows["off"]["kv_received_tokens"]
    assert {s["workload"] for s in linked_run["settings"]["savings"]} == {SHAPE}
