"""Which prefills a decode may call (``--prefill-hosts``, docs/security.md); only the operator's names are resolved."""
from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)
ANY = "*"
LOOPBACK_NAMES = frozenset({"localhost"})

Resolver = Callable[[str], Awaitable[frozenset[str]]]


@dataclass(frozen=True)
class HostEntry:
    """A lower-case name or a normalised address, and a port (None: any)."""

    host: str
    port: int | None = None

    @property
    def is_address(self) -> bool:
        return _address(self.host) is not None

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port is None else f"{host}:{self.port}"


def _address(host: str) -> str | None:
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return None


def normalise_host(host: str) -> str:
    """An address in its one written form; a name lower-cased, no trailing dot."""
    return _address(host) or host.strip("[]").rstrip(".").lower()


def parse_prefill_hosts(raw: str) -> tuple[HostEntry, ...] | None:
    """``host[:port],...`` into entries, None for ``*``; ValueError names a bad entry."""
    if raw.strip() == ANY:
        return None
    entries = []
    for item in (part.strip() for part in raw.split(",")):
        if not item:
            continue
        if any(c.isspace() or c in "/@?#" for c in item):
            raise ValueError(f"{item!r} is not host[:port]")
        host, port = _split(item)
        if not host:
            raise ValueError(f"{item!r} is not host[:port]")
        entries.append(HostEntry(normalise_host(host), port))
    return tuple(entries)


def _split(item: str) -> tuple[str, int | None]:
    if item.startswith("["):
        host, _, rest = item[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else (None if not rest else "bad")
    elif item.count(":") == 1:
        host, port = item.split(":")
    else:
        host, port = item, None  # a name, an IPv4 address, or a bare IPv6 address
    if port is None:
        return host, None
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{item!r} has no valid port")
    return host, int(port)


async def resolve(name: str) -> frozenset[str]:
    """The addresses ``name`` resolves to, looked up in the loop's executor."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, None, type=socket.SOCK_STREAM)
    return frozenset(normalise_host(info[4][0]) for info in infos)


@dataclass
class PrefillHosts:
    """The allow-list and its cache of resolved names: ``entries`` None allows any host, empty only loopback."""

    entries: tuple[HostEntry, ...] | None
    ttl_s: float = 5.0
    min_refresh_s: float = 1.0
    resolve_timeout_s: float = 2.0
    resolver: Resolver = resolve
    _addresses: dict[str, frozenset[str]] = field(default_factory=dict)  # name -> its addresses when last resolved
    _resolved_at: float = float("-inf")
    _refresh: asyncio.Task | None = None

    @classmethod
    def from_flag(cls, raw: str) -> PrefillHosts:
        return cls(parse_prefill_hosts(raw))

    def describe(self) -> str:
        if self.entries is None:
            return "any host (--prefill-hosts '*')"
        return ", ".join(map(str, self.entries)) if self.entries else "loopback only (--prefill-hosts unset)"

    def allowed_now(self, host: str, port: int) -> bool:
        """Whether ``host:port`` is allowed by what is resolved so far (no lookup)."""
        if self.entries is None:
            return True
        host = normalise_host(host)
        if not self.entries:
            address = _address(host)
            return host in LOOPBACK_NAMES or (address is not None and ipaddress.ip_address(address).is_loopback)
        is_address = _address(host) is not None
        for entry in self.entries:
            if entry.port is not None and entry.port != port:
                continue
            if entry.host == host or (is_address and host in self._addresses.get(entry.host, ())):
                return True
        return False

    async def allowed(self, host: str, port: int) -> bool:
        """Whether ``host:port`` may be called; an address unknown to a fresh cache costs one re-resolution."""
        fresh = time.monotonic() - self._resolved_at < self.ttl_s
        if fresh and self.allowed_now(host, port):
            return True
        if self.entries and _address(host) is not None and any(not e.is_address for e in self.entries):
            await self._refreshed()
        return self.allowed_now(host, port)

    async def _refreshed(self) -> None:
        """Re-resolve the listed names once for all concurrent callers, at most once per ``min_refresh_s``."""
        if self._refresh is not None and self._refresh.get_loop() is not asyncio.get_running_loop():
            self._refresh = None  # left by an event loop that has ended
        if self._refresh is None:
            if time.monotonic() - self._resolved_at < self.min_refresh_s:
                return
            self._refresh = asyncio.ensure_future(self._resolve_all())
        task = self._refresh
        try:
            await asyncio.shield(task)
        finally:
            if task.done() and self._refresh is task:
                self._refresh = None

    async def _resolve_all(self) -> None:
        names = [e.host for e in self.entries or () if not e.is_address]
        results = await asyncio.gather(*(self._resolve_one(n) for n in names))
        for name, addresses in zip(names, results):
            if addresses is not None:
                self._addresses[name] = addresses
        self._resolved_at = time.monotonic()

    async def _resolve_one(self, name: str) -> frozenset[str] | None:
        try:
            async with asyncio.timeout(self.resolve_timeout_s):
                return await self.resolver(name)
        except (OSError, TimeoutError) as e:
            kept = ", ".join(sorted(self._addresses.get(name, ()))) or "none"
            log.warning("resolving prefill host %s failed (%r); keeping its last known addresses: %s", name, e, kept)
            return None


@functools.cache
def prefill_hosts(raw: str) -> PrefillHosts:
    """One allow-list per ``--prefill-hosts`` value, so intake and handshake share its cache."""
    return PrefillHosts.from_flag(raw)
