"""`decode-worker up`: a local PD deployment on loopback (sglang-router, one prefill, one decode worker)."""
from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

CACHE_FLAGS = ["--disaggregation-decode-enable-radix-cache", "--disaggregation-decode-enable-hicache"]


@dataclass
class Deployment:
    """Child processes of a local deployment; stopped together, in reverse start order."""

    log_dir: Path
    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)

    def start(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        log = open(self.log_dir / f"{name}.log", "ab")
        self.procs.append((name, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                                  start_new_session=True)))

    def wait_healthy(self, name: str, url: str, timeout_s: float) -> None:
        proc = dict(self.procs)[name]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode}; see {self.log_dir / name}.log")
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{name} not healthy at {url} after {timeout_s:.0f} s; see {self.log_dir / name}.log")

    def stop(self) -> None:
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc in reversed(self.procs):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()

    def watch(self) -> None:
        """Block until a child dies or we are told to stop."""
        while all(p.poll() is None for _, p in self.procs):
            time.sleep(0.5)
        dead = [n for n, p in self.procs if p.poll() is not None]
        raise RuntimeError(f"{', '.join(dead)} exited; see the logs in {self.log_dir}")


def add_up_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000, help="router port (the one to curl)")
    parser.add_argument("--prefill-port", type=int, default=30001)
    parser.add_argument("--decode-port", type=int, default=30002)
    parser.add_argument("--router-metrics-port", type=int, default=0,
                        help="the router's Prometheus port (0: a free one; sglang-router's own default, 29000, "
                             "would clash with a second deployment on the host)")
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--max-total-tokens", type=int, default=32768)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--log-dir", default=None, help="where worker and router logs go (default: a temp folder)")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--no-hicache", action="store_true", help="decode worker with the radix cache only")
    parser.add_argument("--api-key", default=os.environ.get("DECODE_WORKER_API_KEY", ""),
                        help="require 'Authorization: Bearer <key>' at the router and both workers "
                             "(env DECODE_WORKER_API_KEY, which keeps it out of the workers' command lines)")


def router_auth(api_key: str) -> list[str]:
    """sglang-router's --api-key: it then requires the key from clients and sends it to the workers on its own
    calls (/server_info, /model_info) as on forwarded requests. It has no environment variable for it."""
    return ["--api-key", api_key] if api_key else []


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def router_command(host: str, port: int, prefill_port: int, decode_port: int, metrics_port: int,
                   api_key: str = "") -> list[str]:
    """sglang-router in PD mode over one prefill and one decode worker on ``host``. Its Prometheus exporter gets
    ``metrics_port``: its own default, 29000, makes a second router on the host panic at start."""
    return [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
            "--prefill", f"http://{host}:{prefill_port}", str(prefill_port), "--decode", f"http://{host}:{decode_port}",
            "--host", host, "--port", str(port), "--prometheus-host", host, "--prometheus-port", str(metrics_port),
            *router_auth(api_key)]


def run_up(args: argparse.Namespace) -> int:
    import tempfile

    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="decode-worker-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("DECODE_WORKER_PD_TOKEN", secrets.token_hex(16))
    env["DECODE_WORKER_API_KEY"] = args.api_key  # the workers read it from here; empty leaves them open
    common = ["--host", args.host, "--max-total-tokens", str(args.max_total_tokens), "--page-size", str(args.page_size)]
    if args.model_path:
        common += ["--model-path", args.model_path]
    worker = [sys.executable, "-m", "decode_worker.cli", "serve"]
    cache = CACHE_FLAGS[:1] if args.no_hicache else CACHE_FLAGS
    dep = Deployment(log_dir)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        dep.start("prefill", worker + ["--role", "prefill", "--port", str(args.prefill_port)] + common, env)
        dep.start("decode", worker + ["--role", "decode", "--port", str(args.decode_port),
                                      "--bootstrap-port", str(args.prefill_port)] + common + cache, env)
        for name, port in (("prefill", args.prefill_port), ("decode", args.decode_port)):
            dep.wait_healthy(name, f"http://{args.host}:{port}/health", args.startup_timeout)
        prefill_url = f"http://{args.host}:{args.prefill_port}"
        metrics_port = args.router_metrics_port or free_port(args.host)
        dep.start("router", router_command(args.host, args.port, args.prefill_port, args.decode_port, metrics_port,
                                           args.api_key), env)
        dep.wait_healthy("router", f"http://{args.host}:{args.port}/health", 60)
        url = f"http://{args.host}:{args.port}"
        print(f"PD deployment ready: router {url} (metrics :{metrics_port}), prefill {prefill_url}, "
              f"decode http://{args.host}:{args.decode_port}")
        print(f"logs: {log_dir}")
        auth = " -H \"Authorization: Bearer $DECODE_WORKER_API_KEY\"" if args.api_key else ""
        print(f"try:\n  curl -s {url}/generate{auth} -H 'content-type: application/json' "
              "-d '{\"text\": \"The capital of France is\", \"sampling_params\": {\"max_new_tokens\": 16, \"temperature\": 0}}'",
              flush=True)
        dep.watch()
    except KeyboardInterrupt:
        pass
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        dep.stop()
    return 0
