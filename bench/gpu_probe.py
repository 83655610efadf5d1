"""First-GPU-run probe: in about five minutes of GPU time, what the CPU tests cannot show. Prints one JSON line.

- ``gpu_tests``: the GPU-marked tests (``pytest -m gpu``).
- ``replay_churn``: CUDA-graph decode replay after allocator churn against the eager step (max |diff|).
- ``large_pool_copy``: the Triton page copy in a pool whose offsets pass 2^31 elements (exact or not).
- ``attention``: paged decode attention GB/s (K/V bytes read / time) at batch 1/64 x context 2K/8K, Llama-8B
  heads, bf16, against the GPU's peak bandwidth and a measured device copy: the one-pass kernel and the split-KV
  one side by side (with its split count, also at 32-token steps on 4 warps), and which the dispatcher picks.
- ``l1_l2``: page load-back and backup GB/s between an L1 pool and its registered L2 pool, against a plain
  pinned copy and the PCIe link's nominal rate.
- ``step_overhead``: per decode step at batch 64 (SmolLM2-shaped random model, CUDA graphs): host time to build
  the batch (through the persistent page-table rows: only new pages are sent) and launch, and the whole step
  with greedy and with top-p sampling; ``full_build_ms`` is the full page-table rebuild the rows replaced.
- ``l1_l2`` also times the cache's ``CopyEngine`` (chunked through its staging, registered once).
- ``sampling``: the batched sampler against the per-row one it replaced, batch 64/256, vocabulary 49152.

Without a CUDA device it prints ``{"gpu": false, ...}`` and exits 0.
Usage: python bench/gpu_probe.py [--skip-tests]
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9
# Llama-3-8B attention geometry
Q_HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16


def timed(fn: Callable[[], object], repeat: int = 20, warmup: int = 3) -> float:
    """Median seconds of ``fn`` on the device, measured with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def gpu_tests() -> dict:
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "tests/unit"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    lines = proc.stdout.strip().splitlines()
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    return {"rc": proc.returncode, "summary": lines[-1] if lines else proc.stderr[-300:], "failed": failed[:10]}


def peak_bandwidth_gbs() -> float | None:
    props = torch.cuda.get_device_properties(0)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    return 2 * clock_khz * 1e3 * bus_bits / 8 / GB if clock_khz and bus_bits else None


def device_copy_gbs() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() / timed(lambda: b.copy_(a)) / GB


def attention() -> dict:
    out = {"peak_gbs": peak_bandwidth_gbs(), "device_copy_gbs": round(device_copy_gbs(), 1)}
    for batch in (1, 64):
        for ctx in (2048, 8192):
            out[f"b{batch}_ctx{ctx}"] = attention_case(batch, ctx)
    return out


def attention_case(batch: int, ctx: int) -> dict:
    """One decode attention call over ``batch`` requests of ``ctx`` tokens on scattered pages, by each kernel."""
    from decode_worker_kernels import paged_attention, paged_attention_split

    pages = batch * ctx // PAGE
    k = torch.randn(pages, PAGE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    table = torch.randperm(pages, device="cuda").view(batch, ctx // PAGE)
    lens = torch.full((batch,), ctx, device="cuda")
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    args = (q, k, v, table, lens, HEAD_DIM**-0.5)
    splits = paged_attention_split.choose_num_splits(batch, KV_HEADS, ctx, paged_attention_split.sm_count(q.device))
    out: dict = {"num_splits": splits,
                 "dispatch": "split" if paged_attention_split.split_pays(q, k, table) else "one_pass"}
    split = paged_attention_split.paged_decode_attention_split
    for name, fn in (("one_pass", paged_attention.paged_decode_attention_triton), ("split", split),
                     ("split_bn32_w4", functools.partial(split, block_n=32, num_warps=4))):
        s = timed(lambda fn=fn: fn(*args))
        out[name] = {"us": round(s * 1e6, 1), "gbs": round(2 * k.numel() * k.element_size() / s / GB, 1)}
    return out


def large_pool_copy() -> dict:
    """Three layers ~1 GiB apart (a stride Triton passes as int32): layer 2's offsets pass 2^31."""
    from decode_worker_kernels import page_copy

    stride, pages, page_elems = (1 << 30) + (1 << 20), 8, PAGE * 8
    shape, strides = (3, 2, pages, PAGE, 1, 8), (stride, pages * page_elems, page_elems, 8, 8, 1)
    src = torch.randint(1, 255, (2 * stride + 2 * pages * page_elems,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    src_v, dst_v = src.as_strided(shape, strides), dst.as_strided(shape, strides)
    sp, dp = torch.tensor([7, 0, 3], device="cuda"), torch.tensor([1, 6, 2], device="cuda")
    page_copy.copy_pages_triton(src_v, dst_v, sp, dp)
    exact = bool(torch.equal(dst_v[:, :, dp], src_v[:, :, sp]))
    return {"exact": exact, "max_offset": src_v[2, 1, 7].data_ptr() - src_v.data_ptr()}


def replay_churn() -> dict:
    """Graph replay after allocator churn equals the eager step, batch sizes on and between buckets."""
    from decode_worker.model.forward_batch import ForwardBatch

    runner = make_runner(max_bs=64)
    eager = make_runner(max_bs=0, like=runner)
    worst = 0.0
    for bs in (1, 5, 16, 64):
        prompts = [[(7 * b + i) % 1000 for i in range(40 + b)] for b in range(bs)]
        pages = [list(range(1 + b * 8, 1 + b * 8 + 8)) for b in range(bs)]
        outs = []
        for r in (runner, eager):
            r.forward(r.build_batch(prompts, [0] * bs, pages))
            step: ForwardBatch = r.build_batch([[p[-1]] for p in prompts], [len(p) for p in prompts], pages)
            for n in range(1, 129):
                torch.full((n,), 10**6, dtype=torch.int64, device="cuda").add_(1)
            outs.append(r.forward(step).float().clone())
        worst = max(worst, (outs[0] - outs[1]).abs().max().item())
    return {"max_abs_diff": worst, "ok": worst < 5e-2}


def make_runner(max_bs: int, like=None, device: str = "cuda"):
    """A SmolLM2-135M-shaped random bf16 model (nothing to download), sharing weights with ``like``."""
    from decode_worker.model.config import ModelConfig
    from decode_worker.model.llama import LlamaModel
    from decode_worker.model.loader import LoadedModel, default_dtype
    from decode_worker.model.runner import ModelRunner

    if like is None:
        config = ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, 1e-5, 10000.0, 8192, True, name="probe")
        with torch.device(device), default_dtype(torch.bfloat16):
            model = LlamaModel(config).eval()
        loaded = LoadedModel(config, model, None, "probe")
    else:
        loaded = like.loaded
    return ModelRunner(loaded, max_total_tokens=64 * 1024, page_size=PAGE, cuda_graph_max_bs=max_bs)


def l1_l2() -> dict:
    from decode_worker_kernels import copy_pages

    from decode_worker.cache.pool import KVLayout, KVPool
    from decode_worker.cache.sizing import make_host_pool

    layout = KVLayout("probe", 32, KV_HEADS, HEAD_DIM, PAGE, torch.bfloat16)
    n = 256  # 2 MiB pages: 512 MiB a copy
    device_pool = KVPool(layout, n + 1, "cuda")
    host_pool = make_host_pool(layout, n + 1, device_pool)
    pages = torch.randperm(n)[: n // 2] + 1
    nbytes = pages.numel() * layout.page_bytes
    load = timed(lambda: copy_pages(host_pool.buffer, device_pool.buffer, pages, pages), repeat=5)
    backup = timed(lambda: copy_pages(device_pool.buffer, host_pool.buffer, pages, pages), repeat=5)
    flat = host_pool.buffer.view(-1)[: nbytes // 2]
    dev_flat = torch.empty_like(flat, device="cuda")
    plain = timed(lambda: dev_flat.copy_(flat, non_blocking=True), repeat=5)
    return {"pinned": host_pool.buffer.is_pinned(), "load_back_gbs": round(nbytes / load / GB, 1),
            "backup_gbs": round(nbytes / backup / GB, 1), "plain_pinned_h2d_gbs": round(nbytes / plain / GB, 1),
            "pcie_nominal_gbs": pcie_nominal_gbs(), **engine_gbs(device_pool, host_pool, pages)}


def engine_gbs(device_pool, host_pool, pages: torch.Tensor) -> dict:
    """The cache's own path: ``CopyEngine`` through its registered staging, wall time of each future."""
    from decode_worker.cache.copy_engine import CopyEngine

    engine = CopyEngine(device_pool.buffer, host_pool.buffer)
    nbytes = pages.numel() * device_pool.layout.page_bytes
    try:
        times = {}
        for name, copy in (("engine_load_back", engine.load), ("engine_backup", engine.backup)):
            copy(pages, pages).result(timeout=60)  # warm-up
            times[name] = statistics.median(wall(lambda: copy(pages, pages).result(timeout=60)) for _ in range(5))
        return {**{f"{k}_gbs": round(nbytes / t / GB, 1) for k, t in times.items()},
                "engine_staging_pinned": all(s.host.is_pinned() for s in engine.staging.slots)}
    finally:
        engine.close()


def wall(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def sampling(device: str = "cuda", batches: tuple[int, ...] = (64, 256), vocab: int = 49152, repeat: int = 10) -> dict:
    """The batched sampler against the per-row one it replaced (``bench/bench_sampling.py``): wall ms per call,
    read-back included (it is where the host waits)."""
    from decode_worker.model.sampler import sample

    spec = importlib.util.spec_from_file_location("bench_sampling", ROOT / "bench" / "bench_sampling.py")
    baseline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(baseline)

    out = {}
    for bs in batches:
        logits = torch.randn(bs, vocab, device=device) * 4
        for mode in ("greedy", "temperature", "top_k_top_p"):
            params, gens = [baseline.MODES[mode]] * bs, [None] * bs
            new, old = (min(wall(lambda f=f: f(logits, params, gens)) for _ in range(repeat))
                        for f in (sample, baseline.per_row_sample))
            out[f"b{bs}_{mode}"] = {"new_ms": round(new * 1e3, 2), "old_ms": round(old * 1e3, 2),
                                    "ratio": round(new / old, 3)}
    return out


def pcie_nominal_gbs() -> float | None:
    """Nominal one-way rate of the GPU's current PCIe link (per-lane GB/s after encoding, times width)."""
    query = ["nvidia-smi", "--query-gpu=pcie.link.gen.current,pcie.link.width.current", "--format=csv,noheader"]
    try:
        gen, width = (int(x) for x in subprocess.run(query, capture_output=True, text=True, check=False).stdout.split(","))
    except (OSError, ValueError):
        return None
    per_lane = {3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}.get(gen)
    return round(per_lane * width, 1) if per_lane else None


def step_overhead(batch: int = 64, steps: int = 30, context: int = 500, device: str = "cuda") -> dict:
    """Host time of a decode step (build the batch through the persistent page-table rows, launch the graph)
    against the whole step with sampling; and the full rebuild of every page the rows replaced, for comparison."""
    from decode_worker.core.sampling import SamplingParams
    from decode_worker.model.sampler import sample

    runner = make_runner(max_bs=batch, device=device)
    per_request = -(-(context + steps + 1) // PAGE)
    prompts = [[(3 * b + i) % 1000 for i in range(context)] for b in range(batch)]
    pages = [list(range(1 + b * per_request, 1 + (b + 1) * per_request)) for b in range(batch)]
    runner.forward(runner.build_batch(prompts, [0] * batch, pages))
    keys, tokens, gens = [f"probe{b}" for b in range(batch)], [1] * batch, [None] * batch
    out: dict = {"batch": batch, "context": context,
                 "full_build_ms": median_ms([wall(lambda i=i: runner.build_batch(
                     [[1]] * batch, [context + i] * batch, pages)) for i in range(steps)])}
    for name, p in (("greedy", SamplingParams(temperature=0)), ("top_p", SamplingParams(temperature=0.8, top_p=0.9))):
        build, launch, whole = [], [], []
        for i in range(steps):  # the same positions again for the second mode: its KV is rewritten alike
            t0 = time.perf_counter()
            fb = runner.build_decode(keys, tokens, [context + i] * batch, pages)
            t1 = time.perf_counter()
            logits = runner.forward(fb)
            t2 = time.perf_counter()
            sample(logits, [p] * batch, gens)
            t3 = time.perf_counter()
            build.append(t1 - t0), launch.append(t2 - t1), whole.append(t3 - t0)
        out[name] = {"build_ms": median_ms(build), "launch_ms": median_ms(launch), "step_ms": median_ms(whole)}
    return out


def median_ms(seconds: list[float]) -> float:
    """Median in ms, leaving out the first three (warm-up) steps."""
    return round(statistics.median(seconds[3:]) * 1e3, 3)


def section(name: str, fn: Callable[[], dict], report: dict) -> None:
    """Run one part; an error is reported in its place so the others still run."""
    start = time.monotonic()
    try:
        report[name] = fn()
    except Exception as exc:  # noqa: BLE001 - the probe reports, it does not stop
        report[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    report[name]["seconds"] = round(time.monotonic() - start, 1)
    torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-tests", action="store_true", help="skip the GPU-marked pytest run")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"gpu": False, "reason": "no CUDA device: nothing to probe"}))
        return 0
    report: dict = {"gpu": True, "device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    parts = {"large_pool_copy": large_pool_copy, "replay_churn": replay_churn, "attention": attention,
             "l1_l2": l1_l2, "step_overhead": step_overhead, "sampling": sampling}
    if not args.skip_tests:
        parts = {"gpu_tests": gpu_tests, **parts}
    for name, fn in parts.items():
        section(name, fn, report)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
