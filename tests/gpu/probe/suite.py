"""The ``gpu_tests`` section: ``pytest tests/gpu``, the GPU-only tests, which import only torch, triton and numpy."""
from __future__ import annotations

import importlib.util
import subprocess
import sys

from probe.common import ROOT


def gpu_tests(tiny: bool) -> dict:
    """Tiny: the same run on CPU, where every test skips; it shows the folder collects without the server stack."""
    if importlib.util.find_spec("pytest") is None:
        return {"skipped": "pytest is not importable"}
    cmd = [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-p", "no:cacheprovider", "-o", "addopts="]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    lines = proc.stdout.strip().splitlines()
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    return {"rc": proc.returncode, "summary": lines[-1] if lines else proc.stderr[-500:], "failed": failed[:20],
            "ok": proc.returncode == 0}
