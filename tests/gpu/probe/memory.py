"""Memory sections: what the machine is (``env``) and L1<->L2 page copies against a plain ``cudaMemcpyAsync`` of
the same bytes (``l1_l2``)."""
from __future__ import annotations

import contextlib
import importlib
import os
import platform
import statistics
import subprocess

import torch

from probe.common import GB, device_of, synchronize, wall

OPTIONAL = ("numpy", "triton", "transformers", "safetensors", "pytest", "nixl_cu12", "pydantic", "fastapi", "gguf")


def importable(name: str) -> str:
    """The module's version (or "yes"), or why it does not import."""
    try:
        module = importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - a broken install is reported, not raised
        return f"no: {type(exc).__name__}: {exc}"[:200]
    return str(getattr(module, "__version__", "yes"))


def env(tiny: bool) -> dict:
    """Python, torch, the device, which optional packages import (NIXL's line says why when it does not), and where
    ``decode_worker`` and its kernels were imported from (an installed project or the checkout)."""
    out: dict = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                 "gpu": torch.cuda.is_available(), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                 "triton_interpret": os.environ.get("TRITON_INTERPRET"),
                 "decode_worker_from": imported_from("decode_worker"),
                 "kernels_from": imported_from("decode_worker_kernels"),
                 "packages": {name: importable(name) for name in OPTIONAL}}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        out.update(device=props.name, capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                   memory_gb=round(total / 1e9, 1), free_gb=round(free / 1e9, 1), pcie_nominal_gbs=pcie_nominal_gbs(),
                   driver=nvidia_smi("driver_version"))
    return out


def imported_from(name: str) -> str:
    """The folder a package was imported from, or why it does not import."""
    try:
        return os.path.dirname(importlib.import_module(name).__file__)
    except Exception as exc:  # noqa: BLE001 - reported, and every later section will say more
        return f"no: {type(exc).__name__}: {exc}"[:300]


def nvidia_smi(field: str) -> str | None:
    try:
        proc = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout.strip() else None


def pcie_nominal_gbs() -> float | None:
    """Nominal one-way rate of the GPU's current PCIe link (per-lane GB/s after encoding, times width)."""
    try:
        gen, width = (int(x) for x in (nvidia_smi("pcie.link.gen.current,pcie.link.width.current") or "").split(","))
    except ValueError:
        return None
    per_lane = {3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}.get(gen)
    return round(per_lane * width, 1) if per_lane else None


def seconds(fn, device: str, repeat: int) -> float:
    """Median wall seconds of ``fn`` until the device is done (copies mix host and device work)."""
    def run() -> None:
        fn()
        synchronize(device)

    run()
    return statistics.median(wall(run) for _ in range(repeat))


def l1_l2(tiny: bool) -> dict:
    """Page load-back (L2 -> L1) and backup (L1 -> L2) GB/s between a device pool and its registered host pool, by
    the kernels' ``copy_pages``, the cache's ``CopyEngine``, and page-granular ``copy_`` on a side stream straight
    from the pinned pool, each against one ``cudaMemcpyAsync`` of the same bytes (contiguous, pinned)."""
    from decode_worker_kernels import copy_pages

    from decode_worker.cache.pool import KVLayout, KVPool
    from decode_worker.cache.sizing import make_host_pool

    device = device_of(tiny)
    layout = KVLayout("probe", 2 if tiny else 32, 2 if tiny else 8, 16 if tiny else 128, 16,
                      torch.float32 if tiny else torch.bfloat16)
    n, repeat = (16, 2) if tiny else (256, 5)  # Llama-8B pages are 2 MiB: 256 MiB a copy
    device_pool = KVPool(layout, n + 1, device)
    host_pool = make_host_pool(layout, n + 1, device_pool)
    pages = torch.randperm(n, generator=torch.Generator().manual_seed(0))[: n // 2] + 1
    nbytes = pages.numel() * layout.page_bytes
    flat_host = host_pool.buffer.view(-1).view(torch.uint8)[:nbytes]
    flat_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = {
        "memcpy_h2d": seconds(lambda: flat_device.copy_(flat_host, non_blocking=True), device, repeat),
        "memcpy_d2h": seconds(lambda: flat_host.copy_(flat_device, non_blocking=True), device, repeat),
        "copy_pages_load_back": seconds(lambda: copy_pages(host_pool.buffer, device_pool.buffer, pages, pages),
                                        device, repeat),
        "copy_pages_backup": seconds(lambda: copy_pages(device_pool.buffer, host_pool.buffer, pages, pages),
                                     device, repeat),
    }
    side = torch.cuda.Stream() if device == "cuda" else None
    ids = pages.tolist()

    def per_page(src: torch.Tensor, dst: torch.Tensor) -> None:
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for p in ids:
                dst[p].copy_(src[p], non_blocking=True)

    times["per_page_dma_load_back"] = seconds(lambda: per_page(host_pool.buffer, device_pool.buffer), device, repeat)
    times["per_page_dma_backup"] = seconds(lambda: per_page(device_pool.buffer, host_pool.buffer), device, repeat)
    times.update(engine_seconds(device_pool, host_pool, pages, repeat))
    out: dict = {"pinned": host_pool.buffer.is_pinned(), "bytes": nbytes,
                 **{f"{name}_gbs": round(nbytes / t / GB, 2) for name, t in times.items()}}
    for name in times:
        if not name.startswith("memcpy"):
            base = times["memcpy_h2d" if "load" in name else "memcpy_d2h"]
            out[f"{name}_of_memcpy"] = round(base / times[name], 3)
    return out


def engine_seconds(device_pool, host_pool, pages: torch.Tensor, repeat: int) -> dict:
    """The cache's own path: ``CopyEngine`` (straight between the pools, the L2 pool being pinned), wall time of each
    future."""
    from decode_worker.cache.copy_engine import CopyEngine

    engine = CopyEngine(device_pool.buffer, host_pool.buffer)
    try:
        out = {}
        for name, copy in (("engine_load_back", engine.load), ("engine_backup", engine.backup)):
            copy(pages.numpy(), pages.numpy()).result(timeout=60)  # warm-up
            out[name] = statistics.median(wall(lambda: copy(pages.numpy(), pages.numpy()).result(timeout=60))
                                          for _ in range(repeat))
        return out
    finally:
        engine.close()
