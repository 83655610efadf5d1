"""The start-up line an operator reads first."""
from __future__ import annotations

from decode_worker.config import ServerConfig, mask_url
from decode_worker.model.runner import ModelRunner


def startup_summary(cfg: ServerConfig, runner: ModelRunner, model_path: str, host_pages: int) -> str:
    page_bytes, ps = runner.layout.page_bytes, cfg.page_size
    l1_pages = runner.num_pages - 1  # page 0 is scratch
    parts = [f"role {cfg.role}", f"model {model_path}", f"dtype {runner.dtype}".replace("torch.", "")
             + (f" ({runner.loaded.int4_layers} layers int4)" if runner.loaded.int4_layers else "")
             + (f" [{cfg.dtype_reason}]" if cfg.dtype_reason else ""),
             f"device {runner.device}", f"L1 {l1_pages * ps} tokens ({l1_pages * page_bytes / 1e9:.2f} GB)",
             f"L2 {host_pages * ps} tokens ({host_pages * page_bytes / 1e9:.2f} GB)" if host_pages else "L2 off",
             _storage(cfg), f"http {cfg.host}:{cfg.port}"]
    if cfg.bootstrap_port is not None:
        parts.append(f"bootstrap port {cfg.bootstrap_port}")
    return "starting: " + ", ".join(parts)


def _storage(cfg: ServerConfig) -> str:
    if cfg.hicache_storage_backend == "none":
        return "L3 off"
    return f"L3 {cfg.hicache_storage_backend} {mask_url(cfg.hicache_storage_url or '(default folder)')}"
