"""``--dtype auto`` (the default): bfloat16 on CUDA, float32 on CPU; an explicit dtype is kept."""
from __future__ import annotations

import pytest
import torch

from decode_worker.config import ServerConfig


@pytest.mark.parametrize(("cuda", "want"), [(True, "bfloat16"), (False, "float32")])
def test_auto_dtype_follows_the_device(monkeypatch: pytest.MonkeyPatch, cuda: bool, want: str):
    monkeypatch.delenv("DECODE_WORKER_DTYPE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert ServerConfig().dtype == want
    assert ServerConfig(dtype="float16").dtype == "float16"
