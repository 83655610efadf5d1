"""Loading builds the model in its target dtype: bf16 weights cost 2 bytes per parameter, not fp32's 4 plus a cast.

Bytes are counted at the dispatcher: every op that makes a new floating-point tensor (not a view, not in place)
adds its size. That total bounds the load's peak from above, so a load that allocates about 1x the bf16 weights
peaks at about 1x (the old fp32 build then cast allocated 3x).
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from decode_worker.model import loader


class AllocatedBytes(TorchDispatchMode):
    """Sum of the bytes of every new floating-point tensor an op returns while active and not paused."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.paused or func.is_view or func._schema.is_mutable:
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.total += t.numel() * t.element_size()
        return out

    @contextlib.contextmanager
    def pause(self):
        self.paused = True
        try:
            yield
        finally:
            self.paused = False


def test_bf16_load_allocates_about_the_bf16_weights(tiny_models, monkeypatch: pytest.MonkeyPatch):
    """The build and the weights' load, counted; the matmul forms made after them (packed copies that replace the
    dense weights, tested in test_matmul_forms.py) are not."""
    counted = AllocatedBytes()
    built: dict[str, int] = {}

    def uncounted(fn):
        def run(model, *args, **kwargs):
            with counted.pause():
                if fn is real_pack:
                    built["bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
                    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
                return fn(model, *args, **kwargs)
        return run

    real_pack = loader.pack_linears
    monkeypatch.setattr(loader, "weights_digest", uncounted(loader.weights_digest))  # samples: nil at scale
    monkeypatch.setattr(loader, "head_matmul", uncounted(loader.head_matmul))
    monkeypatch.setattr(loader, "pack_linears", uncounted(real_pack))
    with counted:
        loader.load_model(tiny_models["llama"], dtype=torch.bfloat16, tokenizer=False)
    weights = built["bytes"]
    ratio = counted.total / weights
    print(f"load allocated {ratio:.2f}x the bf16 weights ({weights} bytes)")
    # 1x for the weights, ~0.3x for this tiny model's rotary tables (512 positions; nil for a real model).
    assert ratio < 1.5, f"load allocated {counted.total} bytes for {weights} bytes of bf16 weights"
