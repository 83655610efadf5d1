"""First-GPU-run probe: what the CPU tests cannot show, in one short run on a bare CUDA machine.

    timeout 540 python3 tests/gpu/gpu_probe.py --out DIR/probe.jsonl

Each section runs in its own process with its own time limit and writes one JSON line (``section``, ``status``:
ok | failed | error | crashed | timeout | skipped, its figures, ``seconds``), so a section that fails, hangs or
poisons its CUDA context never stops the next; lines are written as sections end, so a run cut short keeps what
it measured. The sections (in ``tests/gpu/probe/``, in this order, the whole run within ``--budget-s``):

- ``env``: Python, torch, the device, which optional packages import (NIXL says why when it does not).
- ``kernel_parity``: every Triton kernel against its torch reference at serving geometries, fp32 and bf16, a
  zero-length request in each attention batch, and a page copy whose offsets pass 2^31 elements.
- ``graph_replay``: CUDA-graph decode replay against the eager step at batch 1/5/64/65/256 (fp32, same kernels).
- ``attention``: decode attention GB/s at batch 1/64 x context 2K/8K (Llama-8B heads, bf16) against the device's
  peak bandwidth and a device copy; the dispatcher's kernel and the alternatives.
- ``decode_throughput``: tokens/s at batch 1/64/256 of a 1B-shaped random model in a KV pool sized from free memory.
- ``l1_l2``: L1<->L2 page copies GB/s against ``cudaMemcpyAsync`` of the same bytes.
- ``hf_parity``: a random-weight Llama-8B-shaped model of 2 layers saved as a Hugging Face checkpoint, against
  transformers (skipped, saying so, without transformers).
- ``graph_replay_debug``: ``graph_replay`` again under ``CUDA_LAUNCH_BLOCKING=1``, so a fault names its kernel.
- ``step_overhead``, ``sampling``: host time per decode step; the batched sampler against the per-row one.
- ``nixl_vram``: a VRAM-to-VRAM NIXL read between two processes (skipped, saying why, without NIXL).
- ``gpu_tests``: ``pytest tests/gpu`` (they import only torch, triton and numpy).

It needs only torch, triton and numpy: it puts this checkout and its kernels' source root (``kernels/``) first
on its sections' ``PYTHONPATH``. ``--tiny`` runs every section on CPU with tiny shapes and
Triton's interpreter (the CPU test of the sections). Without a CUDA device (and without ``--tiny``) every section
after ``env`` is skipped, saying so.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent  # the sections import as probe.<module> from here
ROOT = HERE.parents[1]  # the repository
MIN_SECTION_S = 20  # a section is not started with less of the budget left


@dataclass(frozen=True)
class Section:
    name: str
    module: str  # in tests/gpu/probe/
    limit_s: int
    function: str = ""  # default: the section's name
    env: dict[str, str] = field(default_factory=dict)


SECTIONS = [
    Section("env", "memory", 60),
    Section("kernel_parity", "kernels", 120),
    Section("graph_replay", "model", 120),
    Section("attention", "kernels", 90),
    Section("decode_throughput", "model", 120),
    Section("l1_l2", "memory", 90),
    Section("hf_parity", "model", 150),
    Section("graph_replay_debug", "model", 150, "graph_replay", {"CUDA_LAUNCH_BLOCKING": "1"}),
    Section("step_overhead", "model", 60),
    Section("sampling", "model", 60),
    Section("nixl_vram", "nixl", 90),
    Section("gpu_tests", "suite", 180),
]
BY_NAME = {s.name: s for s in SECTIONS}


def run_here(section: Section, tiny: bool) -> dict:
    """Child side: run one section in this process; any exception becomes an ``error`` line."""
    import importlib

    sys.path.insert(0, str(HERE))
    start = time.monotonic()
    try:
        module = importlib.import_module(f"probe.{section.module}")
        result = getattr(module, section.function or section.name)(tiny)
        status = "skipped" if "skipped" in result else "failed" if result.get("ok") is False else "ok"
    except Exception as exc:  # noqa: BLE001 - the probe reports, it does not stop
        result = {"error": f"{type(exc).__name__}: {exc}"[:1000], "traceback": traceback.format_exc()[-3000:]}
        status = "error"
    return {"section": section.name, "status": status, **result, "seconds": round(time.monotonic() - start, 1)}


def child_env(section: Section, tiny: bool) -> dict[str, str]:
    env = {**os.environ, **section.env, "PYTHONUNBUFFERED": "1"}
    paths = (str(ROOT), str(ROOT / "kernels"), os.environ.get("PYTHONPATH"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    if tiny:
        env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    return env


def run_child(section: Section, tiny: bool, limit_s: float) -> dict:
    """Parent side: one section in its own process group, killed whole at ``limit_s``; whatever happens, a line."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--section", section.name] + (["--tiny"] if tiny else [])
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(section, tiny), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=limit_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        timed_out = True
    seconds = round(time.monotonic() - start, 1)
    if not timed_out:
        for line in reversed(stdout.splitlines()):  # the section's line is its last; libraries may log before it
            if line.startswith('{"section"'):
                return json.loads(line)
    status = "timeout" if timed_out else "crashed"
    why = f"killed after its {limit_s:.0f} s limit" if timed_out else f"exited {proc.returncode} without a result"
    return {"section": section.name, "status": status, "error": why, "stderr_tail": stderr[-3000:],
            "seconds": seconds}


def probe(names: list[str], tiny: bool, budget_s: float, out: Path | None) -> list[dict]:
    """Run ``names`` in order within ``budget_s``, writing each line to ``out`` (and stdout) as it ends."""
    deadline = time.monotonic() + budget_s
    sink = out.open("w") if out else None
    results: list[dict] = []
    gpu = True
    try:
        for name in names:
            section, left = BY_NAME[name], deadline - time.monotonic()
            if not gpu and not tiny:
                line = {"section": name, "status": "skipped", "reason": "no CUDA device", "seconds": 0}
            elif left < MIN_SECTION_S and name != "env":
                line = {"section": name, "status": "skipped", "reason": f"probe budget spent ({left:.0f} s left)",
                        "seconds": 0}
            else:
                line = run_child(section, tiny, max(1.0, min(section.limit_s, left)))
            if name == "env":
                gpu = line.get("gpu") is not False  # an env section that broke does not prove there is no GPU
            results.append(line)
            text = json.dumps(line)
            print(text, flush=True)
            if sink:
                sink.write(text + "\n")
                sink.flush()
    finally:
        if sink:
            sink.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="JSON lines file, one line per section (also printed)")
    parser.add_argument("--only", help="comma-separated sections to run, in the probe's order")
    parser.add_argument("--skip", default="", help="comma-separated sections to leave out")
    parser.add_argument("--budget-s", type=float, default=480.0, help="the whole run's time (default 8 minutes)")
    parser.add_argument("--tiny", action="store_true", help="CPU, tiny shapes, Triton's interpreter (tests)")
    parser.add_argument("--section", help=argparse.SUPPRESS)  # child side: run this one section here
    args = parser.parse_args(argv)
    if args.section:
        print(json.dumps(run_here(BY_NAME[args.section], args.tiny), default=str), flush=True)
        return 0
    wanted = set(args.only.split(",")) if args.only else set(BY_NAME)
    unknown = (wanted | set(filter(None, args.skip.split(",")))) - set(BY_NAME)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; the sections are {', '.join(BY_NAME)}")
    names = [s.name for s in SECTIONS if s.name in wanted and s.name not in args.skip.split(",")]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    results = probe(names, args.tiny, args.budget_s, args.out)
    print(", ".join(f"{r['section']}: {r['status']}" for r in results), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
