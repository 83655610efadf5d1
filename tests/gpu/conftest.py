"""The GPU-only tests. They import only torch, triton, numpy and pytest (no server stack: pydantic, fastapi, gguf,
nixl), so ``pytest tests/gpu`` collects on a bare CUDA machine from a checkout with ``PYTHONPATH=.:kernels``; without a
CUDA device every test here skips."""
from __future__ import annotations

import pytest
import torch


# every module here: pytestmark = GPU_ONLY
GPU_ONLY = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def random_loaded(device: str = "cuda", dtype: torch.dtype = torch.float32):
    """A tiny random-weight Llama (2 layers, GQA group 2) built in place: no transformers, nothing to download."""
    from decode_worker.model.config import ModelConfig
    from decode_worker.model.llama import LlamaModel
    from decode_worker.model.loader import LoadedModel, default_dtype

    config = ModelConfig("llama", 320, 64, 160, 2, 4, 2, 16, 1e-5, 10000.0, 512, False, name="gpu-test")
    torch.manual_seed(0)
    with torch.device(device), default_dtype(dtype):
        model = LlamaModel(config).eval()
    return LoadedModel(config, model, None, "gpu-test")
