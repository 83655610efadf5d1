"""A rate-limited link on one host: a namespace with a shaped loopback (README)."""
from __future__ import annotations

import re
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass

LOCAL = "local"
UNSHARE = ["unshare", "--user", "--net", "--map-root-user"]
# KV over TCP only: no shared-memory mapping of prefill's pool (ours), no CMA or shm transport (UCX's).
SHAPED_ENV = {"UCX_TLS": "tcp", "DECODE_WORKER_PD_SHARED_MEMORY": "off"}
TOLERANCE = 0.20  # the achieved rate may differ from the configured one by this much before the run fails
_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(kbit|mbit|gbit)$")
TCP_PROBE_BYTES = 32 << 20


@dataclass(frozen=True)
class Link:
    name: str  # as given: "1gbit", or "local"
    bits_per_s: float | None  # None: the host's own loopback, not shaped

    @property
    def shaped(self) -> bool:
        return self.bits_per_s is not None

    @property
    def gbit(self) -> float | None:
        return self.bits_per_s / 1e9 if self.bits_per_s is not None else None

    def tbf(self) -> list[str]:
        """The qdisc's arguments (sizing: docs/ttft-model.md, "How the bench measures")."""
        burst = max(128 << 10, int(self.bits_per_s / 8 * 0.004))
        return ["rate", f"{self.bits_per_s:.0f}bit", "burst", str(burst), "latency", "200ms"]


def parse_links(text: str) -> list[Link]:
    """``RATE[,RATE...]``: each ``<number>kbit|mbit|gbit`` or ``local``; ValueError naming the bad one."""
    links = []
    for part in (p.strip().lower() for p in text.split(",")):
        if part == LOCAL:
            links.append(Link(LOCAL, None))
            continue
        m = _RATE.match(part)
        if m is None or float(m.group(1)) <= 0:
            raise ValueError(f"--link: {part!r} is neither 'local' nor a positive rate such as 500mbit or 1gbit")
        links.append(Link(part, float(m.group(1)) * _UNITS[m.group(2)]))
    if len({link.name for link in links}) != len(links):
        raise ValueError(f"--link: {text!r} names a rate twice")
    return links


def namespace_problem() -> str | None:
    """None when a shaped private loopback can be made; else why not."""
    for tool, package in (("unshare", "util-linux"), ("ip", "iproute2"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            return f"`{tool}` is missing (Debian package {package}; `make system-deps` installs it)"
    probe = Link("probe", 1e9)
    try:
        done = subprocess.run([*UNSHARE, "sh", "-c", " && ".join(" ".join(c) for c in shape_commands(probe))],
                              capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot start `unshare`: {e}"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        return f"cannot create a private network namespace with a shaped loopback here: {last}"
    return None


def shape_commands(link: Link) -> list[list[str]]:
    return [["ip", "link", "set", "lo", "up"], ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", *link.tbf()]]


def shape_loopback(link: Link) -> None:
    for cmd in shape_commands(link):
        subprocess.run(cmd, check=True, capture_output=True, timeout=30)


def tcp_gbit(nbytes: int = TCP_PROBE_BYTES) -> float:
    """A plain TCP stream's Gbit/s over loopback, without UCX."""
    server = socket.create_server(("127.0.0.1", 0))
    received = 0

    def sink() -> None:
        nonlocal received
        conn, _ = server.accept()
        with conn:
            while chunk := conn.recv(1 << 20):
                received += len(chunk)

    reader = threading.Thread(target=sink, daemon=True)
    reader.start()
    block = bytes(1 << 20)
    start = time.perf_counter()
    with socket.create_connection(server.getsockname(), timeout=60) as out:
        for _ in range(nbytes // len(block)):
            out.sendall(block)
    reader.join(60)
    seconds = time.perf_counter() - start
    server.close()
    if received != nbytes // len(block) * len(block):
        raise RuntimeError(f"the TCP probe received {received} of {nbytes} bytes")
    return received * 8 / seconds / 1e9


def check_rate(link: Link, achieved_gbit: float | None, what: str) -> None:
    """RuntimeError when the achieved rate is off by more than ``TOLERANCE``."""
    if not link.shaped or achieved_gbit is None:
        return
    off = achieved_gbit / link.gbit - 1
    if abs(off) > TOLERANCE:
        raise RuntimeError(f"link {link.name}: {what} achieved {achieved_gbit:.3f} Gbit/s, {off:+.0%} off the "
                           f"configured {link.gbit:g} Gbit/s (more than {TOLERANCE:.0%}): the machine cannot carry "
                           "this rate, pick a lower one")
