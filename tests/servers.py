"""Start real worker and router processes on loopback for integration and end-to-end tests."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from decode_worker.launch import ROUTER_READY_PATH, free_port, router_command, served_model

_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')  # one name="value" pair of a Prometheus sample


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    url: str
    log: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self) -> None:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()

    def kill(self) -> None:
        self.popen.kill()
        self.popen.wait()

    def memory_bytes(self, field: str = "VmRSS") -> int:
        """A ``/proc/<pid>/status`` memory figure of the process: ``VmRSS`` (resident now), ``VmHWM`` (its peak)."""
        for line in Path(f"/proc/{self.popen.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise LookupError(f"{self.name} reports no {field}")

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def metric(self, name: str, *, default: float | None = None, **labels: str) -> float:
        """Sum of a metric's samples whose labels include ``labels``. Raises LookupError when there is none, so a
        renamed metric or label fails the test instead of reading as 0. ``default`` is for a labelled counter
        that may not have counted yet (a reading taken before the event): it says so at the call site."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        values = []
        for line in text.splitlines():
            if line.startswith("#") or not line.startswith(name):
                continue
            series, value = line.rsplit(" ", 1)
            metric, _, label_text = series.partition("{")
            if metric == name and labels.items() <= dict(_LABEL.findall(label_text)).items():
                values.append(float(value))
        if not values:
            if default is not None:
                return default
            raise LookupError(f"{self.name} exports no sample of {name} with labels {labels}")
        return sum(values)


def start(name: str, cmd: list[str], url: str, log_dir: Path, env: dict[str, str] | None = None,
          health: str = "/health", timeout_s: float = 240) -> Proc:
    log = log_dir / f"{name}.log"
    full_env = {**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n", **(env or {})}
    popen = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
    proc = Proc(name, popen, url, log)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{name} exited with {popen.returncode}:\n{proc.tail()}")
        try:
            if httpx.get(url + health, timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.stop()
    raise RuntimeError(f"{name} not healthy after {timeout_s} s:\n{proc.tail()}")


def start_worker(name: str, log_dir: Path, role: str = "colocated", *flags: str, env: dict[str, str] | None = None,
                 port: int | None = None) -> Proc:
    """``port`` chosen ahead lets a peer name this worker before it is up (see ``start_all``)."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "decode_worker.cli", "serve", "--role", role, "--port", str(port),
           "--max-total-tokens", "8192", *flags]
    return start(name, cmd, f"http://127.0.0.1:{port}", log_dir, env)


def start_all(starters: list[Callable[[], Proc]]) -> list[Proc]:
    """Start workers in parallel: each start-up is mostly one core's work, and a fixture's workers are independent.
    If one fails, the others are stopped and its error raised."""
    with ThreadPoolExecutor(len(starters)) as pool:
        futures = [pool.submit(fn) for fn in starters]
    procs, errors = [], []
    for f in futures:
        try:
            procs.append(f.result())
        except Exception as e:  # noqa: BLE001 - re-raised below once every worker is stopped
            errors.append(e)
    if errors:
        for p in procs:
            p.stop()
        raise errors[0]
    return procs


def start_workers(specs: dict[str, tuple[str, tuple[str, ...], dict[str, str] | None]], log_dir: Path,
                  ports: dict[str, int] | None = None) -> dict[str, Proc]:
    """``{name: (role, flags, env)}`` started in parallel, by name; ``ports`` fixes some workers' ports ahead. A decode
    worker with a secret and no ``--prefill-hosts`` is given this call's prefill workers, as ``up`` does."""
    ports = {name: free_port() for name in specs} | (ports or {})
    prefills = [ports[name] for name, (role, _, _) in specs.items() if role == "prefill"]
    specs = {name: (role, flags, with_prefill_hosts(role, flags, env, prefills))
             for name, (role, flags, env) in specs.items()}
    procs = start_all([lambda n=n, r=r, f=f, e=e: start_worker(n, log_dir, r, *f, env=e, port=ports[n])
                       for n, (r, f, e) in specs.items()])
    return dict(zip(specs, procs))


def prefill_hosts_env(*ports: int) -> dict[str, str]:
    """A decode worker's ``--prefill-hosts`` (by environment) naming loopback ``ports``: where it may send secrets."""
    return {"DECODE_WORKER_PREFILL_HOSTS": ",".join(f"127.0.0.1:{p}" for p in ports)}


def port_of(proc) -> int:
    return int(proc.url.rsplit(":", 1)[1])


def with_prefill_hosts(role: str, flags: tuple[str, ...], env: dict[str, str] | None,
                       prefill_ports: list[int]) -> dict[str, str] | None:
    """``env`` plus ``DECODE_WORKER_PREFILL_HOSTS`` naming ``prefill_ports`` on loopback, for a decode worker that
    sends a secret (its PD token or API key) and lists no prefill workers: such a worker refuses to start."""
    merged = {**os.environ, **(env or {})}
    secret = any(merged.get(f"DECODE_WORKER_{name}") for name in ("PD_TOKEN", "API_KEY")) or \
        any(flag in flags for flag in ("--pd-token", "--api-key"))
    listed = merged.get("DECODE_WORKER_PREFILL_HOSTS") or "--prefill-hosts" in flags
    if role != "decode" or not secret or listed or not prefill_ports:
        return env
    return {**(env or {}), **prefill_hosts_env(*prefill_ports)}


def start_router(log_dir: Path, prefill: Proc, decode: Proc) -> Proc:
    port = free_port()
    prefill_port, decode_port = (int(p.url.rsplit(":", 1)[1]) for p in (prefill, decode))
    cmd = router_command("127.0.0.1", port, prefill_port, [decode_port], free_port(), model=served_model(prefill.url))
    return start("router", cmd, f"http://127.0.0.1:{port}", log_dir, health=ROUTER_READY_PATH, timeout_s=60)


def pd_generate(prefill: Proc, decode: Proc, body: dict, room: int, prefill_port: int | None = None,
                timeout: float = 120) -> httpx.Response:
    """What a PD router does: the same body, plus bootstrap fields, to prefill and decode at once."""
    import concurrent.futures

    port = prefill_port if prefill_port is not None else int(prefill.url.rsplit(":", 1)[1])
    full = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": room}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        p = pool.submit(httpx.post, prefill.url + "/generate", json=full, timeout=timeout)
        d = pool.submit(httpx.post, decode.url + "/generate", json=full, timeout=timeout)
        try:
            p.result()
        except httpx.HTTPError:
            pass  # a prefill that dies or hangs is what some tests are about
        return d.result()


def wait_pages_free(proc: Proc, timeout_s: float = 30.0) -> None:
    """Until no request holds device pages (locked or request-owned)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.metric("decode_worker_cache_pages", tier="device", state="locked") == 0 and \
                proc.metric("decode_worker_cache_pages", tier="device", state="used") == 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"{proc.name} still holds device pages:\n{proc.tail()}")
