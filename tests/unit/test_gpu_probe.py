"""``bench/gpu_probe.py`` exits cleanly with one JSON line where there is no GPU."""
from __future__ import annotations

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
