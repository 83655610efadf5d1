"""A checkout imports as an installed project does: no top-level name under the repository root shadows an
installed distribution (pytest, `python -m` and `PYTHONPATH=.` put the root first on ``sys.path``), and the test
session starts from an empty product cache, as a first-time user does."""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

from decode_worker.model.embedded import GGUF_NAME, cache_dir

ROOT = Path(__file__).resolve().parents[2]
OURS = "decode-worker"


def root_import_names() -> set[str]:
    """What `import NAME` can find at the root: modules, packages, and folders holding modules directly."""
    names = set()
    for entry in ROOT.iterdir():
        if entry.name.startswith("."):
            continue
        if entry.suffix == ".py" or entry.name.endswith(".so"):
            names.add(entry.name.split(".")[0])
        elif entry.is_dir() and any(child.suffix == ".py" for child in entry.iterdir()):
            names.add(entry.name)
    return names


def test_no_root_name_is_a_distributions_top_level_name():
    provided = importlib.metadata.packages_distributions()
    names = root_import_names()
    assert {"decode_worker", "tests"} <= names
    clashes = {name: provided[name] for name in names if set(provided.get(name, [OURS])) != {OURS}}
    assert not clashes, f"root names that installed distributions also provide: {clashes}"


def test_transformers_converts_a_gguf_tokenizer_with_the_root_first_on_sys_path(smollm2_path, tmp_path):
    """The path a first start takes (no converted tokenizer cached yet), from the root as `python -m` runs it."""
    script = ("from decode_worker.model.tokenizer import Tokenizer; import sys; "
              "print(Tokenizer.load(__import__('pathlib').Path(sys.argv[1]), ()).encode('Hello'))")
    env = {**os.environ, "DECODE_WORKER_CACHE": str(tmp_path), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", script, str(smollm2_path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().startswith("[") and (tmp_path / "tokenizers").is_dir()


def test_the_session_cache_starts_empty_and_apart_from_home():
    """conftest gives the session a new cache folder: nothing an earlier run left in the home folder is read."""
    folder = cache_dir()
    assert folder != Path.home() / ".cache" / "decode-worker" and folder.name.startswith("decode-worker-cache-")
    model = folder / "models" / GGUF_NAME
    assert [p.name for p in (folder / "models").iterdir()] == [model.name] and model.is_symlink()
