"""What the probe's sections share: timers, random-weight Llama-shaped models and runners built without a download."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]  # the repository
GB = 1e9

# (vocab, hidden, intermediate, layers, heads, kv_heads, head_dim, rope_theta, tied) of the shapes the probe uses
SHAPES = {
    "smollm2": (49152, 576, 1536, 30, 9, 3, 64, 10000.0, True),
    "llama1b": (128256, 2048, 8192, 16, 32, 8, 64, 500000.0, True),  # Llama-3.2-1B
    "llama8b": (128256, 4096, 14336, 32, 32, 8, 128, 500000.0, False),  # Llama-3.1-8B
    "tiny": (256, 64, 128, 2, 4, 2, 16, 10000.0, False),
}


def device_of(tiny: bool) -> str:
    return "cpu" if tiny else "cuda"


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: str, repeat: int = 20, warmup: int = 3) -> float:
    """Median seconds of ``fn``: CUDA events on the device, wall time on CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            times.append(wall(fn))
    return statistics.median(times)


def wall(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def model_config(shape: str, layers: int | None = None):
    """A ``ModelConfig`` of one of ``SHAPES`` (``layers`` overrides its depth)."""
    from decode_worker.model.config import ModelConfig

    vocab, hidden, inter, n_layers, heads, kv_heads, head_dim, theta, tied = SHAPES[shape]
    return ModelConfig("llama", vocab, hidden, inter, layers or n_layers, heads, kv_heads, head_dim, 1e-5, theta,
                       8192, tied, name=f"probe-{shape}")


def random_model(shape: str, dtype: torch.dtype, device: str, layers: int | None = None):
    """A ``LoadedModel`` with random weights, built straight on ``device`` in ``dtype`` (nothing to download)."""
    from decode_worker.model.llama import LlamaModel
    from decode_worker.model.loader import LoadedModel, default_dtype

    config = model_config(shape, layers)
    torch.manual_seed(0)
    with torch.device(device), default_dtype(dtype):
        model = LlamaModel(config).eval()
    return LoadedModel(config, model, None, f"probe-{shape}")


def distinct_pages(lengths: list[int], page_size: int, seed: int = 0) -> list[list[int]]:
    """Pages for requests of ``lengths`` tokens (plus one to decode), scattered over the pool, never page 0."""
    counts = [-(-(n + 1) // page_size) for n in lengths]
    order = (torch.randperm(sum(counts), generator=torch.Generator().manual_seed(seed)) + 1).tolist()
    out, used = [], 0
    for count in counts:
        out.append(order[used:used + count])
        used += count
    return out
