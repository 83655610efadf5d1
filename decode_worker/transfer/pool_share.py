"""Hands a shared KV pool's fd (never a path) to same-host peers of our uid holding the key (docs/security.md)."""
from __future__ import annotations

import asyncio
import hmac
import logging
import os
import re
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field

from decode_worker.core.shared_memory import (
    MappedRegion,
    SharedFile,
    boot_id,
    check_memory_file,
    exited,
    map_read_only,
    mappable_bytes,
)
from decode_worker.core.threads import started_pool

logger = logging.getLogger(__name__)

SOCKET_PREFIX = "decode-worker-kv"
MAP_TIMEOUT_S = 1.0
"""How long asking a peer for its pool may take (connect, receive, check, map) before it is read over NIXL."""
_ASKER = started_pool(2, "kv-pool-ask")  # not queued behind others' work
REQUEST_S = 1.0
"""How long the owner waits for a connected peer to send its key before it hangs up."""
MAX_CLIENTS = 16
"""Connections of our uid the owner holds at once; one more hangs up on the longest silent (a peer sends its key
as soon as it connects), so a flood of idle connections cannot keep a peer out. Another uid's are refused at
accept and never held."""
REFUSED_LOG_S = 10.0
CONNECT_RETRY_S = 0.002
_HEX = {"socket": re.compile(r"[0-9a-f]{32}"), "key": re.compile(r"[0-9a-f]{64}")}
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def socket_name(pid: int, socket_id: str) -> bytes:
    """The owner's abstract socket, from its pid and id."""
    return f"\0{SOCKET_PREFIX}-{pid}-{socket_id}".encode()


@dataclass(frozen=True)
class SharedRegion:
    """How a same-host peer asks for a pool (in the handshake answer); ``key`` is secret, out of ``repr``."""

    host: str  # boot id
    pid: int  # the owner's
    socket: str  # random id in the socket's name
    nbytes: int
    key: str = field(repr=False)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: object) -> SharedRegion:
        """Parse and check a peer's region; ``ValueError`` names the bad field."""
        if not isinstance(d, dict):
            raise ValueError(f"shared: expected an object, got {type(d).__name__}")
        host = _field(d, "host", str)
        if not 0 < len(host) <= 64:
            raise ValueError("shared.host: expected a boot id of 1 to 64 characters")
        pid, nbytes = _field(d, "pid", int), _field(d, "nbytes", int)
        if pid <= 0 or nbytes <= 0:
            raise ValueError(f"shared.{'pid' if pid <= 0 else 'nbytes'}: expected a positive integer")
        for name, pattern in _HEX.items():
            if not pattern.fullmatch(_field(d, name, str)):
                raise ValueError(f"shared.{name}: expected {pattern.pattern}")
        return cls(host, pid, d["socket"], nbytes, d["key"])


def _field(d: dict, name: str, kind: type):
    value = d.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"shared.{name}: expected {kind.__name__}, got {type(value).__name__}")
    return value


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """The kernel's ``(pid, uid)`` of a Unix socket's other end."""
    pid, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return pid, uid


class PoolServer:
    """Serves the sealed pool file, from a thread, to our uid's peers holding the key; it sends its own dup, never an
    fd number the process may have reused."""

    def __init__(self, shared: SharedFile):
        self._fd = os.dup(shared.fd)
        self._key = secrets.token_hex(32)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            socket_id = secrets.token_hex(16)
            self._listener.bind(socket_name(os.getpid(), socket_id))
            self._listener.listen(socket.SOMAXCONN)  # a full backlog fails a peer's connect at once (EAGAIN)
            self._listener.setblocking(False)
        except BaseException:
            self._listener.close()
            os.close(self._fd)
            raise
        self.region = SharedRegion(boot_id(), os.getpid(), socket_id, shared.nbytes, self._key)
        self._warned_at = float("-inf")
        self._wake, self._woken = socket.socketpair()
        self._thread = threading.Thread(target=self._serve, name="kv-pool-share", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving and close our descriptor."""
        if self._thread.is_alive():
            self._wake.send(b"x")
            self._thread.join(5)
        for s in (self._wake, self._woken, self._listener):
            s.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _serve(self) -> None:
        clients: dict[socket.socket, tuple[float, bytes]] = {}  # connection -> (deadline, what it sent so far)
        with selectors.DefaultSelector() as selector:
            selector.register(self._listener, selectors.EVENT_READ)
            selector.register(self._woken, selectors.EVENT_READ)
            while True:
                now = time.monotonic()
                wait = min((deadline for deadline, _ in clients.values()), default=now + 3600) - now
                for key, _ in selector.select(max(0.0, wait)):
                    if key.fileobj is self._woken:
                        for conn in clients:
                            conn.close()
                        return
                    try:
                        if key.fileobj is self._listener:
                            self._accept(selector, clients)
                        else:
                            self._receive(selector, clients, key.fileobj)
                    except Exception:  # a bug: one connection is lost, the pool stays served
                        logger.exception("pool share: serving a connection failed")
                        if key.fileobj in clients:
                            self._hang_up(selector, clients, key.fileobj)
                now = time.monotonic()
                for conn in [c for c, (deadline, _) in clients.items() if deadline <= now]:
                    logger.warning("pool share: a local process connected and sent no key within %.1f s", REQUEST_S)
                    self._hang_up(selector, clients, conn)

    def _accept(self, selector: selectors.BaseSelector, clients: dict) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of descriptors, say: the peer reads over NIXL
                logger.warning("pool share: cannot accept a connection: %r", e)
                return
            pid, uid = peer_credentials(conn)
            if uid != os.getuid():
                _drain(conn)  # closing with unread bytes would reset the connection before it reads why
                self._refuse(conn, pid, f"uid {uid} is not ours")
                conn.close()
                continue
            if len(clients) >= MAX_CLIENTS:
                self._hang_up(selector, clients, next(iter(clients)))  # the oldest: dicts keep insertion order
            conn.setblocking(False)
            clients[conn] = (time.monotonic() + REQUEST_S, b"")
            selector.register(conn, selectors.EVENT_READ)

    def _receive(self, selector: selectors.BaseSelector, clients: dict, conn: socket.socket) -> None:
        deadline, request = clients[conn]
        try:
            chunk = conn.recv(128)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        request += chunk
        if b"\n" in request:
            try:
                self._answer(conn, request.partition(b"\n")[0])
            except OSError as e:  # the peer left: it reads over NIXL
                logger.debug("pool share: answering a peer failed: %r", e)
        elif chunk and len(request) <= 128:
            clients[conn] = (deadline, request)
            return
        self._hang_up(selector, clients, conn)

    def _answer(self, conn: socket.socket, key: bytes) -> None:
        """The file for the key (the connection is our uid's: ``_accept``), else a refusal."""
        if hmac.compare_digest(key, self._key.encode()):
            socket.send_fds(conn, [b"ok"], [self._fd])
        else:
            self._refuse(conn, peer_credentials(conn)[0], "wrong key")

    def _refuse(self, conn: socket.socket, pid: int, why: str) -> None:
        """Say why, without waiting; a warning at most every ``REFUSED_LOG_S`` (a flood is one line, not many)."""
        now = time.monotonic()
        if now - self._warned_at >= REFUSED_LOG_S:
            self._warned_at = now
            logger.warning("pool share: refused process %d: %s (further refusals within %.0f s are logged at debug)",
                           pid, why, REFUSED_LOG_S)
        else:
            logger.debug("pool share: refused process %d: %s", pid, why)
        try:
            conn.send(f"refused: {why}".encode(), socket.MSG_DONTWAIT)
        except OSError:  # it left, or its buffer is full: it is refused all the same
            pass

    @staticmethod
    def _hang_up(selector: selectors.BaseSelector, clients: dict, conn: socket.socket) -> None:
        selector.unregister(conn)
        del clients[conn]
        conn.close()


def _drain(conn: socket.socket) -> None:
    """Read what ``conn`` has sent so far, without waiting."""
    try:
        while conn.recv(4096, socket.MSG_DONTWAIT):
            pass
    except OSError:
        pass


def serve_pool(shared: SharedFile) -> PoolServer | None:
    """Our pool's server, or None (logged) where the host refuses one: peers then use NIXL."""
    try:
        return PoolServer(shared)
    except OSError as e:
        logger.warning("the KV pool is not shared with peers on this host (they read it over NIXL): %r", e)
        return None


def ask_for_pool(region: SharedRegion, num_pages: int, page_bytes: int,
                 done: Callable[[MappedRegion | None, str], None]) -> asyncio.Task | None:
    """Hand ``done`` ``region``'s mapped pool or why not: on a thread under a running loop (returns the task, for
    ``settled``), else at once."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        done(*receive_pool(region, num_pages, page_bytes, MAP_TIMEOUT_S))
        return None
    return loop.create_task(_ask(loop, region, num_pages, page_bytes, done))


async def _ask(loop: asyncio.AbstractEventLoop, region: SharedRegion, num_pages: int, page_bytes: int,
               done: Callable[[MappedRegion | None, str], None]) -> None:
    asked = _ASKER.submit(receive_pool, region, num_pages, page_bytes, MAP_TIMEOUT_S)
    try:
        mapped, why = await asyncio.shield(asyncio.wrap_future(asked, loop=loop))
    except asyncio.CancelledError:  # the loop is closing: the mapping, when it comes, is nobody's (the callback
        asked.add_done_callback(_close_unclaimed)  # runs on the asking thread: the loop may be closed by then)
        raise
    except Exception as e:  # a bug, not the peer's doing: it is still read over NIXL, and the log says why
        mapped, why = None, f"asking for it failed: {e!r}"
    done(mapped, why)


def _close_unclaimed(work: Future) -> None:
    if not work.cancelled() and work.exception() is None and work.result()[0] is not None:
        work.result()[0].close()


async def settled(asking: asyncio.Task | None, deadline: float) -> None:
    """Wait for ``asking`` to end, at most ``MAP_TIMEOUT_S`` and never past ``deadline``."""
    if asking is not None and not asking.done():
        await asyncio.wait({asking}, timeout=max(0.0, min(deadline - time.monotonic(), MAP_TIMEOUT_S)))


def receive_pool(region: SharedRegion, num_pages: int, page_bytes: int, timeout_s: float,
                 uid: int | None = None) -> tuple[MappedRegion | None, str]:
    """Map ``region``'s pool read-only if its owner (``region.pid``, running as ``uid``) sends it within
    ``timeout_s``: ``(mapping, "")`` or ``(None, why not)``."""
    deadline = time.monotonic() + timeout_s
    uid = os.getuid() if uid is None else uid
    if region.host != boot_id():
        return None, "it runs on another host"
    if region.nbytes != num_pages * page_bytes:
        return None, f"its region of {region.nbytes} bytes is not its pool of {num_pages} pages of {page_bytes} bytes"
    if region.nbytes > mappable_bytes():
        return None, f"its region of {region.nbytes} bytes is larger than this host's memory"
    try:
        pidfd = os.pidfd_open(region.pid)  # first: if this is still the sender once the file checks out, it was
    except OSError as e:                  # the sender all along, so a reused pid cannot slip in between
        return None, f"its process {region.pid} cannot be watched ({e.strerror})"
    try:
        fd, why = _fetch(region, uid, deadline)
        if fd >= 0:
            try:
                why = check_memory_file(fd, region.nbytes, uid) or ("its process exited" if exited(pidfd) else "")
                if not why:
                    return map_read_only(fd, region.nbytes, page_bytes, pidfd), ""
            finally:
                os.close(fd)
    except OSError as e:
        why = f"its memory file cannot be checked or mapped ({e!r})"
    except BaseException:
        os.close(pidfd)
        raise
    os.close(pidfd)
    return None, why


def _connect(sock: socket.socket, name: bytes, deadline: float) -> None:
    """Connect by ``deadline``: a Unix socket whose backlog is full refuses at once (EAGAIN), so try again until
    then (its owner drains the backlog as fast as it can accept)."""
    while True:
        sock.settimeout(max(0.0, deadline - time.monotonic()))
        try:
            sock.connect(name)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise TimeoutError from None
            time.sleep(CONNECT_RETRY_S)


def _fetch(region: SharedRegion, uid: int, deadline: float) -> tuple[int, str]:
    """The owner's fd, sent for the key: ``(fd, "")`` or ``(-1, why not)``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
        try:
            _connect(sock, socket_name(region.pid, region.socket), deadline)
            pid, their_uid = peer_credentials(sock)
            if pid != region.pid:
                return -1, f"its pool socket is served by process {pid}, not {region.pid}"
            if their_uid != uid:
                return -1, f"its pool socket is served by uid {their_uid}, not {uid}"
            sock.sendall(region.key.encode() + b"\n")
            sock.settimeout(max(0.0, deadline - time.monotonic()))
            message, fds, flags, _ = socket.recv_fds(sock, 128, 1, socket.MSG_CMSG_CLOEXEC)
        except TimeoutError:
            return -1, "its pool socket did not answer in time"
        except OSError as e:
            return -1, f"its pool socket cannot be reached ({e.strerror or e!r})"
    if len(fds) == 1 and message == b"ok" and not flags & socket.MSG_CTRUNC:
        return fds[0], ""
    for fd in fds:
        os.close(fd)
    return -1, f"its pool socket answered {message[:80]!r} with {len(fds)} descriptors"
