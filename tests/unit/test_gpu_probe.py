"""``bench/gpu_probe.py`` exits cleanly with one JSON line where there is no GPU."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

PROBE = Path(__file__).resolve().parents[2] / "bench" / "gpu_probe.py"


def test_probe_without_a_gpu_says_so():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(PROBE)], env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    report = json.loads(lines[0])
    assert report["gpu"] is False and "no CUDA device" in report["reason"]


def test_sampling_section_runs_on_any_device():
    """The part added with the batched sampler, run small on CPU: its baseline loads by path as on the GPU."""
    spec = importlib.util.spec_from_file_location("gpu_probe", PROBE)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    report = probe.sampling(device="cpu", batches=(4,), vocab=500, repeat=2)
    assert set(report) == {"b4_greedy", "b4_temperature", "b4_top_k_top_p"}
    assert all(case["new_ms"] > 0 and case["old_ms"] > 0 and case["ratio"] > 0 for case in report.values())
