"""``--dtype auto`` (the default): bfloat16 on CUDA and on CPUs with native bf16, float32 on other CPUs; an explicit
dtype is kept."""
from __future__ import annotations

import logging

import pytest
import torch

from decode_worker.config import ServerConfig
from decode_worker.core import cpu_features

CPUINFO = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f {extra}\n\nprocessor\t: 1\nflags\t\t: fpu sse2\n"


@pytest.mark.parametrize(("cuda", "extra", "want"), [
    (True, "", "bfloat16"),
    (False, "avx512_bf16", "bfloat16"),
    (False, "amx_tile amx_bf16", "bfloat16"),
    (False, "avx512_vnni", "float32"),
])
def test_auto_dtype_follows_the_hardware(monkeypatch: pytest.MonkeyPatch, tmp_path, caplog, cuda: bool, extra: str,
                                         want: str):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(CPUINFO.format(extra=extra))
    monkeypatch.delenv("DECODE_WORKER_DTYPE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    real = cpu_features.auto_dtype
    monkeypatch.setattr(cpu_features, "auto_dtype", lambda c: real(c, str(cpuinfo)))
    with caplog.at_level(logging.INFO, logger="decode_worker.config"):
        assert ServerConfig().dtype == want
    assert f"--dtype auto: {want}" in caplog.text
    assert ServerConfig(dtype="float16").dtype == "float16"
    assert ServerConfig(dtype="float32").dtype == "float32"


def test_a_missing_cpuinfo_means_no_native_bf16(tmp_path):
    assert cpu_features.native_bf16_flags(str(tmp_path / "absent")) == []
    assert cpu_features.auto_dtype(False, str(tmp_path / "absent"))[0] == "float32"


def test_the_startup_line_says_why_auto_chose_the_dtype(monkeypatch: pytest.MonkeyPatch):
    """The choice is logged while the config is built, before a worker sets up logging: the start-up line, logged
    after, carries the reason too (and an explicit dtype has none)."""
    from types import SimpleNamespace

    from decode_worker.engine.summary import startup_summary

    monkeypatch.delenv("DECODE_WORKER_DTYPE", raising=False)
    monkeypatch.setattr(cpu_features, "auto_dtype", lambda cuda: ("bfloat16", "CPU with native bf16 (avx512_bf16)"))
    runner = SimpleNamespace(layout=SimpleNamespace(page_bytes=1024), num_pages=9, dtype=torch.bfloat16,
                             loaded=SimpleNamespace(int4_layers=0), device=torch.device("cpu"))
    auto = startup_summary(ServerConfig(), runner, "m.gguf", 0)
    assert "dtype bfloat16 [--dtype auto: CPU with native bf16 (avx512_bf16)]" in auto
    assert "--dtype auto" not in startup_summary(ServerConfig(dtype="bfloat16"), runner, "m.gguf", 0)
