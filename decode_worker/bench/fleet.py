"""The scale-out fleet: a prefill, several decodes, optional Redis L3."""
from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from decode_worker.bench.deploy import DeploySpec, decode_cmd, worker_cmd
from decode_worker.bench.modes import MODES
from decode_worker.launch import (
    ROUTER_READY_PATH,
    Deployment,
    free_port,
    redis_command,
    redis_ok,
    router_command,
    served_model,
)

REDIS_MAX_GB = 4.0  # far above any scaled-down trace: L3 never evicts in the benchmark


@dataclass(frozen=True)
class FleetEndpoints:
    router: str
    decodes: list[str]
    prefill: str
    redis: tuple[str, int] | None


@dataclass(frozen=True)
class Fleet:
    spec: DeploySpec
    deployment: Deployment
    env: dict[str, str]
    prefill_port: int
    decode_ports: list[int]
    redis: tuple[str, int] | None

    def url(self, port: int) -> str:
        return f"http://{self.spec.host}:{port}"


def redis_flush(host: str, port: int) -> None:
    """Empty the shared L3 between rows (an inline FLUSHALL)."""
    with socket.create_connection((host, port), timeout=30) as s:
        s.sendall(b"FLUSHALL\r\n")
        if not s.recv(64).startswith(b"+OK"):
            raise RuntimeError(f"redis at {host}:{port} refused FLUSHALL")


def _decode_flags(spec: DeploySpec, redis: tuple[str, int] | None) -> list[str]:
    """Radix + L2, plus Redis L3 when the fleet has it."""
    flags = MODES["hier"].decode_flags(spec.hicache_ratio, spec.storage_dir, spec.prefetch_policy)
    if redis is None:
        return flags
    return flags + ["--hicache-storage-backend", "redis", "--hicache-storage-url", f"redis://{redis[0]}:{redis[1]}",
                    "--hicache-storage-prefetch-policy", spec.prefetch_policy]


@contextmanager
def fleet(spec: DeploySpec, pods: int, shared_l3: bool, name: str) -> Iterator[Fleet]:
    """Prefill, ``pods`` decodes and, with ``shared_l3``, redis-server; stopped on exit."""
    log_dir = spec.log_dir / name
    log_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, DECODE_WORKER_PD_TOKEN=secrets.token_hex(16), DECODE_WORKER_API_KEY=spec.api_key)
    dep = Deployment(log_dir)
    try:
        redis = None
        if shared_l3:
            redis = (spec.host, free_port())
            dep.start("redis", redis_command(*redis, log_dir, REDIS_MAX_GB), env)
            dep.wait_ready("redis", lambda: redis_ok(*redis), f"{redis[0]}:{redis[1]}", 30)
        prefill_port, decode_ports = free_port(), [free_port() for _ in range(pods)]
        dep.start("prefill", worker_cmd(spec, "prefill", prefill_port, spec.prefill_l1_tokens), env)
        for i, port in enumerate(decode_ports):
            dep.start(f"decode-{i}", decode_cmd(spec, port, prefill_port) + _decode_flags(spec, redis), env)
        for name_, port in [("prefill", prefill_port), *((f"decode-{i}", p) for i, p in enumerate(decode_ports))]:
            dep.wait_healthy(name_, f"http://{spec.host}:{port}/health", spec.startup_timeout_s)
        yield Fleet(spec, dep, env, prefill_port, decode_ports, redis)
    finally:
        dep.stop()


@contextmanager
def routed(fl: Fleet, pods: int, decode_policy: str, name: str) -> Iterator[FleetEndpoints]:
    """A router over the first ``pods`` decodes; the workers outlive it."""
    router_port = free_port()
    dep = Deployment(fl.deployment.log_dir)
    try:
        model = served_model(fl.url(fl.prefill_port), fl.spec.api_key)
        dep.start(name, router_command(fl.spec.host, router_port, fl.prefill_port, fl.decode_ports[:pods],
                                       free_port(), fl.spec.api_key, decode_policy, model), fl.env)
        dep.wait_healthy(name, fl.url(router_port) + ROUTER_READY_PATH, 60)
        yield FleetEndpoints(fl.url(router_port), [fl.url(p) for p in fl.decode_ports[:pods]],
                             fl.url(fl.prefill_port), fl.redis)
    finally:
        dep.stop()
