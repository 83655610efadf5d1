"""`decode-worker up`: a local PD deployment on loopback (router, prefill, decodes, Redis as shared L3)."""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from decode_worker.config import ENV_PREFIX, ConfigError, mask_url

CACHE_FLAGS = ["--disaggregation-decode-enable-radix-cache", "--disaggregation-decode-enable-hicache"]
# The router's decode selection policies (`manual` needs a routing key per request: not offered here).
DECODE_POLICIES = ("round_robin", "cache_aware", "power_of_two", "random")
ROUTER_READY_PATH = "/readiness"  # smg answers /health before it has a worker; /readiness once it can route
ROUTER_GRACE_S = 15  # smg finishes requests in flight this long on SIGTERM (its own default, 180 s, outlasts any
# deployment's stop: `up` kills after STOP_GRACE_S, Kubernetes after terminationGracePeriodSeconds)
CLIENT_MODEL = "default"  # the model name SGLang's clients send; the router maps it to the served one


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
STOP_GRACE_S = 20.0  # how long children get to stop on SIGTERM before they are killed
PR_SET_PDEATHSIG = 1


class Stopping(Exception):  # noqa: N818 - a request to stop, not an error
    """A stop signal reached ``up``."""


def _die_with_parent(parent: int) -> Callable[[], None]:
    """Pre-exec: the kernel kills the child when ``up`` dies, even by SIGKILL."""
    def arm() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0 or os.getppid() != parent:
            os._exit(1)

    return arm


@dataclass
class Deployment:
    """Children stopped together however ``up`` stops; each in its own session, so Ctrl-C reaches only ``up``."""

    log_dir: Path
    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)

    def start(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        log = open(self.log_dir / f"{name}.log", "ab")
        self.procs.append((name, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                                  start_new_session=True, preexec_fn=_die_with_parent(os.getpid()))))

    def wait_ready(self, name: str, ready: Callable[[], bool], what: str, timeout_s: float) -> None:
        """Poll ``ready`` until yes, the child dies, or the deadline passes."""
        proc = dict(self.procs)[name]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode}; see {self.log_dir / name}.log")
            if ready():
                return
            time.sleep(0.5)
        raise RuntimeError(f"{name} not ready at {what} after {timeout_s:.0f} s; see {self.log_dir / name}.log")

    def wait_healthy(self, name: str, url: str, timeout_s: float) -> None:
        self.wait_ready(name, lambda: http_ok(url), url, timeout_s)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM each child's group, SIGKILL after ``grace_s`` or a second signal; returns once all exited."""
        def kill_now(signum: int, _: object) -> None:
            print(f"{signal.Signals(signum).name} again: killing what is left", file=sys.stderr, flush=True)
            self._signal_all(signal.SIGKILL)

        previous = {sig: signal.signal(sig, kill_now) for sig in STOP_SIGNALS}
        try:
            self._signal_all(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while self._alive() and time.monotonic() < deadline:
                time.sleep(0.1)
            self._signal_all(signal.SIGKILL)
            for _, proc in self.procs:
                proc.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _alive(self) -> list[subprocess.Popen]:
        return [proc for _, proc in self.procs if proc.poll() is None]

    def _signal_all(self, sig: int) -> None:
        for proc in reversed(self._alive()):
            try:
                os.killpg(proc.pid, sig)  # its group: whatever the child started goes too
            except ProcessLookupError:
                pass

    def watch(self) -> None:
        """Block until a child dies (RuntimeError) or a stop signal arrives."""
        while all(p.poll() is None for _, p in self.procs):
            time.sleep(0.5)
        dead = [n for n, p in self.procs if p.poll() is not None]
        raise RuntimeError(f"{', '.join(dead)} exited; see the logs in {self.log_dir}")


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def served_model(url: str, api_key: str = "") -> str:
    """A worker's served model name (its /server_info), which the router routes by."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with urllib.request.urlopen(urllib.request.Request(url + "/server_info", headers=headers), timeout=10) as resp:
        return json.load(resp)["served_model_name"]


def redis_ok(host: str, port: int) -> bool:
    """A Redis PING answered (inline protocol, no client)."""
    try:
        with socket.create_connection((host, port), timeout=2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def redis_command(host: str, port: int, workdir: Path, max_gb: float) -> list[str]:
    """redis-server as a cache: no persistence, LRU past ``max_gb`` (a lost page is an L3 miss)."""
    return [shutil.which("redis-server") or "redis-server", "--bind", host, "--port", str(port), "--save", "",
            "--appendonly", "no", "--dir", str(workdir), "--maxmemory", f"{int(max_gb * 2**30)}",
            "--maxmemory-policy", "allkeys-lru", "--daemonize", "no"]


def add_up_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000, help="router port (the one to curl)")
    parser.add_argument("--prefill-port", type=int, default=30001)
    parser.add_argument("--decode-port", type=int, default=30002,
                        help="the first decode worker's port; replica i listens on this port + i")
    parser.add_argument("--decode-replicas", type=int, default=1,
                        help="decode workers behind the router; with 2 or more they share an L3 in Redis")
    parser.add_argument("--decode-policy", choices=DECODE_POLICIES, default="cache_aware",
                        help="how the router picks a decode worker (smg's --decode-policy). cache_aware sends a "
                             "prompt to the worker that holds its prefix, which keeps the hit rate as workers are "
                             "added; round_robin spreads evenly and leaves prefixes to the shared L3 "
                             "(docs/scale-out.md)")
    parser.add_argument("--redis-url", default=None,
                        help="the decode workers' shared L3 (redis://host:port); unset with 2+ decode replicas: a "
                             "redis-server started on a free port")
    parser.add_argument("--redis-max-gb", type=float, default=2.0,
                        help="memory of the redis-server `up` starts; past it, least recently used pages go")
    parser.add_argument("--no-shared-l3", action="store_true", help="no L3: each decode worker caches on its own")
    parser.add_argument("--router-metrics-port", type=int, default=0,
                        help="the router's Prometheus port (0: a free one; smg's own default, 29000, "
                             "would clash with a second deployment on the host)")
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--max-total-tokens", type=int, default=None,
                        help="each worker's L1 in tokens; unset: sized by each worker (on CPU from the model's "
                             "context and the memory available)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--log-dir", default=None, help="where worker and router logs go (default: a temp folder)")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--no-hicache", action="store_true", help="decode workers with the radix cache only")
    parser.add_argument("--api-key", default=os.environ.get("DECODE_WORKER_API_KEY", ""),
                        help="require 'Authorization: Bearer <key>' at the router and every worker "
                             "(env DECODE_WORKER_API_KEY, which keeps it out of the workers' command lines)")


def decode_ports(args: argparse.Namespace) -> list[int]:
    return [args.decode_port + i for i in range(args.decode_replicas)]


def shared_l3(args: argparse.Namespace) -> bool:
    """An explicit --redis-url, or two or more decode workers."""
    return not args.no_shared_l3 and (args.redis_url is not None or args.decode_replicas > 1)


def check_up_args(args: argparse.Namespace) -> None:
    """Refuse by flag name what could only fail once processes run."""
    if args.decode_replicas < 1:
        raise ConfigError(f"--decode-replicas must be at least 1, not {args.decode_replicas}")
    ports = [args.port, args.prefill_port, *decode_ports(args)]
    if len(set(ports)) != len(ports):
        raise ConfigError(f"--port {args.port}, --prefill-port {args.prefill_port} and the decode ports "
                          f"{decode_ports(args)} (--decode-port + replica) must all differ")
    if args.redis_url is not None and args.no_shared_l3:
        raise ConfigError("--redis-url and --no-shared-l3 contradict each other")
    if args.redis_url is not None and not args.redis_url.startswith("redis://"):
        raise ConfigError(f"--redis-url must look like redis://host:port, not {args.redis_url!r}")
    if shared_l3(args) and args.no_hicache:
        raise ConfigError("the shared L3 needs hicache on the decode workers: drop --no-hicache, or add --no-shared-l3")
    if shared_l3(args) and args.redis_url is None and shutil.which("redis-server") is None:
        raise ConfigError("redis-server is not installed: install it (Debian: apt-get install redis-server), give "
                          "--redis-url, or turn the shared L3 off with --no-shared-l3")
    if args.redis_max_gb <= 0:
        raise ConfigError(f"--redis-max-gb must be positive, not {args.redis_max_gb}")


def router_auth(api_key: str) -> list[str]:
    """The router's --api-key (no environment variable exists for it)."""
    return ["--api-key", api_key] if api_key else []


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def router_command(host: str, port: int, prefill_port: int, decode_ports: Sequence[int], metrics_port: int,
                   api_key: str = "", decode_policy: str | None = None, model: str = "") -> list[str]:
    """smg, the SGLang model gateway, in PD mode; ``metrics_port`` explicit (a second router on the default
    clashes); ``decode_policy`` None: the router's. It routes by model name: ``model``, the workers' served name,
    is also reachable as ``CLIENT_MODEL``."""
    decodes = [arg for p in decode_ports for arg in ("--decode", f"http://{host}:{p}")]
    policy = ["--decode-policy", decode_policy] if decode_policy else []
    alias = ["--model-alias", f"{CLIENT_MODEL}={model}"] if model and model != CLIENT_MODEL else []
    return [sys.executable, "-m", "smg.launch_router", "--pd-disaggregation",
            "--prefill", f"http://{host}:{prefill_port}", str(prefill_port), *decodes, *policy, *alias,
            "--host", host, "--port", str(port), "--prometheus-host", host, "--prometheus-port", str(metrics_port),
            "--shutdown-grace-period-secs", str(ROUTER_GRACE_S), *router_auth(api_key)]


def storage_env(redis_url: str) -> dict[str, str]:
    """The shared L3 URL through the environment (a password on a command line shows in ``ps``)."""
    return {f"{ENV_PREFIX}HICACHE_STORAGE_BACKEND": "redis", f"{ENV_PREFIX}HICACHE_STORAGE_URL": redis_url}


def _start_redis(dep: Deployment, args: argparse.Namespace, env: dict[str, str]) -> str:
    """The given shared L3 URL, or a redis-server started here."""
    if args.redis_url is not None:
        return args.redis_url
    port = free_port(args.host)
    dep.start("redis", redis_command(args.host, port, dep.log_dir, args.redis_max_gb), env)
    dep.wait_ready("redis", lambda: redis_ok(args.host, port), f"{args.host}:{port}", 30)
    return f"redis://{args.host}:{port}"


def _start_workers(dep: Deployment, args: argparse.Namespace, env: dict[str, str], redis_url: str | None) -> None:
    common = ["--host", args.host, "--page-size", str(args.page_size)]
    if args.max_total_tokens is not None:
        common += ["--max-total-tokens", str(args.max_total_tokens)]
    if args.model_path:
        common += ["--model-path", args.model_path]
    worker = [sys.executable, "-m", "decode_worker.cli", "serve"]
    cache = CACHE_FLAGS[:1] if args.no_hicache else CACHE_FLAGS
    decode_env = env | storage_env(redis_url) if redis_url else env
    dep.start("prefill", worker + ["--role", "prefill", "--port", str(args.prefill_port)] + common, env)
    for i, port in enumerate(decode_ports(args)):
        dep.start(f"decode-{i}", worker + ["--role", "decode", "--port", str(port), "--bootstrap-port",
                                           str(args.prefill_port), "--prefill-hosts",
                                           host_port(args.host, args.prefill_port)] + common + cache, decode_env)
    names = ["prefill", *(f"decode-{i}" for i in range(args.decode_replicas))]
    for name, port in zip(names, [args.prefill_port, *decode_ports(args)]):
        dep.wait_healthy(name, f"http://{args.host}:{port}/health", args.startup_timeout)


def _print_ready(args: argparse.Namespace, metrics_port: int, redis_url: str | None, log_dir: Path) -> None:
    url = f"http://{args.host}:{args.port}"
    decodes = ", ".join(f"http://{args.host}:{p}" for p in decode_ports(args))
    print(f"PD deployment ready: router {url} (metrics :{metrics_port}, decode policy {args.decode_policy}), "
          f"prefill http://{args.host}:{args.prefill_port}, decode {decodes}"
          + (f", shared L3 {mask_url(redis_url)}" if redis_url else ""))
    print(f"logs: {log_dir}")
    auth = " -H \"Authorization: Bearer $DECODE_WORKER_API_KEY\"" if args.api_key else ""
    print(f"try:\n  curl -s {url}/generate{auth} -H 'content-type: application/json' "
          "-d '{\"text\": \"The capital of France is\", \"sampling_params\": {\"max_new_tokens\": 16, \"temperature\": 0}}'",
          flush=True)


def run_up(args: argparse.Namespace) -> int:
    import tempfile

    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="decode-worker-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("DECODE_WORKER_PD_TOKEN", secrets.token_hex(16))
    env["DECODE_WORKER_API_KEY"] = args.api_key  # the workers read it from here; empty leaves them open
    dep = Deployment(log_dir)

    def stopping(signum: int, _: object) -> None:
        raise Stopping(signal.Signals(signum).name)

    for sig in STOP_SIGNALS:
        signal.signal(sig, stopping)
    try:
        redis_url = _start_redis(dep, args, env) if shared_l3(args) else None
        _start_workers(dep, args, env, redis_url)
        metrics_port = args.router_metrics_port or free_port(args.host)
        model = served_model(f"http://{args.host}:{args.prefill_port}", args.api_key)
        dep.start("router", router_command(args.host, args.port, args.prefill_port, decode_ports(args), metrics_port,
                                           args.api_key, args.decode_policy, model), env)
        dep.wait_healthy("router", f"http://{args.host}:{args.port}{ROUTER_READY_PATH}", 60)
        _print_ready(args, metrics_port, redis_url, log_dir)
        dep.watch()
    except Stopping as e:
        print(f"{e}: stopping the deployment", file=sys.stderr, flush=True)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        dep.stop()
    return 0
