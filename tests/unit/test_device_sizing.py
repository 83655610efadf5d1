"""L1 on CUDA is sized from the memory free after the weights (``--mem-fraction-static``), not a fixed token count;
the arithmetic runs here on given free/total figures, the allocation on a GPU in tests/gpu/test_memory_gpu.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from decode_worker.cache.pool import KVLayout
from decode_worker.cache.sizing import MEM_FRACTION_STATIC, InsufficientDeviceMemory, device_pool_tokens

LLAMA_1B = SimpleNamespace(num_layers=16, num_kv_heads=8, head_dim=64)
GIB = 2**30


def page_bytes(model, page_size: int = 16, dtype: torch.dtype = torch.bfloat16) -> int:
    return KVLayout("t", model.num_layers, model.num_kv_heads, model.head_dim, page_size, dtype).page_bytes


def test_pool_takes_the_free_memory_less_the_kept_share_and_the_scratch_page():
    free, total = 138 * GIB, 141 * GIB  # an H200 after a 1B model's weights
    tokens = device_pool_tokens(LLAMA_1B, 16, torch.bfloat16, 0.85, free_bytes=free, total_bytes=total)
    usable = free - 0.15 * total
    pages = tokens // 16 + 1  # what the runner allocates: the tokens' pages plus the scratch page
    assert tokens % 16 == 0
    assert pages * page_bytes(LLAMA_1B) <= usable < (pages + 1) * page_bytes(LLAMA_1B)
    assert tokens > 3_000_000  # not the fixed 32,768


def test_a_bigger_fraction_or_more_free_memory_gives_a_bigger_pool():
    sizes = [device_pool_tokens(LLAMA_1B, 16, torch.bfloat16, f, free_bytes=70 * GIB, total_bytes=80 * GIB)
             for f in (0.5, 0.7, 0.9)]
    assert sizes == sorted(sizes) and len(set(sizes)) == 3
    assert device_pool_tokens(LLAMA_1B, 16, torch.float32, 0.9, free_bytes=70 * GIB, total_bytes=80 * GIB) \
        == pytest.approx(sizes[2] / 2, rel=1e-3)  # float32 KV: half the tokens


def test_no_room_names_the_flags():
    with pytest.raises(InsufficientDeviceMemory, match="--mem-fraction-static 0.5 .* --max-total-tokens"):
        device_pool_tokens(LLAMA_1B, 16, torch.bfloat16, 0.5, free_bytes=10 * GIB, total_bytes=24 * GIB)


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5])
def test_fraction_out_of_range_is_refused(fraction: float):
    with pytest.raises(ValueError, match="--mem-fraction-static"):
        device_pool_tokens(LLAMA_1B, 16, torch.bfloat16, fraction, free_bytes=GIB, total_bytes=GIB)


def test_the_flag_default_is_the_sizing_default():
    from decode_worker.config import ServerConfig

    assert ServerConfig.model_fields["mem_fraction_static"].default == MEM_FRACTION_STATIC


@pytest.mark.parametrize("field,value", [("mem_fraction_static", 1.5), ("cuda_graph_max_bs", -1)])
def test_the_server_refuses_bad_values_naming_the_flag(field: str, value: float):
    from decode_worker.config import ConfigError, ServerConfig

    flag = "--" + field.replace("_", "-")
    with pytest.raises(ConfigError, match=flag):
        ServerConfig(**{field: value}).validate()


def test_the_engine_sizes_l1_from_memory_on_cuda_unless_max_total_tokens_is_given(monkeypatch, tmp_path):
    """Wiring: with CUDA reported (the model itself loads on CPU here), an unset --max-total-tokens asks
    ``device_pool_tokens`` with --mem-fraction-static and the runner gets its answer; a given one is kept as is. The
    graphs stop at --max-running-requests."""
    from decode_worker.config import ServerConfig
    from decode_worker.engine import engine as engine_module
    from tests.tiny_model import save_tiny_chat_model

    model = str(save_tiny_chat_model(tmp_path / "tiny"))
    asked, runners = [], []
    load = engine_module.load_model
    monkeypatch.setattr(engine_module.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(engine_module, "load_model", lambda path, dtype, device, **kw: load(path, dtype=dtype, device="cpu", **kw))
    monkeypatch.setattr(engine_module, "device_pool_tokens",
                        lambda model, page_size, dtype, fraction: asked.append((page_size, fraction)) or 1024)
    runner_class = engine_module.ModelRunner
    monkeypatch.setattr(engine_module, "ModelRunner",
                        lambda *args, **kwargs: runners.append(args) or runner_class(*args, **kwargs))
    for given in ({}, {"max_total_tokens": 512}):
        engine = engine_module.Engine(ServerConfig(model_path=model, dtype="float32", mem_fraction_static=0.7,
                                                   max_running_requests=48, **given))
        engine.load_model()
        engine.cache.close()
    assert asked == [(16, 0.7)]
    assert [(tokens, graphs) for _, tokens, _, graphs in runners] == [(1024, 48), (512, 48)]
    assert engine.server_info()["max_total_num_tokens"] == 512
