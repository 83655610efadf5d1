"""A PD deployment per mode, as `decode-worker up` starts one."""
from __future__ import annotations

import os
import secrets
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from decode_worker.bench.modes import Mode
from decode_worker.launch import ROUTER_READY_PATH, Deployment, free_port, host_port, router_command, served_model


@dataclass(frozen=True)
class Endpoints:
    router: str
    decode: str | None  # None: its /metrics is unknown (a deployment the user gave without it)
    prefill: str | None


@dataclass(frozen=True)
class DeploySpec:
    model_path: str | None
    dtype: str
    page_size: int
    l1_tokens: int
    prefill_l1_tokens: int
    hicache_ratio: float
    prefetch_policy: str
    api_key: str
    log_dir: Path
    startup_timeout_s: float
    host: str = "127.0.0.1"

    @property
    def storage_dir(self) -> Path:
        return self.log_dir / "l3"


def worker_cmd(spec: DeploySpec, role: str, port: int, l1_tokens: int) -> list[str]:
    cmd = [sys.executable, "-m", "decode_worker.cli", "serve", "--role", role, "--host", spec.host,
           "--port", str(port), "--max-total-tokens", str(l1_tokens), "--page-size", str(spec.page_size),
           "--dtype", spec.dtype]
    return cmd + (["--model-path", spec.model_path] if spec.model_path else [])


def decode_cmd(spec: DeploySpec, port: int, prefill_port: int) -> list[str]:
    """A decode worker that bootstraps from, and sends its PD token and API key only to, the prefill at
    ``prefill_port``."""
    return worker_cmd(spec, "decode", port, spec.l1_tokens) + [
        "--bootstrap-port", str(prefill_port), "--prefill-hosts", host_port(spec.host, prefill_port)]


@contextmanager
def deployed(spec: DeploySpec, mode: Mode) -> Iterator[Endpoints]:
    """Router, prefill and decode for ``mode``, stopped on exit."""
    log_dir = spec.log_dir / mode.name
    log_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, DECODE_WORKER_PD_TOKEN=secrets.token_hex(16), DECODE_WORKER_API_KEY=spec.api_key)
    prefill_port, decode_port, router_port, metrics_port = (free_port() for _ in range(4))

    def url(port: int) -> str:
        return f"http://{spec.host}:{port}"

    dep = Deployment(log_dir)
    try:
        dep.start("prefill", worker_cmd(spec, "prefill", prefill_port, spec.prefill_l1_tokens), env)
        dep.start("decode", decode_cmd(spec, decode_port, prefill_port)
                  + mode.decode_flags(spec.hicache_ratio, spec.storage_dir, spec.prefetch_policy), env)
        for name, port in (("prefill", prefill_port), ("decode", decode_port)):
            dep.wait_healthy(name, url(port) + "/health", spec.startup_timeout_s)
        model = served_model(url(prefill_port), spec.api_key)
        dep.start("router", router_command(spec.host, router_port, prefill_port, [decode_port], metrics_port,
                                           spec.api_key, model=model), env)
        dep.wait_healthy("router", url(router_port) + ROUTER_READY_PATH, 60)
        yield Endpoints(url(router_port), url(decode_port), url(prefill_port))
    finally:
        dep.stop()
