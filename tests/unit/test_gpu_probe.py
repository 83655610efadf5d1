"""``tests/gpu/gpu_probe.py``: every section runs here on CPU with tiny shapes (Triton under its interpreter) as it
would on a bare CUDA machine (the project not installed, none of the server stack importable), each writes one
JSON line, and a section that fails, crashes or hangs never stops the next."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = ROOT / "tests" / "gpu" / "gpu_probe.py"
spec = importlib.util.spec_from_file_location("gpu_probe", PROBE)
gpu_probe = sys.modules["gpu_probe"] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
spec.loader.exec_module(gpu_probe)

# A bare machine: none of the project's dependencies but torch, triton and numpy, and no install of the project
# (the editable install's finder is taken off sys.meta_path, so only PYTHONPATH finds decode_worker and the kernels).
BARE_SITECUSTOMIZE = '''
import sys

BLOCKED = {"gguf", "safetensors", "tokenizers", "transformers", "accelerate", "nixl_cu12", "nixl", "uvloop", "fastapi",
           "starlette", "uvicorn", "pydantic", "pydantic_core", "pydantic_settings", "prometheus_client", "httpx",
           "redis", "smg", "zmq", "msgpack", "jinja2"}


class BareMachine:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (a bare machine)", name=name)
        return None


sys.meta_path[:] = [BareMachine] + [f for f in sys.meta_path if "editable" not in str(getattr(f, "__module__", ""))]
'''


def run_probe(*args: str, env: dict[str, str] | None = None, timeout: int = 600) -> list[dict]:
    proc = subprocess.run([sys.executable, str(PROBE), *args], cwd=ROOT, env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines()]


BARE_RUN_IS_SLOW = pytest.mark.slow  # every section tiny on a simulated bare machine (~30 s)


@pytest.fixture(scope="module")
def bare_run(tmp_path_factory) -> dict[str, dict]:
    """Every section, tiny, on a simulated bare machine; lines by section, as written to --out."""
    folder = tmp_path_factory.mktemp("bare")
    (folder / "sitecustomize.py").write_text(BARE_SITECUSTOMIZE)
    out = folder / "probe.jsonl"
    printed = run_probe("--tiny", "--out", str(out), env={"PYTHONPATH": str(folder)})
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert written == printed
    assert [line["section"] for line in written] == [s.name for s in gpu_probe.SECTIONS]
    return {line["section"]: line for line in written}


@BARE_RUN_IS_SLOW
def test_bare_machine_env_names_what_is_missing(bare_run):
    env = bare_run["env"]
    assert env["status"] == "ok" and env["gpu"] is False
    assert env["kernels_from"] == str(ROOT / "kernels" / "decode_worker_kernels") and env["decode_worker_from"] == str(ROOT / "decode_worker")
    for name in ("pydantic", "fastapi", "gguf", "nixl_cu12", "transformers"):
        assert env["packages"][name].startswith("no: ModuleNotFoundError"), name


@BARE_RUN_IS_SLOW
@pytest.mark.parametrize("name", [s.name for s in gpu_probe.SECTIONS if s.name not in ("hf_parity", "nixl_vram")])
def test_section_passes_tiny_on_a_bare_machine(bare_run, name: str):
    line = bare_run[name]
    assert line["status"] == "ok", json.dumps(line)[:3000]


@BARE_RUN_IS_SLOW
def test_sections_without_their_package_say_why(bare_run):
    assert bare_run["hf_parity"]["status"] == "skipped" and "transformers" in bare_run["hf_parity"]["skipped"]
    assert bare_run["nixl_vram"]["status"] == "skipped" and "nixl_cu12 is not importable" in \
        bare_run["nixl_vram"]["skipped"]


@BARE_RUN_IS_SLOW
def test_tiny_sections_check_what_they_claim(bare_run):
    kernels = bare_run["kernel_parity"]
    assert kernels["attention_float32"]["g2"]["ok"] and kernels["large_pool_copy"]["exact"]
    replay = bare_run["graph_replay"]
    assert [replay[f"batch_{b}"]["replayed"] for b in (1, 5, 8, 9)] == [True, True, True, False]  # 9: past the graphs
    assert "skipped" in bare_run["gpu_tests"]["summary"] and bare_run["gpu_tests"]["rc"] == 0  # collected, no GPU


@pytest.mark.slow  # ~17 s (transformers and NIXL in child processes); the GPU machine's own run is what it prepares for
def test_sections_with_their_packages_run():
    """With transformers, the tiny checkpoint matches it; with NIXL, a read between two processes (DRAM on CPU)
    lands the owner's bytes exactly."""
    hf, nixl = run_probe("--tiny", "--only", "hf_parity,nixl_vram")
    assert hf["status"] == "ok" and hf["argmax_agree"], hf
    assert nixl["status"] == "ok" and nixl["exact"] and nixl["mem"] == "DRAM", nixl


def test_without_a_gpu_every_section_after_env_is_skipped():
    lines = run_probe("--only", "env,kernel_parity,attention", env={"CUDA_VISIBLE_DEVICES": ""})
    assert lines[0]["gpu"] is False
    assert [(line["status"], line.get("reason")) for line in lines[1:]] == [("skipped", "no CUDA device")] * 2


def test_a_hanging_or_crashing_section_still_writes_its_line():
    section = gpu_probe.BY_NAME["env"]
    hung = gpu_probe.run_child(section, tiny=True, limit_s=0.2)
    assert hung["status"] == "timeout" and "0 s limit" in hung["error"]
    crashed = gpu_probe.run_child(gpu_probe.Section("env", "memory", 30, env={"PYTHONHOME": "/nonexistent"}),
                                  tiny=True, limit_s=30)
    assert crashed["status"] == "crashed" and crashed["stderr_tail"]
    broken = gpu_probe.run_here(gpu_probe.Section("broken", "no_such_module", 30), tiny=True)
    assert broken["status"] == "error" and "ModuleNotFoundError" in broken["error"]


def test_one_failing_section_does_not_stop_the_next_and_the_budget_skips_with_a_line(monkeypatch, tmp_path):
    monkeypatch.setitem(gpu_probe.BY_NAME, "kernel_parity", gpu_probe.Section("kernel_parity", "kernels", 0))
    out = tmp_path / "probe.jsonl"
    lines = gpu_probe.probe(["kernel_parity", "env"], tiny=True, budget_s=300, out=out)
    assert [line["status"] for line in lines] == ["timeout", "ok"]
    lines = gpu_probe.probe(["env", "attention"], tiny=True, budget_s=1, out=out)
    assert lines[1]["status"] == "skipped" and "budget" in lines[1]["reason"]
    assert len(out.read_text().splitlines()) == 2
